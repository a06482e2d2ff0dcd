"""TRL's SFTTrainer and DPOTrainer with DiLoCo (hf_diloco.trl): real 2-process runs (accelerate launch, gloo,
tests/scripts/trl_run.py) on the built-in chat and preference data with the tiny-llama preset."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import REPO, accelerate_launch, env, free_port
from safetensors import safe_open

from hf_diloco.hub import model_card
from hf_diloco.metrics import read_sync_rounds

SCRIPT = str(REPO / "tests" / "scripts" / "trl_run.py")


@pytest.mark.parametrize("trainer, lora", [("sft", False), ("dpo", True)], ids=["sft", "dpo-lora"])
def test_trl_trainers_run_as_replicas_with_nothing_crossing_between_syncs(tmp_path, trainer, lora):
    """2 replicas, H = 2, 4 steps: no collective inside any training step (TRL gathers its metrics there: 4 a step
    for SFT, 15 for DPO, kept on each replica), both replicas hold the same parameters after each sync (with LoRA,
    the reference adapter TRL keeps included), TRL's own metrics are logged every step, and the model (or the
    adapter) is saved."""
    result = accelerate_launch([SCRIPT, json.dumps({"out": str(tmp_path), "trainer": trainer, "lora": lora})])
    assert result.returncode == 0, result.stderr[-4000:]
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
    else:
        assert (saved / "model.safetensors").exists() and "<|assistant|>" in (saved / "chat_template.jinja").read_text()


@pytest.mark.parametrize("recipe, trainer", [("sft-lora.yaml", "SFTTrainer"), ("dpo-lora.yaml", "DPOTrainer")])
def test_the_trl_recipes_run_through_hf_diloco_launch(tmp_path, recipe, trainer):
    """`hf-diloco launch recipes/<recipe> --accelerate-config accelerate_configs/cpu-2proc.yaml`, shortened to two
    rounds of 2 steps: it trains 2 replicas on the built-in chat or preference data, syncs only the LoRA adapters,
    saves the adapter with the tokenizer's chat template, evaluates on the held-out rows, and the model card
    `hf-diloco push` uploads says which TRL trainer ran the inner loop."""
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "hf_diloco.cli", "launch", f"recipes/{recipe}", "--accelerate-config",
         "accelerate_configs/cpu-2proc.yaml", "--port", str(free_port()), "--", "--max_steps", "4", "--inner_steps",
         "2", "--eval_steps", "4", "--per_device_train_batch_size", "2", "--report_to", "none",
         "--save_every_rounds", "0", "--output_dir", str(out)],
        cwd=REPO, env=env(), capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-4000:]
    rounds = read_sync_rounds(out)
    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        adapter = sum(f.get_tensor(name).numel() for name in f.keys())
    assert [r["synced_parameters"] for r in rounds] == [adapter, adapter]
    assert {r["num_replicas"] for r in rounds} == {2}
    assert rounds[-1].get("eval_loss") is not None
    assert "<|assistant|>" in (out / "chat_template.jinja").read_text()
    card = model_card(out)  # what `hf-diloco push` uploads as the repository's README.md
    assert f"The inner loop was TRL's {trainer}." in card and "- trl" in card.split("---")[1]


def test_what_trl_cannot_serve_is_refused_in_one_sentence(tmp_path, monkeypatch):
    """A TRL trainer with a layout the tests do not run with it, sync_ref_model, and TRL missing: one sentence each,
    a non-zero exit and no traceback from the command line."""
    for extra, words in ((["--streaming", "true", "--max_steps", "40"], "this run asks for streaming"),
                         (["--data_sharding", "non_iid"], "this run asks for data_sharding non_iid")):
        result = subprocess.run([sys.executable, "-m", "hf_diloco.cli", "train", "--config", "recipes/sft-lora.yaml",
                                 *extra, "--output_dir", str(tmp_path / "out")], cwd=REPO, env=env(),
                                capture_output=True, text=True, timeout=120)
        assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("hf-diloco: error: trainer sft (TRL) runs on fixed replicas") and words in last, last
    from hf_diloco.config import ConfigError, RunArguments, config_class
    from hf_diloco.train import check_arguments
    from hf_diloco.trl import DiLoCoDPOConfig, DiLoCoSFTConfig

    for layout, words in (({"outer_backend": "torchft", "lighthouse": "http://127.0.0.1:1"}, "outer_backend torchft"),
                          ({"tp_size": 2, "replica_group_size": 2}, "FSDP2 or tensor parallel inside a replica")):
        config = DiLoCoSFTConfig(output_dir=str(tmp_path), max_steps=40, inner_steps=20, bf16=False, **layout)
        with pytest.raises(ConfigError, match=f"this run asks for {words}; use trainer diloco"):
            check_arguments(RunArguments(trainer="sft"), config)

    with pytest.raises(ConfigError, match="sync_ref_model moves each replica's reference model"):
        DiLoCoDPOConfig(output_dir=str(tmp_path), sync_ref_model=True)
    import hf_diloco

    monkeypatch.setitem(sys.modules, "hf_diloco.trl", None)  # as if TRL were not installed: the import fails
    monkeypatch.delattr(hf_diloco, "trl", raising=False)
    with pytest.raises(ConfigError, match=r"trainer dpo is TRL's DPOTrainer, and TRL is not installed: pip install"):
        config_class("dpo")
