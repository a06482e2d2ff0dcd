"""Compressed, streamed and overlapped syncs in real 2- and 4-process runs (accelerate launch, gloo).

Each run is tests/scripts/replica_run.py (every collective counted, a parameter digest after every sync) or
tests/scripts/overlap_run.py (a deliberately slow link), with DiLoCoConfig settings passed through. TWO and FOUR
are trained in the session's shared launches of two and four processes (tests/helpers.py share), OVERLAP in one
launch of two processes of its own.
"""

import json
import math

import pytest
import torch
from helpers import ACCELERATE_CPU_4PROC, GATHER, REPO, replica_runs, share

from hf_diloco.codecs import make_codec
from hf_diloco.contributions import CHECK_FIELDS
from hf_diloco.metrics import read_syncs
from hf_diloco.records import STAT_NAMES as ROUND_STATS

# Before each sync, the contribution checks' table: M = 2 rows of CHECK_FIELDS in float64, all-reduced over the 2
# replicas (a ring of 2 sends all of it, once).
CHECK_TABLE = 2 * len(CHECK_FIELDS) * 8
PAPER_OUTER = {"outer_lr": 0.7, "outer_momentum": 0.9, "outer_nesterov": True}
STREAMING = {"inner_steps": 6, "max_steps": 13, "num_fragments": 3, "sync_delay": 1, "fragment_alpha": 0.5,
             "save_every_rounds": 1, "save_total_limit": 10}
TWO = {
    "int4": {"inner_steps": 4, "max_steps": 12, "compression": "int4", "error_feedback": True},
    "sparse": {"inner_steps": 4, "max_steps": 24, "compression": "sparse", "sparse_k": 256, "sparse_chunk": 1024,
               "error_feedback": True, "error_feedback_decay": 0.95, "outer_lr": 1.0, "outer_momentum": 0.0},
    "buckets": {"inner_steps": 5, "max_steps": 12, "sync_bucket_mb": 0.01},  # 2,621 values a bucket
    "streaming-auto": {**STREAMING, "final_sync": "auto"},
    "streaming-blocking": {**STREAMING, "final_sync": "blocking"},
    "streaming-muon": {"inner_optimizer": "muon", "inner_steps": 6, "max_steps": 24, "num_fragments": 2,
                       "sync_delay": 1, "compression": "int4", "error_feedback": True, "final_sync": "blocking"},
    "neutral": {"inner_steps": 5, "max_steps": 12, **PAPER_OUTER, "num_fragments": 1, "sync_delay": 0,
                "fragment_alpha": 0.0, "fragment_pattern": "sequential", "compression": "none",
                "error_feedback": False},
}
FOUR = {"groups-int8": {"replica_group_size": 2, "inner_steps": 3, "max_steps": 6, "compression": "int8"},
        "groups-muon": {"replica_group_size": 2, "inner_steps": 3, "max_steps": 6, "inner_optimizer": "muon"}}
# tests/scripts/overlap_run.py: a slow link (0.6 s per sync), slow steps (0.4 s), H = 6, 12 steps; τ and final_sync.
SLOW = {"comm_sleep": 0.6, "step_sleep": 0.4}
OVERLAP = {"tau2-staggered": {**SLOW, "sync_delay": 2, "final_sync": "staggered"},
           "tau2-blocking": {**SLOW, "sync_delay": 2, "final_sync": "blocking"},
           "tau0": {**SLOW, "sync_delay": 0, "final_sync": "auto"}}


share("compression", TWO)
share("compression", FOUR, ACCELERATE_CPU_4PROC)


@pytest.fixture(scope="module")
def two(shared_runs):
    """name → (folder, every rank's record) of each run of TWO (the session's shared launch of two processes)."""
    return shared_runs("compression")


def collectives_by_step(rank: dict) -> dict[int, list[str]]:
    by_step: dict[int, list[str]] = {}
    for step, name in rank["calls"]:
        by_step.setdefault(step, []).append(name)
    return by_step


@pytest.fixture(scope="module")
def int4_run(two):
    """int4 + error feedback, 2 replicas, H = 4, 12 steps: syncs at 4, 8, 12."""
    tmp, ranks = two["int4"]
    return tmp, ranks, read_syncs(tmp / "run")


@pytest.mark.process
def test_int4_replicas_are_bit_identical_after_every_sync(int4_run):
    """Every process decodes the same bytes, so the outer step gives the same bits everywhere."""
    _, ranks, _ = int4_run
    assert [step for step, _ in ranks[0]["digests"]] == [4, 8, 12]
    assert ranks[0]["digests"] == ranks[1]["digests"]


@pytest.mark.process
def test_int4_sync_is_a_reduce_scatter_and_an_all_gather_and_nothing_between(int4_run):
    _, ranks, _ = int4_run
    for rank in ranks:
        by_step = collectives_by_step(rank)
        for step in range(1, 13):
            expected = ["all_reduce", "all_to_all_single", GATHER] if step in (4, 8, 12) else []
            assert by_step.get(step, []) == expected, f"step {step}: {by_step.get(step)}"


@pytest.mark.process
def test_int4_reported_bytes_are_the_payload_arithmetic(int4_run):
    """Per sync and process, with M = 2: the checks' table, one encoded shard out in the all-to-all, one encoded
    averaged shard plus the k round statistics (fp32) out in the all-gather. The ratio is against an fp32 all-reduce
    of the same (which sends the same table)."""
    _, _, rounds = int4_run
    codec = make_codec("int4")
    k = len(ROUND_STATS)
    for record in rounds:
        n = record["synced_parameters"]
        shard = math.ceil(n / 2)
        expected = codec.encoded_bytes(shard) + codec.encoded_bytes(shard) + 4 * k + CHECK_TABLE
        assert record["bytes_per_replica"] == expected
        fp32 = (n + 2 * k) * 4 + CHECK_TABLE  # ring all-reduce with M = 2 sends the payload once
        assert record["compression_ratio"] == pytest.approx(fp32 / expected)
        assert record["compression"] == "int4+ef"
        assert record["compression_ratio"] > 7


@pytest.mark.process
def test_int4_with_error_feedback_trains(int4_run):
    _, _, rounds = int4_run
    assert rounds[-1]["loss"] < rounds[0]["loss"] - 0.3


@pytest.mark.process
def test_the_last_rounds_agreement_reaches_the_summary(int4_run):
    """Agreement rides with the next sync, so the last round's comes through the store into the summary: one
    cosine per replica, positive (each replica's Δ_i points with the mean of two) and at most 1."""
    tmp, _, rounds = int4_run
    last = json.loads((tmp / "run" / "diloco_summary.json").read_text())["last_sync_agreement"]
    assert last["sync"] == rounds[-1]["sync"] == 3
    assert len(last["replica_agreement"]) == 2 and all(0 < c <= 1 for c in last["replica_agreement"])
    assert rounds[-1]["agreement_sync"] == 2, "the records carry the syncs before it"


@pytest.mark.process
def test_sparse_with_error_feedback_converges_and_stays_identical(two):
    """SparseLoCo's recipe (2-bit values, error feedback 0.95, outer SGD lr 1 without momentum) with a quarter of
    each chunk kept, so that a 23k-parameter model learns in a few rounds (64 of 4096 needs hundreds)."""
    folder, ranks = two["sparse"]
    assert ranks[0]["digests"] == ranks[1]["digests"]
    rounds = read_syncs(folder / "run")
    assert rounds[-1]["loss"] < rounds[0]["loss"] - 0.3
    codec = make_codec("sparse", sparse_k=256, sparse_chunk=1024)
    for record in rounds:
        payload = codec.encoded_bytes(record["synced_parameters"]) + 4 * len(ROUND_STATS) + CHECK_TABLE
        assert record["bytes_per_replica"] == payload  # M = 2: the payload goes to the one other replica
    for rank in ranks:
        assert collectives_by_step(rank)[4] == ["all_reduce", GATHER]


@pytest.mark.process
def test_replicas_trained_by_muon_stream_int4_fragments_and_end_identical(two):
    """inner_optimizer muon, 2 fragments in int4 with error feedback, overlapped one step (H = 6, 24 steps), a
    blocking end: the fragments sync in turn, the last sync carries both, both processes end with the same
    parameters, and the loss fell by the last sync."""
    folder, ranks = two["streaming-muon"]
    records = read_syncs(folder / "run")
    assert [r["fragments"] for r in records] == [[n % 2] for n in range(len(records) - 1)] + [[0, 1]]
    assert ranks[0]["digests"][-1] == ranks[1]["digests"][-1] and ranks[0]["digests"][-1][0] == 24
    assert records[-1]["loss"] < records[0]["loss"] - 0.2, [r["loss"] for r in records]


@pytest.mark.process
def test_replica_groups_with_a_codec_or_muon_keep_all_four_processes_identical(shared_runs):
    """2 replicas x 2 processes (DDP inside), int8: each member sends its half across replicas, then gathers
    inside; and replicas trained by Muon (inner_optimizer muon: each member orthogonalizes the same averaged
    gradient of whole matrices): all four processes hold the same parameters after every sync."""
    runs = shared_runs("compression", ACCELERATE_CPU_4PROC)
    for _, ranks in runs.values():
        assert [step for step, _ in ranks[0]["digests"]] == [3, 6]
        assert all(rank["digests"] == ranks[0]["digests"] for rank in ranks)
    for record in read_syncs(runs["groups-int8"][0] / "run"):
        assert record["intra_replica_bytes"] > 0 and record["compression_ratio"] > 3.5


@pytest.mark.process
def test_several_buckets_give_the_same_bits_as_one(two, paper_run):
    """Syncing bucket by bucket is the same arithmetic as syncing everything at once (fp32, paper settings, H = 5,
    12 steps; the one-bucket run is the session's paper run, tests/conftest.py)."""
    one, _ = paper_run
    assert read_syncs(one / "run")[0]["collectives"] == 1
    folder, ranks = two["buckets"]
    assert read_syncs(folder / "run")[0]["collectives"] > 3
    assert ranks[0]["digests"] == ranks[1]["digests"]
    first, second = torch.load(one / "final.pt"), torch.load(folder / "final.pt")
    assert all(torch.equal(first[name], second[name]) for name in first)


@pytest.mark.process
@pytest.mark.parametrize(("final_sync", "end"), [
    ("auto", [(10, 11, [1]), (11, 12, [2]), (12, 13, [0])]),
    ("blocking", [(10, 11, [1]), (12, 13, [2]), (13, 13, [0, 1, 2])]),
])
def test_streaming_fragments_sync_on_their_staggered_schedule(two, final_sync, end):
    """F = 3 (non-layer parameters, layer 0, layer 1), H = 6: one fragment every 2 steps, overlapped by one step
    and mixed with α = 0.5. The end: staggered (auto, as syncs overlap) launches each fragment's last sync one step
    after the one before, from step 13 − 3 · τ = 10, so the last lands at step 13; blocking syncs every fragment at
    the last step. Either way every process ends with the same model."""
    folder, ranks = two[f"streaming-{final_sync}"]
    rounds = read_syncs(folder / "run")
    schedule = [(r.get("launch_step", r["step"]), r["step"], r["fragments"]) for r in rounds]
    assert schedule == [(2, 3, [0]), (4, 5, [1]), (6, 7, [2]), (8, 9, [0]), *end]
    # One record per sync, numbered 1, 2, ...; three syncs make a round (one per fragment).
    assert [(r["sync"], r["round"]) for r in rounds] == [(n, (n + 2) // 3) for n in range(1, len(rounds) + 1)]
    if final_sync == "blocking":
        sizes = {tuple(r["fragments"]): r["synced_parameters"] for r in rounds}
        assert sizes[(0,)] + sizes[(1,)] + sizes[(2,)] == sizes[(0, 1, 2)]
    assert ranks[0]["digests"][-1] == ranks[1]["digests"][-1]
    # save_every_rounds: 1 counts whole rounds: the third sync (round 1's last) lands at step 7, and the run's end
    # saves; the syncs landing at steps 3, 5 and 9 end no round.
    saved = sorted(int(c.name.split("-")[1]) for c in (folder / "run").glob("checkpoint-*"))
    assert saved == [7, 13], saved


@pytest.fixture(scope="module")
def overlap_runs(tmp_path_factory):
    """tests/scripts/overlap_run.py's runs of OVERLAP in one launch: name → (folder, every rank's record). The
    staggered-end and overlap tests below read the same τ = 2 runs."""
    folder = tmp_path_factory.mktemp("overlap")
    return {name: (folder / name, ranks)
            for name, ranks in replica_runs(folder, OVERLAP, script="overlap_run.py").items()}


@pytest.mark.process
@pytest.mark.parametrize("final_sync", ["staggered", "blocking"])
def test_a_staggered_end_leaves_the_last_step_nothing_to_wait_for(overlap_runs, final_sync):
    """A slow link (0.6 s per sync), slow steps (0.4 s), τ = 2, H = 6, 12 steps. Staggered: the last sync is
    launched at step 10 and trains on through steps 11 and 12, so the last round keeps the loop waiting for under
    half its exchange. Blocking: the last round is launched at step 12 and the loop waits for all of it."""
    tmp, _ = overlap_runs[f"tau2-{final_sync}"]
    rounds = read_syncs(tmp / "run")
    last = rounds[-1]
    assert last["step"] == 12
    if final_sync == "staggered":
        assert last["launch_step"] == 10
        assert last["blocked_seconds"] < 0.5 * last["sync_seconds"]
    else:
        assert "launch_step" not in last
        assert last["blocked_seconds"] >= last["sync_seconds"] >= 0.6


@pytest.mark.process
@pytest.mark.parametrize("sync_delay", [0, 2])
def test_overlapped_sync_does_not_make_the_inner_loop_wait(overlap_runs, sync_delay):
    """A slow link (0.6 s per sync) and slow steps (0.4 s each). Blocking (τ = 0): the inner loop waits for the
    whole sync. τ = 2: the next steps end while the sync is still in flight, and the time the loop was blocked is
    a fraction of the sync's duration. The first round is all this reads: τ = 2 reads the staggered-end run above
    (final_sync auto with τ > 0 is staggered), τ = 0 a run of its own (auto: blocking)."""
    tmp, ranks = overlap_runs["tau2-staggered" if sync_delay else "tau0"]
    rounds = read_syncs(tmp / "run")
    first = rounds[0]
    assert first.get("launch_step", first["step"]) == 6
    for rank in ranks:
        started, ended = rank["exchanges"][0]
        steps_during = [step for step, t in rank["step_ends"] if started < t < ended]
        if sync_delay:
            assert steps_during == [7], "the replica trained on while its sync was in flight"
        else:
            assert steps_during == []
    if sync_delay:
        assert first["blocked_seconds"] < 0.5 * first["sync_seconds"]
    else:
        assert first["blocked_seconds"] >= first["sync_seconds"] >= 0.6


def test_dry_run_prints_each_codecs_bytes_per_round_beside_ddp():
    """The dry run's per-codec line is the payload arithmetic: with M = 8 (shown when launched alone), int8 sends
    7 encoded shards out and 7 encoded averages out, each 1/8 of the model plus one fp32 scale per 1024 values."""
    from helpers import cli

    from hf_diloco.metrics import format_bytes

    result = cli("train", "--config", str(REPO / "recipes" / "tiny-pretrain.yaml"), "--dry_run", "true",
                       "--compression", "int8", "--num_fragments", "5")
    assert result.returncode == 0, result.stderr[-2000:]
    n = 1_082_880  # tiny-llama
    shard = n // 8
    int8 = 2 * 7 * (shard + 4 * math.ceil(shard / 1024))
    fp32 = 2 * 7 * n * 4 // 8
    assert f"{format_bytes(int8)} with compression int8" in result.stdout
    assert f"none {format_bytes(fp32)}" in result.stdout and f"int8 {format_bytes(int8)}" in result.stdout
    assert "5 fragment(s), one sync every 10 steps" in result.stdout
    assert "DDP for the same 50 steps" in result.stdout


@pytest.mark.process
def test_streaming_settings_at_their_neutral_values_give_plain_diloco_bit_for_bit(two, paper_run):
    """F = 1, τ = 0, α = 0, no codec (sequential pattern, all spelled out) runs the streaming machinery with
    nothing to stream: the replicas end with exactly the bits of the same run with every field at its default (the
    session's paper run, tests/conftest.py)."""
    plain_dir, plain = paper_run
    folder, neutral = two["neutral"]
    assert neutral[0]["digests"] == plain[0]["digests"] == plain[1]["digests"]
    mine, reference = (torch.load(t / "final.pt") for t in (folder, plain_dir))
    assert all(torch.equal(mine[k], reference[k]) for k in reference)


@pytest.mark.parametrize(("settings", "words"), [
    (dict(inner_steps=50, num_fragments=4), "inner_steps=50 must be a multiple of num_fragments=4"),
    (dict(inner_steps=50, num_fragments=5, sync_delay=10), "sync_delay=10 must be below inner_steps/num_fragments=10"),
    (dict(inner_steps=10, sync_delay=-1), "sync_delay"),
    (dict(inner_steps=10, fragment_alpha=1.5), "fragment_alpha"),
    (dict(inner_steps=10, final_sync="staggered"), "needs sync_delay 1 or more"),
    (dict(inner_steps=10, sync_delay=1, final_sync="staggered", outer_backend="torchft"), "needs outer_backend torch"),
    (dict(inner_steps=10, final_sync="later"), "final_sync must be one of auto, staggered, blocking"),
    (dict(inner_steps=10, overlap_landing="eager"), "needs sync_delay 1 or more (or auto) and fragment_alpha 0"),
    (dict(inner_steps=10, sync_delay=1, fragment_alpha=0.5, overlap_landing="eager"),
     "got sync_delay 1, fragment_alpha 0.5"),
    (dict(inner_steps=10, sync_delay=1, overlap_landing="late"), "overlap_landing must be one of mix, eager"),
])
def test_streaming_settings_that_cannot_work_are_refused_in_one_sentence(settings, words, tmp_path):
    from hf_diloco import DiLoCoConfig
    from hf_diloco.errors import ConfigError

    with pytest.raises(ConfigError) as refused:
        DiLoCoConfig(output_dir=str(tmp_path), report_to="none", **settings)
    message = str(refused.value)
    assert words in message and message.count("\n") == 0 and message.endswith(".")
