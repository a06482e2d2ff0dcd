"""TRL's SFTTrainer and DPOTrainer with DiLoCo (hf_diloco.trl): real 2-process runs (accelerate launch, gloo,
tests/scripts/trl_run.py) on the built-in chat and preference data with the tiny-llama preset."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import REPO, accelerate_launch, cli, env, free_port
from safetensors import safe_open

from hf_diloco.hub import model_card
from hf_diloco.metrics import read_syncs

pytestmark = pytest.mark.process  # every test here starts processes

SCRIPT = str(REPO / "tests" / "scripts" / "trl_run.py")


TRL_RUNS = {"sft": ("sft", False), "dpo-lora": ("dpo", True), "sft-peft-config": ("sft", "peft_config")}


@pytest.fixture(scope="module")
def trl_runs(tmp_path_factory):
    """name → folder of each TRL_RUNS run, both trained in turn by one launch of two processes."""
    folder = tmp_path_factory.mktemp("trl")
    runs = [{"out": str(folder / name), "trainer": trainer, "lora": lora} for name, (trainer, lora) in TRL_RUNS.items()]
    runs += [{"out": str(folder / f"guide-{kind}"), "guide_block": kind} for kind in ("sft", "dpo")]
    for run in runs:
        (folder / run["out"]).mkdir()
    result = accelerate_launch([SCRIPT, json.dumps(runs)], timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return {name: folder / name for name in [*TRL_RUNS, "guide-sft", "guide-dpo"]}


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_the_guides_trl_blocks_train_two_replicas_as_written(trl_runs, kind):
    """docs/guides/your-model.md's SFTTrainer and DPOTrainer blocks, launched as the page says (two processes):
    each trains two replicas for its 20 steps, both taking part in the syncs at 10 and 20, and checkpoints the model
    (the DPO block: its LoRA adapter, given as TRL's peft_config, the only weights synced) at the end."""
    import math

    from safetensors.torch import load_file

    out = trl_runs[f"guide-{kind}"] / "run"
    records = read_syncs(out)
    assert [r["step"] for r in records] == [10, 20], records
    assert all([m["participated"] for m in r["replicas"]] == [True, True] and math.isfinite(r["loss"])
               for r in records), records
    if kind == "sft":
        assert load_file(out / "checkpoint-20" / "model.safetensors")
    else:
        adapter = load_file(out / "checkpoint-20" / "adapter_model.safetensors")
        assert adapter and all("lora_" in name for name in adapter)
        assert {r["synced_parameters"] for r in records} == {sum(t.numel() for t in adapter.values())}


@pytest.mark.parametrize("name", list(TRL_RUNS))
def test_trl_trainers_run_as_replicas_with_nothing_crossing_between_syncs(trl_runs, name):
    """2 replicas, H = 2, 4 steps: no collective inside any training step (TRL gathers its metrics there: 4 a step
    for SFT, 15 for DPO, kept on each replica), both replicas hold the same parameters after each sync (with LoRA,
    the reference adapter TRL keeps included), TRL's own metrics are logged every step, and the model (or the
    adapter) is saved."""
    trainer, lora = TRL_RUNS[name]
    tmp_path = trl_runs[name]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank in ranks:
        assert rank["calls"] == [], rank["calls"][:10]
        assert [step for step, _ in rank["digests"]] == [2, 4]
        assert len(rank["logged"]) == 4
        metric = "rewards/margins" if trainer == "dpo" else "mean_token_accuracy"
        assert all(metric in entry for entry in rank["logged"])
    assert ranks[0]["digests"] == ranks[1]["digests"]
    assert ranks[0]["logged"] != ranks[1]["logged"], "each replica logs its own metrics"
    saved = tmp_path / "saved"
    if lora:
        with safe_open(str(saved / "adapter_model.safetensors"), "pt") as f:
            assert f.keys() and all("lora_" in name for name in f.keys())
        # Only the adapter trains, and exactly what trains is synced (with peft_config too, where TRL wraps the
        # model inside the trainer, after DiLoCo's mixin was given it).
        for rank in ranks:
            assert rank["trainable"] and all("lora_" in n for n in rank["trainable"]), rank["trainable"][:5]
            assert rank["synced"] == rank["trainable_values"] > 0
    else:
        assert (saved / "model.safetensors").exists() and "<|assistant|>" in (saved / "chat_template.jinja").read_text()


# name: (recipe, accelerate config, launch options, training flags). SFT on two single-process replicas, the plain
# layout, runs from Python in the test above.
LAYOUTS = {
    "dpo-lora, FSDP2 2x2, non-iid": ("dpo-lora.yaml", "cpu-fsdp-2x2.yaml", [],
                                     ["--fsdp", "true", "--replica_group_size", "2", "--data_sharding", "non_iid"]),
    "sft-lora, torchft": ("sft-lora.yaml", "torchft-replica.yaml", ["--replicas", "2"],
                          ["--outer_backend", "torchft", "--min_replicas", "2"]),
    "sft full, tensor parallel 2x2": ("sft-lora.yaml", "cpu-tp-2x2.yaml", [],
                                      ["--lora_r", "0", "--tp_size", "2", "--replica_group_size", "2"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_trl_recipes_run_through_hf_diloco_launch_in_every_layout(tmp_path, layout):
    """`hf-diloco launch recipes/<recipe> --accelerate-config accelerate_configs/<config>`, shortened to two rounds
    of 2 steps, with 2 replicas of one process (SFT with LoRA), each sharded over 2 by FSDP2 (DPO with LoRA, non-
    i.i.d. slices), on torchft (two replica launches and a Lighthouse) or split by tensor parallel (full SFT): it
    trains on the built-in chat or preference data, syncs the LoRA adapters only (or the whole model without
    LoRA), saves them with the tokenizer's chat template, evaluates on the held-out rows, replicas end alike, and
    the model card `hf-diloco push` uploads names the TRL trainer and the layout's settings."""
    recipe, accelerate, options, flags = LAYOUTS[layout]
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "hf_diloco.cli", "launch", f"recipes/{recipe}", "--accelerate-config",
         f"accelerate_configs/{accelerate}", "--port", str(free_port()), *options, "--", "--max_steps", "4",
         "--inner_steps", "2", "--eval_steps", "4", "--per_device_train_batch_size", "2", "--report_to", "none",
         "--save_every_rounds", "0", *flags, "--output_dir", str(out)],
        cwd=REPO, env=env(), capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-4000:]
    folders = [out / "replica-0", out / "replica-1"] if "torchft" in layout else [out]
    lora = "--lora_r" not in flags
    saved = [folder / ("adapter_model.safetensors" if lora else "model.safetensors") for folder in folders]
    with safe_open(str(saved[0]), "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    for other in saved[1:]:  # torchft: each replica saves its own copy
        with safe_open(str(other), "pt") as f:
            assert all(f.get_tensor(name).equal(tensor) for name, tensor in tensors.items())
    rounds = read_syncs(folders[0])
    assert [r["synced_parameters"] for r in rounds] == [sum(t.numel() for t in tensors.values())] * 2
    assert lora == all("lora_" in name for name in tensors)
    assert {r.get("participants", r.get("num_replicas")) for r in rounds} == {2}
    assert rounds[-1].get("eval_loss") is not None
    assert "<|assistant|>" in (folders[0] / "chat_template.jinja").read_text()
    card = model_card(folders[0])  # what `hf-diloco push` uploads as the repository's README.md
    trainer = "DPOTrainer" if recipe.startswith("dpo") else "SFTTrainer"
    assert f"The inner loop was TRL's {trainer}." in card and "- trl" in card.split("---")[1]
    assert ("| data sharding (`data_sharding`) | non_iid | iid |" in card) == ("non-iid" in layout)


def test_what_trl_cannot_serve_is_refused_in_one_sentence(tmp_path, monkeypatch):
    """LoRA with tensor parallel inside a replica (for TRL's trainers as for DiLoCoTrainer: the plan names layers
    PEFT has wrapped), sync_ref_model, and TRL missing: one sentence each, and from the command line a non-zero exit
    and no traceback."""
    result = cli("train", "--config", "recipes/sft-lora.yaml", "--tp_size", "2", "--replica_group_size", "2",
                 "--output_dir", str(tmp_path / "out"))  # the command's own code, inside pytest
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("hf-diloco: error: LoRA adapters cannot be split by tensor parallel inside a replica"), last
    from hf_diloco.config import ConfigError, DiLoCoConfig, RunArguments
    from hf_diloco.recipes import config_class
    from hf_diloco.train import check_arguments
    from hf_diloco.trl import DiLoCoDPOConfig

    tensor_parallel = DiLoCoConfig(output_dir=str(tmp_path), max_steps=40, inner_steps=20, tp_size=2,
                                   replica_group_size=2)
    with pytest.raises(ConfigError, match="LoRA adapters cannot be split by tensor parallel"):
        check_arguments(RunArguments(lora_r=8), tensor_parallel)  # trainer diloco alike

    with pytest.raises(ConfigError, match="sync_ref_model moves each replica's reference model"):
        DiLoCoDPOConfig(output_dir=str(tmp_path), sync_ref_model=True)
    import hf_diloco

    monkeypatch.setitem(sys.modules, "hf_diloco.trl", None)  # as if TRL were not installed: the import fails
    monkeypatch.delattr(hf_diloco, "trl", raising=False)
    with pytest.raises(ConfigError, match=r"trainer dpo is TRL's DPOTrainer, and TRL is not installed: pip install"):
        config_class("dpo")


def test_trainer_ddp_on_a_trl_recipe_is_trls_own_trainer_without_diloco(tmp_path):
    """`--trainer ddp` on recipes/sft-lora.yaml, 2 processes, 4 steps: TRL's SFTTrainer with data parallelism and
    the recipe's own fields (max_length, LoRA), as a user runs it without hf-diloco: no sync record, TRL's metrics
    logged every step (mean_token_accuracy; num_tokens counts both processes' tokens, gathered every step, which
    DiLoCo's replicas never do), the adapter saved, run_config.json naming the baseline. The DPO recipe's baseline
    plans alike (a dry run), and the baseline refuses inner_optimizer muon, which TRL's trainer cannot take, in one
    sentence."""
    out = tmp_path / "run"
    result = accelerate_launch(["-m", "hf_diloco.cli", "train", "--config", "recipes/sft-lora.yaml", "--trainer",
                                "ddp", "--max_steps", "4", "--per_device_train_batch_size", "2", "--eval_strategy",
                                "no", "--report_to", "none", "--logging_steps", "1", "--save_every_rounds", "0",
                                "--output_dir", str(out)], timeout=400)
    assert result.returncode == 0, result.stderr[-4000:]
    assert not (out / "syncs.jsonl").exists(), "no DiLoCo sync"
    logged = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    steps = [entry for entry in logged if "mean_token_accuracy" in entry]
    assert [entry["step"] for entry in steps] == [1, 2, 3, 4], logged
    assert (out / "adapter_model.safetensors").exists()
    assert json.loads((out / "run_config.json").read_text())["run"]["trainer"] == "ddp"
    assert (out / "run_metrics.json").exists()
    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        assert f.keys() and all("lora_" in name for name in f.keys())
    plan = cli("train", "--config", "recipes/dpo-lora.yaml", "--trainer", "ddp", "--dry-run",
               "--output_dir", str(tmp_path / "dpo"))
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert plan.stdout.split()[plan.stdout.split().index("trainer") + 1] == "ddp", plan.stdout
    assert "rows as TRL prepares them" in plan.stdout, plan.stdout
    refused = subprocess.run([sys.executable, "-m", "hf_diloco.cli", "train", "--config", "recipes/sft-lora.yaml",
                              "--trainer", "ddp", "--inner_optimizer", "muon", "--max_steps", "2", "--output_dir",
                              str(tmp_path / "muon")], cwd=REPO, env=env(), capture_output=True, text=True,
                             timeout=300)
    assert refused.returncode != 0 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
    assert "TRL's own trainer and its optimizer (optim), which has no muon" in refused.stderr.strip().splitlines()[-1]
