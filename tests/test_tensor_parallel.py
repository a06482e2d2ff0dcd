"""Replicas bigger than one device, split by tensor parallel: each replica's processes hold column and row pieces of
every attention and MLP weight (transformers' tensor-parallel plan), and DiLoCo runs across replicas piece by
piece. Real launches (gloo): 2 replicas x 2 processes against 2 replicas of one process on the same data."""

import json

import pytest
import torch
from helpers import (
    ACCELERATE_CPU_4PROC,
    REPO,
    replica_runs,
    share,
    tiny_llama,
    train_runs,
)
from safetensors.torch import load_file

from hf_diloco import DiLoCoConfig, DiLoCoTrainer
from hf_diloco.config import ConfigError
from hf_diloco.parallel import checked_tensor_parallel_plan

SCRIPT = str(REPO / "tests" / "scripts" / "replica_run.py")
# Paper outer settings, H = 3 and 10 steps: rounds end at steps 3, 6, 9 and 10.
SETTINGS = dict(inner_steps=3, max_steps=10, outer_lr=0.7, outer_momentum=0.9, outer_nesterov=True)
# Streaming: 2 fragments (one every 2 steps), each overlapped with 1 inner step, int4 with error feedback.
STREAMED = {"compression": "int4", "error_feedback": True, "num_fragments": 2, "sync_delay": 1, "inner_steps": 4,
            "overlap_landing": "eager"}


def rounds_of(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "run" / "syncs.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def split_runs(tmp_path_factory):
    """Two tensor-parallel replicas of 2 processes, with fp32 syncs ("fp32") and streaming 2 fragments with int4 and
    error feedback, each sync overlapped with an inner step ("streamed"), trained in turn by one launch of four
    processes (tests/helpers.py replica_runs): name → (folder, every rank's record)."""
    folder = tmp_path_factory.mktemp("tp")
    split = {**SETTINGS, "tp_size": 2}
    runs = replica_runs(folder, {"fp32": split, "streamed": {**split, **STREAMED}}, ACCELERATE_CPU_4PROC)
    return {name: (folder / name, ranks) for name, ranks in runs.items()}


share("tensor_parallel", {"plain": SETTINGS})  # replicas of one process, in the session's shared launch of two


@pytest.fixture(scope="module")
def fp32_layouts(split_runs, shared_runs):
    """The same two replicas twice, with fp32 syncs: each split over 2 processes by tensor parallel, and each one
    process."""
    return {"tp": split_runs["fp32"], "plain": shared_runs("tensor_parallel")["plain"]}


@pytest.fixture(scope="module")
def streamed(split_runs):
    """Two tensor-parallel replicas of 2 processes, streaming 2 fragments with int4 and error feedback, each sync
    overlapped with an inner step."""
    return split_runs["streamed"]


@pytest.mark.process
def test_tensor_parallel_replicas_end_where_replicas_of_one_process_end(fp32_layouts):
    """fp32 syncs over four rounds: the same model as replicas of one process on the same data, within 1e-3, and
    the same round statistics (loss, pseudo-gradient norms, counted once for the values both processes hold)
    within 1e-4, and the same total floating point operations. Not bit for bit: a row-split projection sums its
    halves on two processes, so a float sum rounds differently (about 1e-7), and AdamW's per-value normalisation
    lets that move a weight whose gradient is near zero by a fraction of the learning rate (3e-3); a piece synced
    with the wrong counterpart, or not averaged, moves weights by 1e-2 and more."""
    split, whole = torch.load(fp32_layouts["tp"][0] / "final.pt"), torch.load(fp32_layouts["plain"][0] / "final.pt")
    assert set(split) == set(whole)
    worst = max((split[k] - whole[k]).abs().max().item() for k in whole)
    assert worst < 1e-3, f"largest parameter difference {worst:.2e}"
    # The same batches trained: the floating point operations Trainer reports add up alike.
    assert fp32_layouts["tp"][1][0]["total_flos"] == pytest.approx(fp32_layouts["plain"][1][0]["total_flos"], rel=1e-6)
    for a, b in zip(rounds_of(fp32_layouts["tp"][0]), rounds_of(fp32_layouts["plain"][0]), strict=True):
        assert a["synced_parameters"] == b["synced_parameters"]
        for key in ("pseudo_grad_norm", "loss"):
            assert a[key] == pytest.approx(b[key], rel=1e-4), key
        assert a["replica_pseudo_grad_norms"] == pytest.approx(b["replica_pseudo_grad_norms"], rel=1e-4)


@pytest.mark.process
def test_each_process_holds_about_half_and_sends_what_it_holds(fp32_layouts):
    """Parameters + AdamW's state + θ_global and outer momentum, in bytes per process: at most 0.55 of a replica of
    one process (the norms and the tied embedding are held whole). Across replicas each process sends what it
    holds (an fp32 ring all-reduce over 2 replicas sends its bytes once); inside the replica only the round's
    statistics move."""
    tp_ranks, plain_ranks = fp32_layouts["tp"][1], fp32_layouts["plain"][1]
    for rank in range(4):
        split, whole = tp_ranks[rank]["held_bytes"], plain_ranks[rank // 2]["held_bytes"]
        for part in whole:
            assert 0.5 * whole[part] < split[part] <= 0.55 * whole[part], (rank, part, split, whole)
    held = tp_ranks[0]["held_bytes"]["parameters"]  # fp32: 4 bytes a value, as the sync sends them
    for record in rounds_of(fp32_layouts["tp"][0]):
        stats = record["bytes_per_replica"] - held
        # the statistics riding along and the contribution checks' table: a few numbers each
        assert 0 <= stats < 400, (record["bytes_per_replica"], held)
        assert record["intra_replica_bytes"] < 1000


@pytest.mark.process
@pytest.mark.parametrize("which", ["fp32", "streamed"])
def test_the_same_piece_is_identical_in_every_replica_after_every_sync(which, fp32_layouts, streamed):
    """Process j of each replica holds piece j: after every sync that covers the whole model it is bit-identical
    across replicas (streamed: after the last step's, which syncs every fragment), and the two processes of a
    replica hold different pieces."""
    ranks = fp32_layouts["tp"][1] if which == "fp32" else streamed[1]
    whole = slice(-1, None) if which == "streamed" else slice(None)
    assert ranks[0]["digests"][whole] == ranks[2]["digests"][whole]
    assert ranks[1]["digests"][whole] == ranks[3]["digests"][whole]
    assert ranks[0]["digests"][-1][1] != ranks[1]["digests"][-1][1]
    assert ranks[0]["seen"] == ranks[1]["seen"] != ranks[2]["seen"], "a replica's processes train on the same data"


@pytest.mark.process
def test_streamed_int4_with_error_feedback_runs_on_the_pieces(streamed):
    """Fragments, overlap and int4 with error feedback on tensor-parallel pieces: a fragment lands every 2 steps,
    each process sends about 1/8 of its fp32 bytes, and the loss falls."""
    tmp, _ = streamed
    rounds = rounds_of(tmp)
    assert [r["step"] for r in rounds] == [3, 5, 7, 9, 10]
    assert all(6 < r["compression_ratio"] < 8.5 for r in rounds), [r["compression_ratio"] for r in rounds]
    assert rounds[-1]["loss"] < rounds[0]["loss"]


def test_an_accelerate_layout_of_shards_and_pieces_sets_the_replica_or_is_refused(monkeypatch):
    """What a launched process reads from an accelerate config's parallelism_config: dp_shard 2 × tp 2 under FSDP is
    a replica of 4 with FSDP2 over 2; a replica_group_size that disagrees, or dp_shard beside tp without FSDP, is
    refused in one sentence."""
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    with pytest.raises(ConfigError, match="needs FSDP: set distributed_type FSDP"):
        DiLoCoConfig(output_dir="unused")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    config = DiLoCoConfig(output_dir="unused")
    assert (config.replica_group_size, config.tp_size, config.dp_shard_size) == (4, 2, 2)
    with pytest.raises(ConfigError, match="dp_shard_size=2 × tp_size=2 = 4, the processes of each replica"):
        DiLoCoConfig(output_dir="unused", replica_group_size=2)


def test_tensor_parallel_refusals_say_why_in_one_sentence():
    """FSDP2 with tensor parallel and no processes left to shard a piece over, a replica_group_size other than
    tp_size, a tp_size that does not divide the attention heads, and a model_init instead of a model; the plan
    splits the projections only."""
    with pytest.raises(ConfigError, match="replica_group_size must be tp_size=2 times 2 or more"):
        DiLoCoConfig(output_dir="unused", tp_size=2, fsdp=True, replica_group_size=2)
    assert DiLoCoConfig(output_dir="unused", tp_size=2, fsdp=True, replica_group_size=4).dp_shard_size == 2
    with pytest.raises(ConfigError, match="replica_group_size=4 differs from tp_size=2"):
        DiLoCoConfig(output_dir="unused", tp_size=2, replica_group_size=4)
    with pytest.raises(ConfigError, match="tp_size=3 does not divide the model's num_attention_heads=2"):
        checked_tensor_parallel_plan(tiny_llama(), 3)
    with pytest.raises(ConfigError, match="a model_init is not supported with it"):
        DiLoCoTrainer(args=DiLoCoConfig(output_dir="unused", tp_size=2), model_init=tiny_llama)
    plan = checked_tensor_parallel_plan(tiny_llama(), 2)
    assert plan["model.layers.0.self_attn.q_proj.weight"] == "colwise"
    assert plan["model.layers.0.mlp.down_proj.weight"] == "rowwise"
    assert not any("embed_tokens" in name or "lm_head" in name for name in plan), "tied: kept whole"


@pytest.mark.process
def test_a_tensor_parallel_run_resumes_exactly_and_saves_an_ordinary_model(tmp_path):
    """`hf-diloco train recipes/tp-replicas.yaml` under `accelerate_configs/cpu-tp-2x2.yaml`: 20 steps with a
    round checkpoint every 10; a second run resumed from checkpoint-10 ends with the same model (each
    process reads its own AdamW pieces, and θ_global and the outer momentum of its rank), and the final save is an
    ordinary consolidated model that loads whole. `recipes/fsdp-tp-replicas.yaml` with `cpu-fsdp-tp-2x4.yaml` (each
    piece sharded by FSDP2 too: 8 processes, twice as long) is not run here: its save and resume take the
    tensor-parallel path this run takes (consolidated weights gathered from DTensors, each process's local pieces
    of AdamW's state and of the outer state, whatever the mesh), FSDP2's resume is checked in tests/test_sharded.py,
    and that layout's rounds (pieces, bytes) in test_sharded's fsdp2-and-tensor-parallel test."""
    short = ["--max_steps", "20", "--inner_steps", "10", "--block_size", "64", "--per_device_train_batch_size", "2",
             "--eval_strategy", "no", "--eval_on_start", "false", "--logging_steps", "1000", "--disable_tqdm", "true",
             "--report_to", "none"]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    # Both runs in one launch of the processes `hf-diloco launch` starts (train_runs: the start-up paid once; the
    # launch's own path for this layout is tests/test_trl.py's tensor-parallel run): the second resumes the first's
    # round checkpoint into a folder of its own.
    train_runs([{"name": name, "recipe": "recipes/tp-replicas.yaml", "args": [*short, "--output_dir", str(out), *extra]}
                for name, out, extra in (("full", full, []), ("resumed", resumed, [
                    "--resume_from_checkpoint", str(full / "checkpoint-10")]))],
               REPO / "accelerate_configs" / "cpu-tp-2x2.yaml")
    a, b = load_file(full / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < 1e-5, f"largest parameter difference {worst:.2e}"
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(full)
    assert sum(p.numel() for p in model.parameters()) == 1_082_880
    assert all(torch.equal(p, a[name]) for name, p in model.state_dict().items() if name in a)
    from hf_diloco import hub

    card = hub.model_card(full)
    assert "| processes each layer is split over by tensor parallel (`tp_size`) | 2 | 1 |" in card
    assert "| each replica sharded over its processes by FSDP2 (`sharded_replica`) | True | False |" not in card
    sent = [json.loads(line)["bytes_per_replica"] for line in (full / "syncs.jsonl").read_text().splitlines()]
    # Each process sends its pieces: about half of 4.33 MB.
    assert sent and all(2.1e6 < x < 2.4e6 for x in sent), sent
