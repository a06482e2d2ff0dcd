"""Checkpoints at round boundaries hold everything DiLoCo needs; resuming reproduces the uninterrupted run."""

import pytest
import torch
from helpers import REPO, pattern_dataset, tiny_llama, train_runs
from safetensors.torch import load_file
from transformers import default_data_collator

from hf_diloco import DiLoCoConfig, DiLoCoTrainer

RECIPE = str(REPO / "recipes" / "tiny-pretrain.yaml")
SMALL = ["--max_steps", "30", "--inner_steps", "10", "--block_size", "64", "--per_device_train_batch_size", "4",
         "--warmup_steps", "5", "--eval_strategy", "no", "--eval_on_start", "false", "--save_strategy", "steps",
         "--save_steps", "10", "--disable_tqdm", "true"]


def max_difference(a, b) -> float:
    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return max((x[k] - y[k]).abs().max().item() for k in x)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three `hf-diloco train` runs of two replicas in one launch: `full` (30 steps, a round checkpoint every 10),
    `resumed` from its checkpoint-20, and `partial` from a copy of checkpoint-20 without the outer state."""
    folder = tmp_path_factory.mktemp("resume")
    checkpoint = str(folder / "full" / "checkpoint-20")

    def run(name, *extra, **prepare):
        return {"name": name, "recipe": RECIPE, "args": [*SMALL, "--output_dir", str(folder / name), *extra],
                **prepare}

    train_runs([run("full"), run("resumed", "--resume_from_checkpoint", checkpoint),
                run("partial", "--resume_from_checkpoint", str(folder / "copy"),
                    copy=[checkpoint, str(folder / "copy")], leave_out=["diloco_outer.pt"])])
    return {name: folder / name for name in ("full", "resumed", "partial", "copy")}


@pytest.fixture(scope="module")
def uninterrupted(runs):
    return runs["full"]


@pytest.mark.process
def test_round_checkpoint_holds_every_replica_and_the_outer_state(uninterrupted):
    checkpoint = uninterrupted / "checkpoint-20"
    for rank in (0, 1):
        assert (checkpoint / f"process-{rank}" / "optimizer.pt").is_file()
        assert (checkpoint / f"process-{rank}" / "scheduler.pt").is_file()
        assert (checkpoint / f"rng_state_{rank}.pth").is_file()
    outer = torch.load(checkpoint / "diloco_outer.pt", weights_only=True)
    assert outer["global_params"][0].dtype == torch.float32
    assert outer["optimizer"]["state"], "the outer momentum buffers must be saved"
    # The replicas' inner optimizers saw different data, so their states differ.
    states = [torch.load(checkpoint / f"process-{r}" / "optimizer.pt", weights_only=True) for r in (0, 1)]
    assert not torch.equal(states[0]["state"][0]["exp_avg"], states[1]["state"][0]["exp_avg"])


@pytest.mark.process
def test_resume_from_round_checkpoint_matches_uninterrupted_run(runs):
    assert max_difference(runs["full"], runs["resumed"]) <= 1e-6


@pytest.mark.process
def test_resume_without_outer_state_does_not_match(runs):
    """The comparison above can fail: dropping the outer momentum from the checkpoint changes the result."""
    assert (runs["copy"] / "model.safetensors").is_file() and not (runs["copy"] / "diloco_outer.pt").exists()
    assert max_difference(runs["full"], runs["partial"]) > 1e-5


def test_saves_inside_a_round_are_postponed_to_its_end(tmp_path):
    """save_steps=7 with H=5: the saves due at steps 7 and 14 happen at the round ends 10 and 15."""
    args = DiLoCoConfig(output_dir=str(tmp_path), inner_steps=5, max_steps=15, save_strategy="steps", save_steps=7,
                        per_device_train_batch_size=4, report_to="none", disable_tqdm=True, use_cpu=True)
    DiLoCoTrainer(model=tiny_llama(), args=args, train_dataset=pattern_dataset(),
                  data_collator=default_data_collator).train()
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-10", "checkpoint-15"]
