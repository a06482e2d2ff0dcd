"""The command line: bad input gets one sentence and a non-zero exit, never a traceback; launch builds the command."""

import json
from pathlib import Path

import pytest
from helpers import REPO, cli, hf_diloco

RECIPE = str(REPO / "recipes" / "tiny-pretrain.yaml")


def assert_one_sentence_error(result, *words):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout
    lines = [line for line in result.stderr.splitlines() if line.startswith("hf-diloco: error:")]
    assert len(lines) == 1, result.stderr[-2000:]
    for word in words:
        assert word in lines[0], lines[0]


@pytest.fixture
def bad_inputs(tmp_path):
    unknown_key = tmp_path / "unknown.yaml"
    unknown_key.write_text("inner_steps: 10\nouter_lerning_rate: 0.5\n")
    no_text = tmp_path / "no_text.jsonl"
    no_text.write_text("\n".join(json.dumps({"content": f"line {i}"}) for i in range(5)))
    out = str(tmp_path / "out")
    return {
        "H = 0": (["--inner_steps", "0"], ["inner_steps"]),
        "negative outer lr": (["--outer_lr", "-0.1"], ["outer_lr"]),
        "unknown recipe key": (["--config", str(unknown_key)], ["outer_lerning_rate"]),
        "no text column": (["--dataset_name", str(no_text)], ["text", "content"]),
        "missing model path": (["--model_name_or_path", str(tmp_path / "nowhere")], ["does not exist"]),
        "missing recipe": (["--config", str(tmp_path / "absent.yaml")], ["absent.yaml"]),
        "negative linger": (["--outer_backend", "torchft", "--end_linger_seconds", "-1"], ["end_linger_seconds"]),
        "_out": out,
    }


@pytest.mark.parametrize("case", ["H = 0", "negative outer lr", "unknown recipe key", "no text column",
                                  "missing model path", "missing recipe", "negative linger"])
def test_bad_input_is_one_sentence_and_nonzero_exit(bad_inputs, case):
    args, words = bad_inputs[case]
    base = [] if "--config" in args else ["--config", RECIPE]
    result = cli("train", *base, "--output_dir", bad_inputs["_out"], "--max_steps", "2", "--inner_steps", "2",
                       *args)
    assert_one_sentence_error(result, *words)


def test_an_h_above_max_steps_is_a_note_of_the_dry_run_not_a_refusal(tmp_path):
    """The dry run (and so `launch`, which checks what it checks) takes H = 50 over 40 steps and says what happens,
    in the words the run warns with."""
    from hf_diloco.checks import rounds_note

    result = cli("train", "--config", RECIPE, "--output_dir", str(tmp_path / "out"), "--max_steps", "40",
                 "--inner_steps", "50", "--dry-run")
    assert result.returncode == 0, result.stderr
    notes = [line.split(None, 1)[1] for line in result.stdout.splitlines() if line.strip().startswith("note ")]
    assert notes == [rounds_note(50, 40)], result.stdout


def test_a_run_out_of_memory_says_what_to_change_in_one_sentence(tmp_path, monkeypatch):
    """torch's out-of-memory error (as a GPU raises it; a CPU machine's kernel kills the process instead) ends
    `hf-diloco train` with exit 1 and one sentence naming the settings that lower the memory a process needs, the
    batch size as it was set first, and the dry run that measures it."""
    import torch

    from hf_diloco import train as training

    def out_of_memory(run, config):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.10 GiB total)\n"
                                     "See documentation for Memory Management")

    monkeypatch.setattr(training, "train", out_of_memory)
    result = cli("train", "--config", RECIPE, "--output_dir", str(tmp_path / "out"), "--per_device_train_batch_size",
                 "6", "--offload_outer_state", "false")
    assert result.returncode == 1
    assert_one_sentence_error(result, "out of memory (CUDA out of memory. Tried to allocate 2.00 GiB",
                              "lower per_device_train_batch_size (now 6;", "gradient_checkpointing: true",
                              "offload_outer_state: true", "fsdp: true", "--dry-run")
    assert "See documentation" not in result.stderr


@pytest.mark.process
def test_a_refusal_from_a_real_process_is_exit_2_and_one_sentence(tmp_path):
    """The tests around this one call the command's code inside pytest; this one starts `python -m hf_diloco.cli`
    as a user's shell does, so the exit status and the absence of a traceback are the process's own."""
    result = hf_diloco("train", "--config", RECIPE, "--output_dir", str(tmp_path / "out"), "--inner_steps", "0")
    assert result.returncode == 2
    assert_one_sentence_error(result, "inner_steps")
    assert not (tmp_path / "out").exists()


def test_existing_run_is_not_overwritten(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    rounds = out / "syncs.jsonl"
    rounds.write_text('{"round": 1}\n')
    result = cli("train", "--config", RECIPE, "--output_dir", str(out), "--max_steps", "2", "--inner_steps", "2")
    assert_one_sentence_error(result, "already holds a run")
    assert rounds.read_text() == '{"round": 1}\n'


def test_launch_checks_the_accelerate_config_before_starting(tmp_path):
    result = cli("launch", RECIPE, "--accelerate-config", str(tmp_path / "nope.yaml"))
    assert_one_sentence_error(result, "nope.yaml")


def test_launch_dry_run_prints_the_accelerate_command(tmp_path):
    config = str(REPO / "accelerate_configs" / "cpu-2proc.yaml")
    result = cli("launch", RECIPE, "--accelerate-config", config, "--dry-run", "--",
                       "--output_dir", str(tmp_path / "x"), "--inner_steps", "25")
    assert result.returncode == 0, result.stderr
    command = result.stdout.strip().splitlines()[-1].split()
    assert command[1:4] == ["-m", "hf_diloco.accelerate_launch", "--config_file"]
    assert command[command.index("--config") + 1] == RECIPE
    assert command[-2:] == ["--inner_steps", "25"]
    assert not (tmp_path / "x").exists(), "a dry run starts nothing"


def test_a_replica_that_spans_machines_is_warned_of_in_one_line(tmp_path):
    """Two machines: replica_group_size 16 of 8 processes each (one replica over both) and 4 of 6 each (a replica
    straddles the machines) put a replica's every-step traffic across the machines' link, and the launch says so
    once, then goes on; 8 and 4 of 8 each do not."""
    config = str(REPO / "accelerate_configs" / "multi-node.yaml")
    for processes, group, warned in ((16, 16, True), (12, 4, True), (16, 8, False), (16, 4, False)):
        result = cli("launch", RECIPE, "--accelerate-config", config, "--num_processes", str(processes), "--dry-run",
                     "--", "--output_dir", str(tmp_path / "x"), "--replica_group_size", str(group))
        warnings = [line for line in result.stderr.splitlines() if line.startswith("hf-diloco: warning:")]
        assert result.returncode == 0, (group, result.stderr[-2000:])
        assert len(warnings) == warned, (processes, group, warnings)
        if warned:
            assert (f"replica_group_size={group} puts each replica on more than one machine ({processes // 2} "
                    f"processes each)") in warnings[0]


def test_launch_checks_accelerate_launch_flags_with_the_config_and_passes_them_on(tmp_path):
    """accelerate's own flags beside the config are checked as the layout they make with it (rank below the
    machines, processes spread evenly, groups that divide them), then handed to accelerate in its spelling."""
    multi_node = str(REPO / "accelerate_configs" / "multi-node.yaml")
    two = str(REPO / "accelerate_configs" / "cpu-2proc.yaml")
    out = ["--", "--output_dir", str(tmp_path / "x")]
    rank = cli("launch", RECIPE, "--accelerate-config", multi_node, "--machine_rank", "3", "--dry-run", *out)
    assert_one_sentence_error(rank, "rank 3, but there are only 2 machine(s)")
    uneven = cli("launch", RECIPE, "--accelerate-config", two, "--num-processes", "3", "--num_machines", "2",
                       "--dry-run", *out)
    assert_one_sentence_error(uneven, "spreads 3 processes over 2 machines")
    groups = cli("launch", RECIPE, "--accelerate-config", two, "--num_processes", "3", "--dry-run", *out,
                       "--replica_group_size", "2")
    assert_one_sentence_error(groups, "starts 3 processes, which replica_group_size=2 does not divide")
    fine = cli("launch", RECIPE, "--accelerate-config", two, "--num-processes", "4", "--port", "29999",
                     "--dry-run", *out)
    assert fine.returncode == 0, fine.stderr
    command = fine.stdout.strip().splitlines()[-1].split()
    launch = command[:command.index("hf_diloco.cli") - 1]
    assert launch[-4:] == ["--main_process_port", "29999", "--num_processes", "4"], launch


def test_a_torchft_launch_whose_processes_are_not_one_replica_is_refused(tmp_path):
    """On torchft each launch is one replica: an accelerate config of 2 processes needs replica_group_size 2 (and
    with it, --replicas N gives every replica launch its own rendezvous port)."""
    two = str(REPO / "accelerate_configs" / "torchft-replica-2proc.yaml")
    torchft = str(REPO / "recipes" / "torchft-3.yaml")
    out = ["--output_dir", str(tmp_path / "x")]
    wrong = cli("launch", torchft, "--accelerate-config", two, "--replicas", "2", "--dry-run", *out)
    assert_one_sentence_error(wrong, "replica_group_size=1 process(es), but")
    fine = cli("launch", torchft, "--accelerate-config", two, "--replicas", "2", "--dry-run", *out,
                     "--replica_group_size", "2")
    assert fine.returncode == 0, fine.stderr
    commands = [line.split() for line in fine.stdout.splitlines() if "hf_diloco.accelerate_launch" in line]
    ports = [c[c.index("--main_process_port") + 1] for c in commands]
    assert len(commands) == 2 and len(set(ports)) == 2, ports
    assert not (tmp_path / "x").exists(), "a dry run starts nothing"


def test_inner_steps_auto_in_every_spelling_is_the_auto_fields(tmp_path):
    recipe = tmp_path / "auto.yaml"
    recipe.write_text((REPO / "recipes" / "tiny-pretrain.yaml").read_text().replace("inner_steps: 50",
                                                                                    "inner_steps: auto"))
    for args in (["--config", str(recipe)], ["--config", RECIPE, "--inner_steps", "auto"],
                 ["--config", RECIPE, "--inner-steps=auto"]):
        result = cli("train", *args, "--dry-run", "--output_dir", str(tmp_path / "x"))
        assert result.returncode == 0, result.stderr
        assert "auto: 20 for the first rounds, then chosen so that waiting for syncs stays under 5% of compute" \
            in result.stdout, result.stdout


def test_train_help_lists_diloco_fields():
    result = cli("train", "--help")
    assert result.returncode == 0
    for name in ("--inner_steps", "--outer_lr", "--outer_momentum", "--model_name_or_path", "--dataset_name"):
        assert name in result.stdout


def test_type_and_choice_errors_are_one_sentence_without_usage(tmp_path):
    """A value of the wrong type or outside a field's choices: one sentence naming the flag, exit 2, no usage dump."""
    for flag, value in (("--inner_steps", "five"), ("--outer_optimizer", "lion")):
        result = cli("train", "--config", RECIPE, "--output_dir", str(tmp_path / "out"), flag, value)
        assert result.returncode == 2
        assert_one_sentence_error(result, flag, value)
        assert "usage:" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr[:500]
    assert not (tmp_path / "out").exists()


@pytest.fixture
def saved_run(tmp_path):
    """A folder that `hf-diloco push` accepts as a finished run (a model file is all it needs to stage)."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"weights")
    (out / "config.json").write_text("{}")
    return out


def test_unknown_flags_are_errors_for_every_sub_command(tmp_path):
    """A misspelt or shortened flag is refused before anything happens, for every sub-command.

    Before, `push --privte` pushed a public repository, `demo --max-step 5` guessed --max-steps, and recipe
    fields could be shortened (`--outer_l` silently set outer_lr).
    """
    demo_out = tmp_path / "demo"
    demo_out.mkdir()
    cases = [
        (["push", str(tmp_path / "run"), "--repo-id", "alice/model", "--privte"], "--privte"),
        (["demo", "--output-dir", str(demo_out), "--max-step", "5"], "--max-step"),
        (["app", "--auht", "u:p", "--port", "1", "--runs-dir", str(tmp_path / "runs")], "--auht"),
        (["train", "--config", RECIPE, "--dry_run", "true", "--outer_l", "0.5"], "--outer_l"),
        (["train", "--conf", RECIPE, "--dry_run", "true"], "--conf"),
        (["launch", RECIPE, "--accelerate-config", str(REPO / "accelerate_configs" / "cpu-2proc.yaml"),
          "--dry-run", "--", "--inner_step", "3"], "--inner_step"),
    ]
    for args, word in cases:
        result = cli(*args)
        assert result.returncode == 2, (args, result.stdout[-500:])
        assert_one_sentence_error(result, word)


@pytest.mark.process
def test_push_of_a_run_with_an_empty_json_file_names_the_file_in_one_sentence(saved_run):
    """A run folder whose stopped.json is empty (a disk that filled up, a copy cut short): `push` names that file and
    what to do, exits 2 without a traceback, pushes nothing and leaves the file as it was. A misspelt flag
    (`--privte`) is refused the same way before anything reaches the Hub (a local server speaking its endpoints)."""
    from hub_server import FakeHub

    with FakeHub() as hub:
        result = run_with_hub(hub, "push", str(saved_run), "--repo-id", "alice/model", "--privte")
        assert hub.repos == {} and hub.commits == [], "nothing reaches the Hub"
    assert result.returncode == 2
    assert_one_sentence_error(result, "--privte")
    stopped = saved_run / "stopped.json"
    stopped.write_text("")
    with FakeHub() as hub:
        result = run_with_hub(hub, "push", str(saved_run), "--repo-id", "alice/model")
        assert hub.commits == [], "nothing reaches the Hub"
    assert result.returncode == 2
    assert_one_sentence_error(result, f"{stopped} is empty; restore it from a copy, or move it out of the way")
    assert stopped.exists() and stopped.read_text() == ""
    stopped.write_text('{"step": 4')  # cut short
    with FakeHub() as hub:
        result = run_with_hub(hub, "push", str(saved_run), "--repo-id", "alice/model")
    assert_one_sentence_error(result, f"{stopped} is not valid JSON (Expecting")


def run_with_hub(hub, *args):
    import subprocess
    import sys

    from helpers import env

    return subprocess.run([sys.executable, "-m", "hf_diloco.cli", *args], capture_output=True, text=True, cwd=REPO,
                          env={**env(), "HF_ENDPOINT": hub.url, "HF_TOKEN": "hf_x", "HF_HUB_OFFLINE": "0"},
                          timeout=120)


@pytest.mark.parametrize("spelling", [["--dry-run"], ["--dry-run=true"], ["--dry_run"], ["--dry_run", "yes"],
                                      "recipe key", "launch --dry-run"])
def test_every_spelling_of_the_dry_run_skips_device_checks(tmp_path, spelling):
    """A recipe asking for bf16 and tf32 dry-runs on a machine without a GPU, however the dry run is spelt."""
    recipe = tmp_path / "gpu.yaml"
    text = (REPO / "recipes" / "tiny-pretrain.yaml").read_text() + "\nbf16: true\ntf32: true\n"
    if spelling == "launch --dry-run":
        recipe.write_text(text)
        result = cli("launch", str(recipe), "--accelerate-config",
                           str(REPO / "accelerate_configs" / "multi-gpu.yaml"), "--dry-run", "--",
                           "--output_dir", str(tmp_path / "out"))
        assert result.returncode == 0, result.stderr[-2000:]
        assert "hf_diloco.accelerate_launch" in result.stdout
        assert not (tmp_path / "out").exists()
        return
    if spelling == "recipe key":
        text += "dry_run: true\n"
        spelling = []
    recipe.write_text(text)
    result = cli("train", "--config", str(recipe), "--output_dir", str(tmp_path / "out"), *spelling)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "hf-diloco dry run" in result.stdout
    assert not (tmp_path / "out").exists()


@pytest.mark.process
def test_a_gpu_recipe_trains_on_a_machine_without_a_gpu_with_bf16_autocast_and_bf16_weights(tmp_path):
    """A recipe with `bf16: true` and `tf32: true`, run by `hf-diloco train` alone (no use_cpu given) on this machine,
    which has no GPU: it trains, on the CPU with bfloat16 autocast, and says so in one line. With `torch_dtype:
    bfloat16` the weights load, train and are saved in bfloat16 (the saved model reloads in it), while the round
    checkpoint's θ_global and outer momentum are float32. Without an accelerator nothing is pinned, and torch's
    DataLoader has no pinning to warn about."""
    import torch
    from safetensors.torch import load_file

    recipe = tmp_path / "gpu.yaml"
    recipe.write_text(Path(RECIPE).read_text() + "\nbf16: true\ntf32: true\ntorch_dtype: bfloat16\n")
    out = tmp_path / "out"
    result = hf_diloco("train", "--config", str(recipe), "--output_dir", str(out), "--max_steps", "4",
                       "--inner_steps", "2", "--block_size", "32", "--eval_strategy", "no", "--eval_on_start", "false",
                       "--report_to", "none")
    assert result.returncode == 0, result.stderr[-3000:]
    said = [line for line in result.stdout.splitlines() if "autocast" in line]
    assert said == ["[diloco] bf16 on the CPU: bfloat16 autocast, weights in bfloat16"], result.stdout[-2000:]
    assert "pin_memory" not in result.stderr and "pin_memory" not in result.stdout
    saved = load_file(out / "model.safetensors")
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    outer = torch.load(out / "checkpoint-4" / "diloco_outer.pt", weights_only=True)
    assert {p.dtype for p in outer["global_params"]} == {torch.float32}
    momentum = [v for state in outer["optimizer"]["state"].values() for v in state.values() if torch.is_tensor(v)]
    assert momentum and {v.dtype for v in momentum} == {torch.float32}
    records = [json.loads(line) for line in (out / "syncs.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4]


def test_torch_dtype_sets_the_dry_runs_memory_and_anything_else_is_refused(tmp_path):
    """The dry run counts bfloat16 weights, gradients and AdamW moments at half the bytes of float32 ones, and the
    outer state at the same float32 bytes; a dtype other than auto, float32 and bfloat16 is refused in one sentence,
    from a flag or a recipe."""
    import re

    plans = {dtype: cli("train", "--config", RECIPE, "--dry-run", "--model_name_or_path", "llama-20m",
                        "--torch_dtype", dtype).stdout for dtype in ("float32", "bfloat16")}
    sizes = {dtype: dict(re.findall(r"(parameters|gradients|inner optimizer|outer state) ([\d.]+) MB", plan))
             for dtype, plan in plans.items()}
    assert set(sizes["float32"]) == {"parameters", "gradients", "inner optimizer", "outer state"}, plans["float32"]
    for part in ("parameters", "gradients", "inner optimizer"):
        assert float(sizes["bfloat16"][part]) == pytest.approx(float(sizes["float32"][part]) / 2, rel=1e-3), part
    assert sizes["bfloat16"]["outer state"] == sizes["float32"]["outer state"]
    flag = cli("train", "--config", RECIPE, "--torch_dtype", "float16", "--output_dir", str(tmp_path / "a"))
    assert_one_sentence_error(flag, "--torch_dtype", "float16", "bfloat16")
    recipe = tmp_path / "half.yaml"
    recipe.write_text("torch_dtype: float16\n")
    key = cli("train", "--config", str(recipe), "--output_dir", str(tmp_path / "b"))
    assert_one_sentence_error(key, "torch_dtype must be one of auto, float32, bfloat16, got 'float16'.")


def test_streaming_with_non_iid_sharding_is_refused(tmp_path):
    """A stream has no length to slice, so non-i.i.d. shards cannot be made: refused instead of silently i.i.d."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": f"document {i} " * 20}) for i in range(40)))
    out = tmp_path / "out"
    result = cli("train", "--config", RECIPE, "--output_dir", str(out), "--dataset_name", str(corpus),
                       "--streaming", "true", "--data_sharding", "non_iid", "--max_steps", "2", "--block_size", "32",
                       "--eval_strategy", "no", "--eval_on_start", "false")
    assert result.returncode == 2
    assert_one_sentence_error(result, "non_iid", "stream")
    assert not (out / "model.safetensors").exists()


@pytest.mark.process
def test_the_app_refuses_to_be_reachable_without_a_password():
    """A share link or a non-loopback address lets others start processes here: both need --auth."""
    for flags, words in ((["--host", "0.0.0.0"], "--host 0.0.0.0 lets others start runs"),
                         (["--share"], "a public share link lets others start runs")):
        result = hf_diloco("app", *flags, "--port", "1", timeout=120)
        assert result.returncode == 2 and words in result.stderr and "--auth user:password" in result.stderr
        assert "Traceback" not in result.stderr


@pytest.mark.parametrize("how", ["flag", "accelerate"])
def test_fsdp_and_deepspeed_are_refused_by_the_config_on_every_path(tmp_path, how):
    """FSDP runs inside each replica, so one without processes to shard over, FSDP version 1 and DeepSpeed (whose
    ZeRO would shard one model over the replicas) are refused in DiLoCoConfig itself: the documented
    `accelerate launch --config_file X -m hf_diloco.cli train` path (which sets ACCELERATE_USE_FSDP, FSDP_VERSION
    or ACCELERATE_USE_DEEPSPEED) and the --fsdp/--deepspeed flags are caught as well as `hf-diloco launch`."""
    import os

    cases = [(["--fsdp", "true"], {}, "a replica of one process has nothing to shard over"),
             (["--deepspeed", str(tmp_path / "ds.json")], {}, "DeepSpeed ZeRO would shard one model")]
    if how == "accelerate":
        cases = [([], {"ACCELERATE_USE_FSDP": "true"}, "needs FSDP2"),
                 ([], {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}, "nothing to shard over"),
                 ([], {"ACCELERATE_USE_DEEPSPEED": "true"}, "DeepSpeed ZeRO would shard")]
    for flags, extra_env, words in cases:
        result = cli("train", "--config", RECIPE, "--output_dir", str(tmp_path / "out"), *flags, environ=extra_env)
        assert result.returncode == 2 and words in result.stderr, result.stderr[-1500:]
        assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()
    assert os.environ.get("ACCELERATE_USE_FSDP") is None


@pytest.mark.parametrize("text, sentence", [
    (None, "does not exist."),
    ("num_processes: [2", "is not valid YAML"),
    ("- 2\n- 3\n", "must be a mapping of accelerate settings."),
])
def test_an_unreadable_accelerate_config_is_named_in_one_sentence(tmp_path, text, sentence):
    """`--accelerate-config` pointing at a missing file, broken YAML or a list: one sentence naming the file."""
    from hf_diloco.config import DiLoCoConfig
    from hf_diloco.errors import ConfigError
    from hf_diloco.train import check_accelerate_config

    path = tmp_path / "accelerate.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError) as error:
        check_accelerate_config(str(path), DiLoCoConfig(output_dir=str(tmp_path / "out")))
    message = str(error.value)
    assert message.startswith(f"accelerate config {str(path)!r} ") and sentence in message, message
    assert "\n" not in message


def test_an_elastic_c10d_rendezvous_is_refused_in_one_sentence(tmp_path):
    """The shipped multi-node config with `rdzv_backend: c10d` (its store listens on every interface and unpickles
    what it receives): `hf-diloco launch --dry-run` refuses it in one sentence, exit 2, naming static and torchft."""
    config = tmp_path / "elastic.yaml"
    config.write_text((REPO / "accelerate_configs" / "multi-node.yaml").read_text()
                      .replace("rdzv_backend: static", "rdzv_backend: c10d"))
    result = cli("launch", RECIPE, "--accelerate-config", str(config), "--dry-run")
    assert result.returncode == 2 and "rdzv_backend 'c10d'" in result.stderr, result.stderr
    assert "use rdzv_backend: static" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_the_dry_run_of_time_budget_rounds_says_when_replicas_sync_and_refuses_a_staggered_end():
    """`--round_seconds 4 --num_fragments 2 --sync_delay auto` on the torch backend: the plan says a sync every 2 s
    of inner steps, overlapped with each replica's own steps, a blocking end, and how the run ends; with
    `--final_sync staggered` the same run is refused in one sentence, exit 2."""
    plan = cli("train", "--config", RECIPE, "--round_seconds", "4", "--num_fragments", "2", "--sync_delay",
                     "auto", "--dry-run")
    assert plan.returncode == 0, plan.stderr
    assert "one sync every 2 s of about" in plan.stdout
    assert "overlapped with auto (from 1) inner step(s) of each replica's own; the end blocking" in plan.stdout
    assert "each replica syncs after 2 s of inner steps, however many it took" in plan.stdout
    refused = cli("train", "--config", RECIPE, "--round_seconds", "4", "--sync_delay", "1", "--final_sync",
                        "staggered", "--dry-run")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines() == [
        "hf-diloco: error: final_sync staggered places each fragment's last sync at a fixed step, which "
        "round_seconds does not have (the run ends when a replica reaches max_steps): set final_sync auto or "
        "blocking."]


def test_the_dry_run_names_the_delayed_outer_momentum_and_refuses_it_without_momentum():
    """`--outer_momentum_delay 4 --outer_delayed_scale 0.25`: the plan says the momentum moves every 4 syncs;
    with `--outer_momentum 0` there is no momentum to delay, refused in one sentence, exit 2."""
    plan = cli("train", "--config", RECIPE, "--outer_momentum_delay", "4", "--outer_delayed_scale", "0.25",
                     "--dry-run")
    assert plan.returncode == 0, plan.stderr
    assert "its momentum moved every 4 syncs (pseudo-gradients × 0.25 in between)" in plan.stdout
    refused = cli("train", "--config", RECIPE, "--outer_momentum_delay", "4", "--outer_momentum", "0",
                        "--dry-run")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines() == [
        "hf-diloco: error: outer_momentum_delay delays the outer SGD's momentum, so it needs outer_optimizer sgd "
        "with outer_momentum above 0; set outer_momentum_delay 1 or change those."]


def test_the_dry_run_names_the_outer_momentum_restarts_and_refuses_them_where_there_is_none_to_restart():
    """`--outer_momentum_restart 5`: the plan says the momentum restarts every 5 syncs; with no outer momentum,
    with the delayed Nesterov or with AdamW outside, refused in one sentence, exit 2; a negative count too."""
    plan = cli("train", "--config", RECIPE, "--outer_momentum_restart", "5", "--dry-run")
    assert plan.returncode == 0, plan.stderr
    assert "sgd lr 0.7 momentum 0.9 Nesterov, its momentum restarted every 5 syncs" in plan.stdout
    sentence = ("hf-diloco: error: outer_momentum_restart restarts the outer SGD's momentum, so it needs "
                "outer_optimizer sgd with outer_momentum above 0 and outer_momentum_delay 1; set "
                "outer_momentum_restart 0 or change those.")
    for other in (["--outer_momentum", "0"], ["--outer_momentum_delay", "2"], ["--outer_optimizer", "adamw"]):
        refused = cli("train", "--config", RECIPE, "--outer_momentum_restart", "5", *other, "--dry-run")
        assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [sentence], (other, refused.stderr)
    negative = cli("train", "--config", RECIPE, "--outer_momentum_restart", "-1", "--dry-run")
    assert negative.returncode == 2 and "outer_momentum_restart" in negative.stderr
    assert "Traceback" not in negative.stderr


def test_the_checker_answers_dry_runs_and_plans_and_refuses_anything_else(tmp_path):
    """hf_diloco.checker (the app's form checks, one process kept between them): each request line is answered on
    one line after its mark, as the command's own process would have ended; a command that could start something,
    or a line that is not a JSON list of strings, is refused without running."""
    import io

    from hf_diloco.checker import MARK, serve

    out = tmp_path / "out"
    requests = [["launch", RECIPE, "--accelerate-config", str(REPO / "accelerate_configs" / "cpu-2proc.yaml"),
                 "--dry-run", "--", "--output_dir", str(out), "--inner_steps", "0"],
                ["plan", RECIPE, "--replicas", "2", "--link", "1gbit", "--tokens-per-second", "15000", "--json"],
                ["train", "--config", RECIPE, "--output_dir", str(out)],
                ["launch", RECIPE, "--", "--dry-run"]]
    lines = [json.dumps(r) for r in requests] + ["not json", json.dumps({"args": []})]
    answers = io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(REPO)
        assert serve(io.StringIO("\n".join(lines) + "\n"), answers) == 0
    replies = answers.getvalue().splitlines()
    assert len(replies) == len(lines) and all(r.startswith(MARK) for r in replies)
    refusal, plan, *refused = (json.loads(r[len(MARK):]) for r in replies)
    assert refusal["returncode"] == 2 and "inner_steps" in refusal["stderr"]
    assert plan["returncode"] == 0 and json.loads(plan["stdout"])["rows"]
    for answer in refused:
        assert answer == {"returncode": 2, "stdout": "",
                          "stderr": "hf-diloco: error: the checker runs only `launch ... --dry-run` and `plan`.\n"}
    assert not out.exists()


def test_bad_slurm_requests_are_refused_in_one_sentence(tmp_path):
    """`hf-diloco slurm` refuses what a job could not run, and a token it would write into the script, in one
    sentence, exit 2, writing nothing (tests/test_slurm.py runs the jobs on a real cluster)."""
    cases = [
        (["tiny-pretrain.yaml", "cpu-2proc.yaml", "--replicas", "2"], "--replicas is for outer_backend torchft"),
        (["torchft-3.yaml", "torchft-replica.yaml"], "give --replicas N"),
        (["torchft-3.yaml", "torchft-replica.yaml", "--replicas", "2", "--nodes", "2"], "scale with --replicas"),
        (["torchft-3.yaml", "cpu-2proc.yaml", "--replicas", "2"], "starts 2"),
    ]
    token = "hf_PlantedSlurmToken1234567890"  # a script file keeps what it is given: a token is refused
    cases.append((["tiny-pretrain.yaml", "cpu-2proc.yaml", "--", "--hub_token", token], "export HF_TOKEN"))
    for (recipe, config, *args), words in cases:
        recipe_fields = args[args.index("--") + 1:] if "--" in args else []
        args = args[:args.index("--")] if "--" in args else args
        result = cli("slurm", str(REPO / "recipes" / recipe), "--accelerate-config",
                     str(REPO / "accelerate_configs" / config), *args, "--", "--output_dir", str(tmp_path / "x"),
                     *recipe_fields)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
        assert words in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert token not in result.stdout + result.stderr
    assert not (tmp_path / "x").exists(), "nothing is written for a refused request"
