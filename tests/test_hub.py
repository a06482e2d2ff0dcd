"""Pushing a finished run to a local server that speaks the Hub endpoints huggingface_hub uses."""

import json
import shutil
import subprocess
import sys

import pytest
from helpers import REPO, env
from hub_server import FakeHub

RECIPE = str(REPO / "recipes" / "tiny-pretrain.yaml")


@pytest.fixture(scope="module")
def one_process_runs(tmp_path_factory) -> dict:
    """Two `hf-diloco train` runs of one process, trained in turn by one Python (tests/scripts/train_runs.py):
    "run", tiny-pretrain for 6 steps with a checkpoint every 3, and "ddp", the DDP baseline recipe for 2 steps."""
    folder = tmp_path_factory.mktemp("pushme")
    runs = {"run": (RECIPE, ["--max_steps", "6", "--inner_steps", "3", "--block_size", "64", "--eval_steps", "3",
                             "--save_strategy", "steps", "--save_steps", "3", "--disable_tqdm", "true"]),
            "ddp": (str(REPO / "recipes" / "ddp-baseline.yaml"), [
                "--max_steps", "2", "--block_size", "32", "--eval_strategy", "no", "--eval_on_start", "false",
                "--disable_tqdm", "true"])}
    payload = [{"name": name, "recipe": recipe, "args": [*args, "--output_dir", str(folder / name)]}
               for name, (recipe, args) in runs.items()]
    result = subprocess.run([sys.executable, str(REPO / "tests" / "scripts" / "train_runs.py"), json.dumps(payload)],
                            capture_output=True, text=True, env=env(), cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return {name: folder / name for name in runs}


@pytest.fixture(scope="module")
def finished_run(one_process_runs):
    return one_process_runs["run"]


def push(out, hub, *extra, token="hf_secret_token_123"):
    command = [sys.executable, "-m", "hf_diloco.cli", "push", str(out), *extra]
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO,
                          env={**env(), "HF_ENDPOINT": hub.url, "HF_TOKEN": token, "HF_HUB_OFFLINE": "0"})


@pytest.mark.process
def test_push_uploads_model_tokenizer_and_diloco_card(finished_run):
    with FakeHub() as hub:
        result = push(finished_run, hub, "--repo-id", "alice/tiny-diloco", "--private")
        assert result.returncode == 0, result.stderr[-3000:]
        files = hub.files["alice/tiny-diloco"]
        assert hub.repos["alice/tiny-diloco"]["visibility"] == "private"
    # Exactly what a model repository needs: weights, configs, tokenizer, card, curve, sync log and run config.
    assert sorted(files) == ["README.md", "config.json", "generation_config.json", "model.safetensors",
                             "run_config.json", "syncs.jsonl", "tokenizer_config.json", "training_curve.png"]
    assert len(hub.commits) == 1, "one commit"
    assert f"[push] 8 files: {', '.join(sorted(files))}" in result.stdout
    # The run folder holds checkpoints (with per-replica optimizer states), TensorBoard files and run metrics;
    # none of them belongs in the model repository.
    local = {str(p.relative_to(finished_run)) for p in finished_run.rglob("*") if p.is_file()}
    for kept_local in ("checkpoint-3/model.safetensors", "checkpoint-6/process-0/optimizer.pt", "run_metrics.json"):
        assert kept_local in local, sorted(local)
    assert any(name.startswith("runs/") for name in local)
    assert not any(name.startswith(("checkpoint", "replica-", "runs")) or "/" in name for name in files), sorted(files)
    for kept_local in ("run_metrics.json", "progress.json", "trainer_log.jsonl", "training_args.bin",
                       "diloco_summary.json"):
        assert kept_local in local and kept_local not in files
    card = files["README.md"].decode()
    assert "- diloco" in card and "- hf-diloco" in card
    assert "| H, inner steps between syncs (`inner_steps`) | 3 | 500 |" in card
    assert "| outer learning rate (`outer_lr`) | 0.7 | 0.7 |" in card
    assert "![training curve](training_curve.png)" in card and files["training_curve.png"][:4] == b"\x89PNG"
    rounds = [json.loads(line) for line in files["syncs.jsonl"].decode().splitlines()]
    assert [r["step"] for r in rounds] == [3, 6]
    assert all(t == "Bearer hf_secret_token_123" for t in hub.tokens)
    # The token never reaches the uploaded files, the run folder or the output.
    assert not any(b"hf_secret_token_123" in content for content in files.values())
    assert "hf_secret_token_123" not in result.stdout + result.stderr
    assert not any(b"hf_secret_token_123" in p.read_bytes() for p in finished_run.rglob("*") if p.is_file())


@pytest.mark.process
@pytest.mark.parametrize("repo_id,token,words", [
    ("my model", "hf_x", ["repo id", "not valid"]),
    ("alice/ok", "", ["no Hugging Face token"]),
])
def test_bad_push_input_is_one_sentence(finished_run, repo_id, token, words, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # no stored login either
    with FakeHub() as hub:
        result = push(finished_run, hub, "--repo-id", repo_id, token=token)
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert all(w in result.stderr for w in words), result.stderr
        assert hub.commits == []


@pytest.mark.process
def test_a_pushed_run_names_its_local_model_and_data_by_their_base_names_only(finished_run, tmp_path):
    """A LoRA run trained from a model and a dataset kept in a folder of one's own (`private-corpus-dir`), pushed
    once that folder is gone (as from another machine, so nothing can be told by looking at the disk): no uploaded
    file, card included, holds the folder's name (peft records its base model's path in adapter_config.json); the
    card, run_config.json and adapter_config.json name model and data by their base names, and the card's metadata
    lists neither as a Hub base model or dataset. The run folder keeps its own record whole, and a Hub id is listed
    as what it is."""
    from hf_diloco.hub import model_card

    private = tmp_path / "private-corpus-dir"
    base = private / "tiny-base"
    base.mkdir(parents=True)
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer_config.json"):
        shutil.copy(finished_run / name, base / name)
    corpus = private / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"note {i}: the quick brown fox jumps over the lazy dog. " * 3})
                              + "\n" for i in range(200)))
    out = tmp_path / "out" / "run"
    command = [sys.executable, "-m", "hf_diloco.cli", "train", "--config", RECIPE, "--output_dir", str(out),
               "--model_name_or_path", str(base), "--dataset_name", str(corpus), "--max_steps", "3",
               "--inner_steps", "3", "--block_size", "32", "--eval_strategy", "no", "--eval_on_start", "false",
               "--disable_tqdm", "true", "--lora_r", "2"]
    result = subprocess.run(command, capture_output=True, text=True, env=env(), cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert str(base) in (out / "adapter_config.json").read_text(), "peft wrote down the base model's path"
    shutil.rmtree(private)
    with FakeHub() as hub:
        result = push(out, hub, "--repo-id", "alice/private-data")
        assert result.returncode == 0, result.stderr[-3000:]
        files = hub.files["alice/private-data"]
    assert {"README.md", "run_config.json", "adapter_model.safetensors", "adapter_config.json"} <= set(files), \
        sorted(files)
    leaked = [name for name, content in files.items() if b"private-corpus-dir" in content
              or str(tmp_path).encode() in content]
    assert leaked == [], f"these uploaded files name the private folder: {leaked}"
    pushed = json.loads(files["run_config.json"])["run"]
    assert (pushed["model_name_or_path"], pushed["dataset_name"]) == ("tiny-base", "corpus.jsonl")
    assert json.loads(files["adapter_config.json"])["base_model_name_or_path"] == "tiny-base"
    card = files["README.md"].decode()
    assert "| model | tiny-base |" in card and "| data | corpus.jsonl |" in card, card
    metadata = card.split("---")[1]
    assert "datasets" not in metadata and "base_model" not in metadata, metadata
    kept = json.loads((out / "run_config.json").read_text())["run"]
    assert (kept["model_name_or_path"], kept["dataset_name"]) == (str(base), str(corpus)), "the local record is whole"

    hub_ids = {"run": {"model_name_or_path": "HuggingFaceTB/SmolLM2-135M", "dataset_name": "roneneldan/TinyStories"}}
    card = model_card(out, "alice/x", curve=False, settings=hub_ids)
    assert "base_model: HuggingFaceTB/SmolLM2-135M" in card and "datasets:\n- roneneldan/TinyStories" in card, card


@pytest.mark.process
def test_push_of_a_missing_folder_says_so_before_asking_for_a_token(tmp_path, monkeypatch):
    """With no token anywhere (no HF_TOKEN, no stored login), a push of a folder that does not exist says that the
    folder does not exist, in one sentence, exit 2: the folder is checked before the token is looked for."""
    monkeypatch.setenv("HOME", str(tmp_path))
    with FakeHub() as hub:
        result = push(tmp_path / "no-such-run", hub, "--repo-id", "alice/model", token="")
        assert hub.tokens == []
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip() == f"hf-diloco: error: output folder {str(tmp_path / 'no-such-run')!r} does not " \
                                    f"exist.", result.stderr


def truncate(path, keep: int = 40) -> None:
    path.write_bytes(path.read_bytes()[:keep])


@pytest.mark.process
@pytest.mark.parametrize("damaged", ["model.safetensors", "config.json", "tokenizer_config.json", "../run.json"])
def test_push_of_a_run_with_a_damaged_file_names_the_file(finished_run, tmp_path, monkeypatch, damaged):
    """A copy of the finished run with one file cut short (the weights, a config, or the app's run.json beside the
    output folder) is refused before any token is looked for or anything is sent: exit 2, one sentence that names
    the file, no traceback."""
    monkeypatch.setenv("HOME", str(tmp_path))
    out = tmp_path / "run" / "output"
    shutil.copytree(finished_run, out, ignore=shutil.ignore_patterns("checkpoint-*", "runs"))
    run_json = {"id": "run", "recipe": RECIPE, "accelerate_config": "", "overrides": [], "command": ["true"],
                "output_dir": str(out), "status": "finished"}
    (out.parent / "run.json").write_text(json.dumps(run_json))
    target = (out / damaged).resolve()
    truncate(target)
    with FakeHub() as hub:
        result = push(out, hub, "--repo-id", "alice/model", token="")
        assert hub.tokens == [] and hub.commits == []
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hf-diloco: error: "), result.stderr
    assert str(target) in lines[0] and "Hugging Face token" not in lines[0], lines[0]


def python_push(out, private, hub, *extra):
    """tests/scripts/python_push.py, pushing to `hub`."""
    return subprocess.run([sys.executable, str(REPO / "tests" / "scripts" / "python_push.py"), str(out),
                           str(private), *extra], capture_output=True, text=True, cwd=REPO, timeout=300,
                          env={**env(), "HF_ENDPOINT": hub.url, "HF_TOKEN": "hf_py", "HF_HUB_OFFLINE": "0"})


@pytest.mark.process
def test_push_to_hub_from_python_pushes_what_hf_diloco_push_pushes(tmp_path):
    """`DiLoCoTrainer.push_to_hub()` from Python (no CLI, no run_config.json), for a LoRA run whose base model and
    corpus lie in a folder of one's own (`private-corpus-dir`, tests/scripts/python_push.py): it uploads, in one
    commit with the given message, what `hf-diloco push` uploads and nothing else (not Trainer's whole output
    folder: `training_args.bin` is a pickle of the run's paths, peft's README names the base model's path), no
    uploaded file names the private folder or where the run lay, and it returns huggingface_hub's CommitInfo. The
    card's settings table is the trainer's own args."""
    out, private = tmp_path / "python-run", tmp_path / "private-corpus-dir"
    with FakeHub() as hub:
        result = python_push(out, private, hub)
        assert result.returncode == 0, result.stderr[-3000:]
        files = hub.files["alice/from-python"]
        assert [c["header"]["summary"] for c in hub.commits] == ["DiLoCo from Python"]
        assert f"push_to_hub returned CommitInfo {hub.url}/alice/from-python/commit/1" in result.stdout
    assert sorted(files) == ["README.md", "adapter_config.json", "adapter_model.safetensors", "run_config.json",
                             "syncs.jsonl", "training_curve.png"]
    # What Trainer.push_to_hub would have sent holds the paths: the pickled args, peft's README and config.
    assert str(out).encode() in (out / "training_args.bin").read_bytes()
    assert str(private) in (out / "README.md").read_text() and str(private) in (out / "adapter_config.json").read_text()
    leaked = [name for name, content in files.items()
              if b"private-corpus-dir" in content or str(tmp_path).encode() in content]
    assert leaked == [], f"these uploaded files name the private folder or the run's place: {leaked}"
    assert json.loads(files["adapter_config.json"])["base_model_name_or_path"] == "tiny-base"
    assert json.loads(files["run_config.json"])["run"]["model_name_or_path"] == "tiny-base"
    assert "base_model" not in files["README.md"].decode().split("---")[1]
    # The trainer recorded its own settings, so the folder also gets the full card from `hf-diloco push` (which
    # reads the folder, not a live trainer) and from the app.
    from hf_diloco.hub import model_card

    for card in (files["README.md"].decode(), model_card(out, "alice/from-python", curve=False)):
        for row in ("| H, inner steps between syncs (`inner_steps`) | 4 | 500 |",
                    "| outer learning rate (`outer_lr`) | 0.6 | 0.7 |",
                    "| outer momentum (`outer_momentum`) | 0.8 | 0.9 |",
                    "| replicas | 1 | 8 |",
                    "| inner learning_rate | 0.002 | |",
                    "| inner max_steps | 8 | |",
                    "| model | tiny-base |"):
            assert row in card, card
        assert "- diloco" in card


class EveryUpload(dict):
    """A repo's files on the FakeHub that also keeps every upload as (index of its commit, name, content): the fake
    Hub stores a commit's files, then appends the commit to `commits`."""

    def __init__(self, commits: list):
        super().__init__()
        self.commits, self.uploads = commits, []

    def __setitem__(self, name, content):
        self.uploads.append((len(self.commits), name, content))
        super().__setitem__(name, content)


@pytest.mark.process
def test_push_to_hub_during_training_pushes_what_push_to_hub_pushes(tmp_path):
    """`push_to_hub=True` in the args of a DiLoCoTrainer from Python makes Trainer push at every save during
    training (tests/scripts/python_push.py --push-while-training: LoRA on a base model and corpus in a private
    folder, a checkpoint every 4 of 8 steps, hub_strategy all_checkpoints, then `push_to_hub()`). Each such commit,
    "Training in progress, step N", holds what `push_to_hub()` pushes, with the checkpoint's weights, its sync log
    and a card that says the run was still training; never what Trainer's own push sends: the whole output folder
    (`training_args.bin`, a run_config.json and configs with the private folder's path) and the checkpoint folders
    (optimizer and outer state). Every upload of every commit is checked, not only the files the repo ends with: a
    later commit overwrites an earlier one's."""
    out, private = tmp_path / "python-run", tmp_path / "private-corpus-dir"
    with FakeHub() as hub:
        hub.files["alice/from-python"] = received = EveryUpload(hub.commits)  # kept by the repo's creation
        result = python_push(out, private, hub, "--push-while-training")
        assert result.returncode == 0, result.stderr[-3000:]
        summaries = [c["header"]["summary"] for c in hub.commits]
    leaked = [(summaries[commit], name) for commit, name, content in received.uploads
              if name == "training_args.bin" or name.startswith(("checkpoint-", "last-checkpoint")) or "/" in name
              or b"private-corpus-dir" in content or str(tmp_path).encode() in content]
    assert leaked == [], f"uploaded during training, and not by push_to_hub(): {leaked}"
    # Step 4's push always happens; step 8's is skipped while step 4's is still committing (Trainer's rule), and
    # train() waits for the last one before it returns.
    assert summaries[0] == "Training in progress, step 4" and summaries[-1] == "DiLoCo from Python", summaries
    assert set(summaries[1:-1]) <= {"Training in progress, step 8"}, summaries
    at_step_4 = {name: content for commit, name, content in received.uploads if commit == 0}
    assert sorted(at_step_4) == ["README.md", "adapter_config.json", "adapter_model.safetensors", "run_config.json",
                                 "syncs.jsonl", "training_curve.png"]
    assert at_step_4["adapter_model.safetensors"] == (out / "checkpoint-4" / "adapter_model.safetensors").read_bytes()
    assert [json.loads(line)["step"] for line in at_step_4["syncs.jsonl"].decode().splitlines()] == [4]
    assert at_step_4["adapter_model.safetensors"] != received["adapter_model.safetensors"], "step 8 trained on"
    assert "> **This run was still training at step 4 of 8.**" in at_step_4["README.md"].decode()
    assert "| how the run ended | finished |" in received["README.md"].decode()


@pytest.mark.process
def test_ddp_baseline_card_describes_data_parallel_training(one_process_runs):
    """A `trainer: ddp` run is pushed with a card that says what ran: no DiLoCo description, settings or tag."""
    from hf_diloco.hub import model_card

    out = one_process_runs["ddp"]
    card = model_card(out, "alice/ddp")
    assert "data-parallel baseline" in card and "gradients all-reduced at every step" in card
    assert "using DiLoCo" not in card and "DiLoCo settings" not in card and "- diloco" not in card
    assert "inner_steps" not in card and "replicas" not in card
    assert "| processes | 1 |" in card and "| max_steps | 2 |" in card


def test_card_of_a_slow_link_run_lists_its_codec_and_streaming_settings(tmp_path):
    """The settings table says which codec, error feedback, fragments and overlap the run used; the results give
    the codec's ratio over the whole run (fp32 bytes ÷ bytes sent, summed over its rounds: (2·7.9 + 1·7.0) / 3)
    and the H that inner_steps auto chose."""
    from hf_diloco import DiLoCoConfig
    from hf_diloco.hub import model_card, run_settings

    args = DiLoCoConfig(output_dir=str(tmp_path), inner_steps=50, compression="int4", error_feedback=True,
                        num_fragments=5, sync_delay=2, report_to="none")
    rounds = [{"round": 1, "step": 10, "loss": 3.0, "compression": "int4+ef", "compression_ratio": 7.9,
               "bytes_per_replica": 2_000_000},
              {"round": 2, "step": 20, "loss": 2.5, "compression": "int4+ef", "compression_ratio": 7.0,
               "bytes_per_replica": 1_000_000,
               "inner_steps_auto": {"chosen": 40, "from_step": 20, "step_seconds": 0.05, "sync_seconds": 0.1,
                                    "max_sync_overhead": 0.05}}]
    (tmp_path / "syncs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    card = model_card(tmp_path, settings=run_settings(args, trainer="diloco"), curve=False)
    assert "| fewer bytes than fp32 syncs (compression) | 7.6x |" in card
    assert "| H chosen by inner_steps auto | 40 from step 20 (a step 0.05 s, waiting for a sync 0.1 s, at most 5% " \
           "waiting) |" in card
    assert "| pseudo-gradient compression (`compression`) | int4 | none |" in card
    assert "| error feedback (`error_feedback`) | True | False |" in card
    assert "| streaming fragments (`num_fragments`) | 5 | 1 |" in card
    assert "| sync overlapped with inner steps (τ) (`sync_delay`) | 2 | 0 |" in card
    assert "| last syncs staggered, so the end waits for no exchange (`staggered_end`) | True | False |" in card


def test_card_counts_the_contributions_the_checks_left_out(tmp_path):
    """The results give the `excluded` entries of every committed sync; the settings say the checks' mode. A run
    whose records predate the checks has no such row."""
    from hf_diloco import DiLoCoConfig
    from hf_diloco.hub import model_card, run_settings

    args = DiLoCoConfig(output_dir=str(tmp_path), report_to="none")
    left_out = [{"replica": 2, "reason": "apart: far from the others"}]
    rounds = [{"round": 1, "step": 10, "loss": 3.0, "bytes_per_replica": 100, "excluded": left_out},
              {"round": 2, "step": 20, "loss": 2.5, "bytes_per_replica": 100, "excluded": []},
              {"round": 3, "step": 30, "loss": 2.4, "bytes_per_replica": 100, "excluded": left_out * 2},
              {"round": 4, "step": 40, "loss": 2.3, "bytes_per_replica": 100, "excluded": left_out,
               "committed": False}]
    (tmp_path / "syncs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    card = model_card(tmp_path, settings=run_settings(args, trainer="diloco"), curve=False)
    assert "| contributions left out by the checks | 3 |" in card
    assert "| contributions checked before each merge (`contribution_checks`) | exclude | off |" in card
    (tmp_path / "syncs.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if k != "excluded"})
                                                        + "\n" for r in rounds))
    assert "contributions left out" not in model_card(tmp_path, settings=run_settings(args, trainer="diloco"),
                                                      curve=False)
