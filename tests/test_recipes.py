"""Every shipped recipe runs (or, for the GPU-scale one, dry-runs) from the command line."""

import json

import pytest
from helpers import REPO, accelerate_launch, hf_diloco
from safetensors.torch import load_file

RECIPES = REPO / "recipes"
SHORT = ["--max_steps", "4", "--inner_steps", "2", "--block_size", "64", "--eval_strategy", "no",
         "--eval_on_start", "false", "--disable_tqdm", "true"]


@pytest.mark.parametrize("recipe", sorted(p.name for p in RECIPES.glob("*.yaml")))
def test_every_recipe_parses_and_dry_runs(recipe, tmp_path):
    overrides = []
    if recipe == "lora-finetune.yaml":  # its default model is tiny-pretrain's output; any model dry-runs
        overrides = ["--model_name_or_path", "tiny-llama"]
    result = hf_diloco("train", "--config", str(RECIPES / recipe), "--dry_run", "true",
                       "--output_dir", str(tmp_path / "out"), *overrides)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "hf-diloco dry run" in result.stdout
    assert not (tmp_path / "out").exists(), "a dry run writes nothing"


def test_paper_recipe_dry_run_describes_the_paper_setup():
    result = hf_diloco("train", "--config", str(RECIPES / "paper-150m-c4.yaml"), "--dry_run", "true")
    assert result.returncode == 0, result.stderr[-2000:]
    plan = result.stdout
    assert "allenai/c4 [en], streamed" in plan
    assert "sgd lr 0.7 momentum 0.9 Nesterov" in plan and "lr 0.0004 weight decay 0.1, warmup 1000" in plan
    params = int(plan.split("llama-150m (")[1].split(" parameters")[0].replace(",", ""))
    assert 140e6 < params < 170e6
    # Ring all-reduce with M = 8 sends 2 * 7/8 of the fp32 pseudo-gradient per replica per round.
    sent_gb = float(plan.split("M=8")[1].split()[0])
    assert sent_gb == pytest.approx(params * 4 * 2 * 7 / 8 / 1e9, abs=0.01)


def test_ddp_baseline_trains_with_the_plain_trainer(tmp_path):
    out = tmp_path / "ddp"
    result = accelerate_launch(["-m", "hf_diloco.cli", "train", "--config", str(RECIPES / "ddp-baseline.yaml"),
                                *SHORT, "--output_dir", str(out)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert (out / "model.safetensors").is_file()
    assert not (out / "sync_rounds.jsonl").exists(), "DDP has no outer rounds"


def test_lora_finetune_syncs_only_adapters_and_saves_merged_model(tmp_path):
    base = tmp_path / "base"
    from hf_diloco.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer("tiny-llama")
    model.save_pretrained(base)
    tokenizer.save_pretrained(base)
    out = tmp_path / "lora"
    result = hf_diloco("train", "--config", str(RECIPES / "lora-finetune.yaml"), *SHORT,
                       "--model_name_or_path", str(base), "--output_dir", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    adapter = load_file(out / "adapter_model.safetensors")
    adapter_numel = sum(t.numel() for t in adapter.values())
    rounds = [json.loads(line) for line in (out / "sync_rounds.jsonl").read_text().splitlines()]
    assert {r["synced_parameters"] for r in rounds} == {adapter_numel}
    assert adapter_numel < sum(p.numel() for p in model.parameters()) / 10
    merged = load_file(out / "merged" / "model.safetensors")
    original = model.state_dict()
    changed = [k for k in merged if "q_proj" in k and not (merged[k] == original[k]).all()]
    assert changed, "merging the trained adapters changes the attention weights"


def test_launch_refuses_an_fsdp_config(tmp_path):
    fsdp = tmp_path / "fsdp.yaml"
    fsdp.write_text("distributed_type: FSDP\nnum_processes: 2\n")
    result = hf_diloco("launch", str(RECIPES / "tiny-pretrain.yaml"), "--accelerate-config", str(fsdp), "--dry-run")
    assert result.returncode == 2 and "replica_group_size" in result.stderr and "Traceback" not in result.stderr


def test_launch_checks_replica_group_size_divides_the_processes():
    result = hf_diloco("launch", str(RECIPES / "tiny-pretrain.yaml"), "--accelerate-config",
                       str(REPO / "accelerate_configs" / "hybrid.yaml"), "--dry-run", "--",
                       "--replica_group_size", "3")
    assert result.returncode == 2 and "does not divide" in result.stderr and "Traceback" not in result.stderr
    ok = hf_diloco("launch", str(RECIPES / "tiny-pretrain.yaml"), "--accelerate-config",
                   str(REPO / "accelerate_configs" / "hybrid.yaml"), "--dry-run", "--", "--replica_group_size", "8")
    assert ok.returncode == 0, ok.stderr[-2000:]
