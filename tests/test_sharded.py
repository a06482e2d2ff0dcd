"""Replicas bigger than one device: each replica shards its model over its processes with FSDP2, and DiLoCo runs
across replicas shard by shard. Real 4-process launches (2 replicas x 2 processes, gloo) of
tests/scripts/replica_run.py, each against the same replicas with DDP inside."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from helpers import ACCELERATE_CPU_4PROC, REPO, accelerate_launch, env, free_port, share, train_runs, wait_for
from safetensors.torch import load_file

from hf_diloco.metrics import read_syncs

pytestmark = pytest.mark.process  # every test here starts processes

SCRIPT = str(REPO / "tests" / "scripts" / "replica_run.py")
# Paper outer settings, H = 3 and 10 steps: rounds end at steps 3, 6, 9 and 10.
SETTINGS = dict(replica_group_size=2, inner_steps=3, max_steps=10, outer_lr=0.7, outer_momentum=0.9,
                outer_nesterov=True)


# 2 replicas x (FSDP2 over 2 processes x tensor parallel over 2): 8 processes.
ACCELERATE_CPU_FSDP_TP = REPO / "accelerate_configs" / "cpu-fsdp-tp-2x4.yaml"


def launch(tmp_path, processes: int = 4, config=ACCELERATE_CPU_4PROC, **settings) -> list[dict]:
    result = accelerate_launch([SCRIPT, json.dumps({"out": str(tmp_path), **SETTINGS, **settings})], config=config)
    assert result.returncode == 0, f"replica run failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(processes)]


# Rounds of plain fp32 all-reduces, and rounds of a codec (all-to-all of encoded shards, then all-gather) streamed
# and overlapped. A blocking int8 round is not run here: it takes streamed int4's exchange, with another quantizer
# (tests/test_codecs.py) and landing at once, as an fp32 round lands (int8 over a replica's slices:
# tests/test_compression.py).
ROUNDS = {
    "fp32": {},
    # Streaming: 2 fragments (one every 2 steps), each overlapped with 1 inner step, int4 with error feedback.
    "stream int4+EF": {"compression": "int4", "error_feedback": True, "num_fragments": 2, "sync_delay": 1,
                       "overlap_landing": "eager", "inner_steps": 4},
}


# The 2 x 2 run with FSDP2 ("fsdp") or DDP ("ddp") inside each replica, for each kind of ROUNDS, and FSDP2 with bf16
# weights (alone, and with autocast): in the session's shared launch of four processes (tests/helpers.py share).
LAYOUT_RUNS = {f"{layout}-{rounds.split()[0]}": {**SETTINGS, **ROUNDS[rounds], **({"fsdp": True} if layout == "fsdp"
                                                                                 else {})}
               for rounds in ROUNDS for layout in ("fsdp", "ddp")}
LAYOUT_RUNS["fsdp-bf16"] = {**SETTINGS, "fsdp": True, "weights": "bfloat16"}
LAYOUT_RUNS["fsdp-autocast"] = {**SETTINGS, "fsdp": True, "weights": "bfloat16", "bf16": True}
share("sharded", LAYOUT_RUNS, ACCELERATE_CPU_4PROC)


@pytest.fixture(scope="module")
def all_layouts(shared_runs) -> dict[tuple[str, str], tuple]:
    """(layout, rounds) → (folder, every rank's record) of LAYOUT_RUNS."""
    runs = shared_runs("sharded", ACCELERATE_CPU_4PROC)
    found = {(name.split("-")[0], rounds): runs[name]
             for rounds in ROUNDS for name in LAYOUT_RUNS if name.endswith(rounds.split()[0])}
    return {**found, ("fsdp", "bf16 weights"): runs["fsdp-bf16"], ("fsdp", "bf16 autocast"): runs["fsdp-autocast"]}


@pytest.fixture(scope="module", params=list(ROUNDS))
def layouts(request, all_layouts):
    """The same 2 x 2 run twice, with fp32 syncs or streamed int4 with error feedback: FSDP2 inside each replica,
    and DDP inside."""
    return request.param, {layout: all_layouts[layout, request.param] for layout in ("fsdp", "ddp")}


def test_sharded_replicas_end_where_ddp_inside_ends(layouts):
    """Four rounds or more, with fp32 syncs and streamed int4 with error feedback on the shards (see ROUNDS for why
    not int8): the same model within 1e-5, whether a replica's two processes shard it or each hold all of it (in
    both layouts every member syncs the rows FSDP2 gives it, so a codec quantizes the same values)."""
    _, runs = layouts
    sharded = torch.load(runs["fsdp"][0] / "final.pt")
    whole = torch.load(runs["ddp"][0] / "final.pt")
    assert set(whole) <= set(sharded)
    worst = max((sharded[k] - whole[k]).abs().max().item() for k in whole)
    assert worst < 1e-5, f"largest parameter difference {worst:.2e}"


def test_the_same_shard_is_identical_in_every_replica_after_every_sync(layouts):
    """Member j of each replica holds shard j: after each sync that covers the whole model it is bit-identical
    across replicas (with fragments: after the last step's, which syncs them all), and the two members of a replica
    hold different shards."""
    rounds, runs = layouts
    ranks = runs["fsdp"][1]
    streamed = "num_fragments" in ROUNDS[rounds]
    # Streamed: a fragment is launched every 2 steps from step 2 and lands 1 step later; the last step syncs all.
    assert [step for step, _ in ranks[0]["digests"]] == (list(range(2, 11)) if streamed else [3, 6, 9, 10])
    whole = slice(-1, None) if streamed else slice(None)
    assert ranks[0]["digests"][whole] == ranks[2]["digests"][whole]
    assert ranks[1]["digests"][whole] == ranks[3]["digests"][whole]
    assert ranks[0]["digests"][-1][1] != ranks[1]["digests"][-1][1]


def test_each_process_holds_about_half_of_what_ddp_inside_holds(layouts):
    """Parameters + AdamW's state + θ_global and outer momentum, in bytes per process: at most 0.55 of DDP
    inside the replica for g = 2 (shards are cut by rows, so an odd row count costs a little over a half)."""
    _, runs = layouts
    for rank in range(4):
        sharded, whole = runs["fsdp"][1][rank]["held_bytes"], runs["ddp"][1][rank]["held_bytes"]
        for part in whole:
            assert 0 < sharded[part] <= 0.55 * whole[part], (rank, part, sharded, whole)


def test_only_the_shards_cross_replicas(layouts):
    """Each process sends its shard to the other replica: the bytes across replicas per round equal DDP's
    1/g slice (within the shards' row padding), and inside the replica only the round's statistics move."""
    _, runs = layouts
    rounds = {layout: [json.loads(line) for line in (tmp / "run" / "syncs.jsonl").read_text().splitlines()]
              for layout, (tmp, _) in runs.items()}
    for sharded, whole in zip(rounds["fsdp"], rounds["ddp"], strict=True):
        assert sharded["synced_parameters"] == whole["synced_parameters"]
        assert abs(sharded["bytes_per_replica"] - whole["bytes_per_replica"]) <= 0.01 * whole["bytes_per_replica"]
        assert sharded["intra_replica_bytes"] < 1000 < whole["intra_replica_bytes"]
        assert sharded["pseudo_grad_norm"] == pytest.approx(whole["pseudo_grad_norm"], rel=1e-4)


def test_a_killed_sharded_run_resumes_from_its_round_checkpoint_and_ends_where_an_uninterrupted_one_ends(tmp_path):
    """`hf-diloco launch recipes/fsdp-replicas.yaml --accelerate-config cpu-fsdp-2x2.yaml --max-restarts 1`: SIGKILL
    one of the four processes in the middle of a round; the restarted launch reads every process's shards of the
    newest round checkpoint (AdamW's moments, θ_global and the outer momentum) and ends with the model of a run
    that was never killed, within 1e-5."""
    out, clean = tmp_path / "run", tmp_path / "clean"
    short = ["--max_steps", "40", "--inner_steps", "10", "--block_size", "64", "--per_device_train_batch_size", "2",
             "--eval_strategy", "no", "--eval_on_start", "false", "--logging_steps", "1000", "--disable_tqdm", "true",
             "--report_to", "none"]

    def launch_sharded(output_dir, *extra):
        command = [sys.executable, "-m", "hf_diloco.cli", "launch", str(REPO / "recipes" / "fsdp-replicas.yaml"),
                   "--accelerate-config", str(REPO / "accelerate_configs" / "cpu-fsdp-2x2.yaml"),
                   "--port", str(free_port()), *extra, "--", "--output_dir", str(output_dir), *short]
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(),
                                cwd=REPO, start_new_session=True)

    def finish(process):
        stdout, stderr = process.communicate(timeout=600)
        assert process.returncode == 0, f"{stdout[-2000:]}\n{stderr[-4000:]}"

    run = launch_sharded(out, "--max-restarts", "1")

    def mid_round() -> bool:  # past a round checkpoint from step 20 on, before the next one and the end
        try:
            step = json.loads((out / "progress.json").read_text())["step"]
        except (OSError, ValueError, KeyError):
            return False
        saved = max((int(p.name.split("-")[1]) for p in out.glob("checkpoint-*")), default=0)
        return 20 <= saved < step < 40

    wait_for(mid_round, timeout=400, what="a step inside a round after checkpoint-20", every=0.2)
    workers = subprocess.run(["pgrep", "-f", f"hf_diloco.cli train .*{out}"], capture_output=True, text=True)
    os.kill(max(int(pid) for pid in workers.stdout.split()), signal.SIGKILL)
    finish(run)
    rounds = read_syncs(out)
    assert [r["step"] for r in rounds] == list(range(10, 41, 10))
    assert sum("resumed_from" in r for r in rounds) == 1
    # The uninterrupted run, started as `hf-diloco launch` starts its processes (its own checks ran above).
    train_runs([{"name": "clean", "recipe": "recipes/fsdp-replicas.yaml", "args": [*short, "--output_dir",
                                                                                   str(clean)]}],
               REPO / "accelerate_configs" / "cpu-fsdp-2x2.yaml")
    killed, uninterrupted = load_file(out / "model.safetensors"), load_file(clean / "model.safetensors")
    assert killed.keys() == uninterrupted.keys()
    worst = max((killed[k] - uninterrupted[k]).abs().max().item() for k in killed)
    assert worst < 1e-5, f"largest parameter difference {worst:.2e}"
    # The final save is an ordinary consolidated model: it loads whole, and the card says how it was trained.
    from transformers import AutoModelForCausalLM

    from hf_diloco import hub

    model = AutoModelForCausalLM.from_pretrained(out)
    assert all(torch.equal(p, killed[name]) for name, p in model.state_dict().items() if name in killed)
    assert sum(p.numel() for p in model.parameters()) == 1_082_880
    card = hub.model_card(out)
    assert "| processes per replica (`replica_group_size`) | 2 | 1 |" in card
    assert "| each replica sharded over its processes by FSDP2 (`sharded_replica`) | True | False |" in card
    assert "2 replicas trained independently" in card


def test_sharded_replicas_train_bf16_weights_with_a_float32_outer_state(all_layouts):
    """Weights in bfloat16 (torch_dtype bfloat16), FSDP2 inside each replica, fp32 syncs, the same 10 steps: each
    process holds half the parameter bytes of the float32 run and its shard of θ_global and the outer momentum in
    float32 (4 bytes each for the 2 of its bfloat16 shard: the outer state's bytes are 4x the parameters'), shard j
    is bit-identical in both replicas after every sync, and the final weights are bfloat16 and finite. With bf16
    autocast on as well, accelerate's FSDP2 preparation keeps the sharded weights in float32 (its mixed precision
    computes in bfloat16): the parameter bytes are the float32 run's (docs/guides/big-models.md says so)."""
    fp32 = all_layouts["fsdp", "fp32"][1]
    autocast = all_layouts["fsdp", "bf16 autocast"][1]
    assert [r["held_bytes"]["parameters"] for r in autocast] == [r["held_bytes"]["parameters"] for r in fp32]
    folder, ranks = all_layouts["fsdp", "bf16 weights"]
    for rank, whole in zip(ranks, fp32, strict=True):
        held = rank["held_bytes"]
        assert held["outer"] == 4 * held["parameters"] and 2 * held["parameters"] == whole["held_bytes"]["parameters"]
    assert [step for step, _ in ranks[0]["digests"]] == [3, 6, 9, 10]
    assert ranks[0]["digests"] == ranks[2]["digests"] and ranks[1]["digests"] == ranks[3]["digests"]
    final = torch.load(folder / "final.pt")
    assert {t.dtype for t in final.values() if t.is_floating_point()} == {torch.bfloat16}
    assert all(bool(torch.isfinite(t).all()) for t in final.values() if t.is_floating_point())


def test_fsdp2_and_tensor_parallel_in_one_replica_end_where_ddp_inside_ends(tmp_path_factory, all_layouts):
    """2 replicas of 4 processes (accelerate_configs/cpu-fsdp-tp-2x4.yaml: tensor parallel over 2, each piece
    sharded by FSDP2 over 2) against 2 replicas of 2 processes with DDP inside, fp32 syncs, four rounds, the same
    batches (a piece-set's two processes read one shard):
    - the same model within 1e-4 (measured 4.5e-6: a row-split projection sums its halves on two processes, so not
      bit for bit) and the same round statistics within 1e-5, the values several processes hold counted once;
    - each process holds at most 0.3 of what a DDP-inside process holds (a quarter of the split weights, half of
      the norms and tied embedding), and sends across replicas what it holds: its fp32 bytes, once (2 replicas);
    - the same piece is bit-identical in both replicas after every sync; the processes of a piece-set read the
      same batches, the two piece-sets of a replica different ones."""
    tmp = tmp_path_factory.mktemp("fsdp-tp")
    ranks = launch(tmp, processes=8, config=ACCELERATE_CPU_FSDP_TP, replica_group_size=4)
    ddp_tmp, ddp_ranks = all_layouts["ddp", "fp32"]
    split, whole = torch.load(tmp / "final.pt"), torch.load(ddp_tmp / "final.pt")
    assert set(split) == set(whole)
    worst = max((split[k] - whole[k]).abs().max().item() for k in whole)
    assert worst < 1e-4, f"largest parameter difference {worst:.2e}"
    assert ranks[0]["total_flos"] == pytest.approx(ddp_ranks[0]["total_flos"], rel=1e-6)
    rounds, ddp_rounds = read_syncs(tmp / "run"), read_syncs(ddp_tmp / "run")
    for a, b in zip(rounds, ddp_rounds, strict=True):
        assert a["synced_parameters"] == b["synced_parameters"]
        for key in ("pseudo_grad_norm", "loss"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), key
        assert a["replica_pseudo_grad_norms"] == pytest.approx(b["replica_pseudo_grad_norms"], rel=1e-5)
        held = ranks[0]["held_bytes"]["parameters"]
        assert held <= a["bytes_per_replica"] <= held + 500, \
            "its fp32 pieces, the round's statistics and the contribution checks' table: a few numbers each"
    for rank in range(8):
        for part, size in ddp_ranks[rank % 4]["held_bytes"].items():
            assert 0 < ranks[rank]["held_bytes"][part] <= 0.3 * size, (rank, part)
        assert ranks[rank]["digests"] == ranks[(rank + 4) % 8]["digests"], "the same piece in both replicas"
    assert ranks[0]["digests"][-1][1] != ranks[1]["digests"][-1][1] != ranks[2]["digests"][-1][1]
    assert ranks[0]["seen"] == ranks[1]["seen"] != ranks[2]["seen"] == ranks[3]["seen"]
