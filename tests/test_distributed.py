"""Two real replica processes under `accelerate launch` (gloo): the algorithm, checked end to end.

Each test reads back what every rank of tests/scripts/replica_run.py recorded. The runs of replicas of one process
(`two`) and those of replicas of two processes (`four`) are trained in the session's shared launches of two and
four processes, each run in its own folder (tests/helpers.py share); the tests of `paper_run` read one run (paper
outer settings, H = 5, 12 steps: rounds end at 5, 10, 12), the first of the shared launch of two.
"""

import copy
import json
import math
import sys

import pytest
import torch
from helpers import (
    ACCELERATE_CPU_4PROC,
    GATHER,
    pattern_blocks,
    share,
    tiny_llama,
)

from hf_diloco.contributions import CHECK_FIELDS  # noqa: E402
from hf_diloco.records import STAT_NAMES as ROUND_STATS  # noqa: E402

pytestmark = pytest.mark.process  # every test here starts processes

SLOTS = 2 * len(ROUND_STATS)  # statistics riding along with the sync: M = 2 replicas x k values


def check_table_bytes() -> int:
    """The contribution checks' table before each sync: M = 2 rows of CHECK_FIELDS in float64, all-reduced over the
    sync's group of each slice (one process per replica; a ring of 2 sends all of it, once)."""
    return 2 * len(CHECK_FIELDS) * 8


CHECK_TABLE_BYTES = check_table_bytes()


PAPER_OUTER = {"outer_lr": 0.7, "outer_momentum": 0.9, "outer_nesterov": True}
FEDAVG = {"outer_lr": 1.0, "outer_momentum": 0.0, "outer_nesterov": False}
SLOW_LINK = 0.3  # seconds each all-reduce across replicas waits first in the auto runs

# Replicas of one process: one launch of two processes trains each in turn.
TWO = {
    "non_iid": {"inner_steps": 5, "max_steps": 12, "data_sharding": "non_iid"},
    "fedavg": {"inner_steps": 4, "max_steps": 10, **FEDAVG, "learning_rate": 3e-3,
               "train_sampling_strategy": "sequential"},
    "apart": {"inner_steps": 5, "max_steps": 12, **PAPER_OUTER, "seed_by_rank": True},
    "auto_h": {"inner_steps": 2, "auto_inner_steps": True, "max_sync_overhead": 0.05, "max_steps": 40},
    "auto_tau": {"inner_steps": 30, "num_fragments": 3, "sync_delay": "auto", "max_steps": 90,
                 "slow_sync_seconds": SLOW_LINK},
    "both_autos": {"inner_steps": 4, "auto_inner_steps": True, "max_sync_overhead": 0.9, "num_fragments": 2,
                   "sync_delay": "auto", "max_steps": 240, "slow_sync_seconds": SLOW_LINK},
    "stop": {"inner_steps": 5, "max_steps": 12, "stop_at_step": 3},
    "restarts": {"inner_steps": 2, "max_steps": 8, **PAPER_OUTER, "outer_momentum_restart": 2,
                 "train_sampling_strategy": "sequential"},
}
# Replicas of two processes (DDP inside, replica_group_size 2): one launch of four processes.
GROUPED = {"replica_group_size": 2, "inner_steps": 3, "max_steps": 7}
FOUR = {
    "grouped": {**GROUPED, **FEDAVG, "train_sampling_strategy": "sequential"},
    "nesterov": {**GROUPED, **PAPER_OUTER, "sync_bucket_mb": 4096 * 4 / 2**20,
                 "train_sampling_strategy": "sequential"},
    "non_iid_groups": {**GROUPED, "data_sharding": "non_iid"},
}


share("distributed", TWO)
share("distributed", FOUR, ACCELERATE_CPU_4PROC)


@pytest.fixture(scope="module")
def two(shared_runs):
    """name → (folder, every rank's record) of each run of TWO (the session's shared launch of two processes)."""
    return shared_runs("distributed")


@pytest.fixture(scope="module")
def four(shared_runs):
    """name → (folder, every rank's record) of each run of FOUR (the shared launch of four processes)."""
    return shared_runs("distributed", ACCELERATE_CPU_4PROC)


def test_replicas_hold_bit_identical_parameters_after_every_sync(paper_run):
    """After each outer step both replicas must hold exactly the same bits (no broadcast repairs drift)."""
    _, ranks = paper_run
    steps = [step for step, _ in ranks[0]["digests"]]
    assert steps == [5, 10, 12], "a sync every H steps plus one for the partial last round"
    assert ranks[0]["digests"] == ranks[1]["digests"]


def test_no_collective_between_syncs_and_one_per_sync(paper_run):
    """Counted in the real run: nothing crosses replicas during inner steps; a sync is exactly two all-reduces: the
    contribution checks' table (M rows of a few numbers), then the pseudo-gradient with its statistics.

    Trainer logs every step in this run (logging_steps=1), so a hidden loss gather would show up here.
    """
    _, ranks = paper_run
    for rank in ranks:
        by_step: dict[int, list[str]] = {}
        for step, name in rank["calls"]:
            by_step.setdefault(step, []).append(name)
        # Before step 1: one all-reduce of the parameters' digests; the replicas share a seed, so nothing else.
        assert by_step.get(0, []) == ["all_reduce"], f"only the start-up check before step 1: {by_step.get(0)}"
        for step in range(1, 13):
            expected = ["all_reduce", "all_reduce"] if step in (5, 10, 12) else []
            assert by_step.get(step, []) == expected, f"step {step}: {by_step.get(step, [])}"


def test_loss_goes_down_and_rounds_are_reported(paper_run):
    tmp, _ = paper_run
    rounds = [json.loads(line) for line in (tmp / "run" / "syncs.jsonl").read_text().splitlines()]
    assert [(r["sync"], r["round"]) for r in rounds] == [(1, 1), (2, 2), (3, 3)], "one fragment: a sync is a round"
    assert [r["sync_steps"] for r in rounds] == [5, 5, 2]
    assert len(rounds[0]["replica_losses"]) == 2
    assert rounds[0]["replica_losses"][0] != rounds[0]["replica_losses"][1], "replicas must read different shards"
    assert rounds[-1]["loss"] < rounds[0]["loss"]
    for r in rounds:
        assert r["loss"] == pytest.approx(sum(r["replica_losses"]) / 2, rel=1e-9)
        numel = r["synced_parameters"]
        # Ring all-reduce of the fp32 pseudo-gradient plus M x k metric slots: 2 (M-1)/M x payload = payload.
        assert r["bytes_per_replica"] == (numel + SLOTS) * 4 + CHECK_TABLE_BYTES
        assert r["ddp_bytes_per_replica"] == r["sync_steps"] * numel * 4


def test_replica_agreement_matches_the_recorded_norms(paper_run):
    """cos(Δ_i, Δ) arrives one round late; for M = 2 it follows from the norms recorded with the round:
    <Δ0, Δ1> = (4|Δ|² − |Δ0|² − |Δ1|²) / 2 and <Δi, Δ> = (|Δi|² + <Δ0, Δ1>) / 2."""
    tmp, _ = paper_run
    rounds = [json.loads(line) for line in (tmp / "run" / "syncs.jsonl").read_text().splitlines()]
    assert "replica_agreement" not in rounds[0]
    for earlier, later in zip(rounds, rounds[1:], strict=False):
        assert later["agreement_sync"] == earlier["sync"]
        n0, n1 = earlier["replica_pseudo_grad_norms"]
        mean = earlier["pseudo_grad_norm"]
        cross = (4 * mean**2 - n0**2 - n1**2) / 2
        expected = [(n**2 + cross) / 2 / (n * mean) for n in (n0, n1)]
        assert later["replica_agreement"] == pytest.approx(expected, abs=1e-4)
        assert all(-1 <= a <= 1 for a in later["replica_agreement"])


def test_round_metrics_reach_the_trackers_of_report_to(paper_run):
    """The round numbers go through Trainer's report_to integrations: with report_to tensorboard, Trainer's
    TensorBoardCallback writes them (event files read back) at each round's step, equal to syncs.jsonl, under
    train/diloco/<name> (TensorBoard's integration prefixes training metrics with train/), per replica too."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tmp, _ = paper_run
    rounds = [json.loads(line) for line in (tmp / "run" / "syncs.jsonl").read_text().splitlines()]
    (logdir,) = list((tmp / "run" / "runs").iterdir())  # Trainer's own: runs/<date>_<host>
    events = EventAccumulator(str(logdir))
    events.Reload()
    for key in ("loss", "pseudo_grad_norm", "bytes_per_replica"):
        scalars = events.Scalars(f"train/diloco/{key}")
        assert [s.step for s in scalars] == [r["step"] for r in rounds]
        assert [s.value for s in scalars] == pytest.approx([r[key] for r in rounds], rel=1e-6)
    excluded = events.Scalars("train/diloco/excluded")  # contributions the checks left out: none here
    assert [s.value for s in excluded] == [len(r["excluded"]) for r in rounds] == [0] * len(rounds)
    replica_1 = events.Scalars("train/diloco/replica_1/loss")
    assert [s.value for s in replica_1] == pytest.approx([r["replica_losses"][1] for r in rounds], rel=1e-6)
    assert "train/loss" in events.Tags()["scalars"], "Trainer's own metrics are there too"


def test_iid_shards_are_disjoint(paper_run):
    """Default i.i.d. sharding: the replicas read different blocks of one shuffle, never the same one."""
    _, ranks = paper_run
    seen = [set(rank["seen"]) for rank in ranks]
    assert len(ranks[0]["seen"]) == len(ranks[1]["seen"]) == 12 * 2
    assert not seen[0] & seen[1]
    assert min(seen[0]) < 32 <= max(seen[0]), "an i.i.d. shard spans the whole corpus"


def test_non_iid_sharding_gives_each_replica_its_own_slice(two):
    """data_sharding=non_iid: replica r trains only on the r-th contiguous half of the 64 blocks."""
    _, ranks = two["non_iid"]
    assert all(0 <= b < 32 for b in ranks[0]["seen"]) and all(32 <= b < 64 for b in ranks[1]["seen"])
    assert len(set(ranks[0]["seen"])) == 24, "shuffled within the slice, without repeats in one epoch"
    assert ranks[0]["digests"] == ranks[1]["digests"]


def reference_diloco(steps: int, inner_steps: int, lr: float, batch: int = 2, replicas: int = 2, group: int = 1,
                     outer_lr: float = 1.0, momentum: float = 0.0, nesterov: bool = False, restart: int = 0) -> dict:
    """Replicas trained with a plain torch loop and an outer SGD step every H steps, written from the paper.

    Independent of Trainer and hf_diloco. Data: a sequential pass sharded the way the trainer's loader shards it,
    batch b of the global order going to process b mod W (W = replicas x group). A replica of `group` processes
    under DDP steps on the mean gradient of its processes' equal-sized batches, i.e. on their concatenation.
    Outer step (torch SGD's convention): Δ = θ_global − mean_i θ_i; v ← Δ (first round) or momentum·v + Δ;
    θ_global ← θ_global − outer_lr · (Δ + momentum·v if Nesterov else v). Outer lr 1, momentum 0 is FedAvg.
    `restart` K > 0: v is forgotten after every K outer steps, so the next one starts it from its own Δ again.
    """
    blocks = torch.tensor(pattern_blocks())
    base = tiny_llama(seed=0)
    models = [copy.deepcopy(base) for _ in range(replicas)]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.0) for m in models]
    global_params = [p.detach().clone() for p in base.parameters()]
    velocity: list[torch.Tensor] | None = None
    processes, outer_steps = replicas * group, 0
    for step in range(1, steps + 1):
        for k, (model, optimizer) in enumerate(zip(models, optimizers, strict=True)):
            first = (processes * (step - 1) + k * group) * batch
            ids = blocks[first : first + group * batch]
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        if step % inner_steps == 0 or step == steps:
            with torch.no_grad():
                replica_params = list(zip(*(m.parameters() for m in models), strict=True))
                deltas = [g - sum(ps) / replicas for g, ps in zip(global_params, replica_params, strict=True)]
                if restart and outer_steps and outer_steps % restart == 0:
                    velocity = None
                outer_steps += 1
                if momentum:
                    velocity = [d.clone() if velocity is None else momentum * v + d
                                for d, v in zip(deltas, velocity or deltas, strict=True)]
                    updates = [d + momentum * v if nesterov else v for d, v in zip(deltas, velocity, strict=True)]
                else:
                    updates = deltas
                for g, u, ps in zip(global_params, updates, replica_params, strict=True):
                    g -= outer_lr * u
                    for p in ps:
                        p.copy_(g)
    return models[0].state_dict()


def max_difference(got: dict, want: dict) -> float:
    return max((got[k] - want[k]).abs().max().item() for k in want)


def test_outer_lr_1_without_momentum_is_parameter_averaging(two):
    """Outer SGD lr 1, momentum 0 is FedAvg: the result equals averaging the replicas every H steps (tol 1e-5)."""
    folder, _ = two["fedavg"]
    got = torch.load(folder / "final.pt")
    want = reference_diloco(steps=10, inner_steps=4, lr=3e-3)
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst < 1e-5, f"largest parameter difference {worst:.2e}"
    # And training really moved the parameters (the check above is not trivially true).
    start = tiny_llama(seed=0).state_dict()
    assert max((want[k] - start[k]).abs().max().item() for k in want) > 1e-3



def test_outer_momentum_restarts_are_the_independent_loops_restarted_nesterov(two):
    """outer_momentum_restart 2 with the paper's outer Nesterov (lr 0.7, momentum 0.9), H = 2, 8 steps: 4 syncs,
    the momentum started afresh at the third; equal to the independent loop restarted alike (tol 1e-5), whose
    unrestarted run differs; the replicas hold the same bits after every sync."""
    folder, ranks = two["restarts"]
    assert ranks[0]["digests"] == ranks[1]["digests"] and len(ranks[0]["digests"]) == 4
    want = reference_diloco(steps=8, inner_steps=2, lr=3e-3, outer_lr=0.7, momentum=0.9, nesterov=True, restart=2)
    worst = max_difference(torch.load(folder / "final.pt"), want)
    assert worst < 1e-5, f"largest parameter difference {worst:.2e}"
    plain = reference_diloco(steps=8, inner_steps=2, lr=3e-3, outer_lr=0.7, momentum=0.9, nesterov=True)
    assert max_difference(plain, want) > 1e-3, "the restart must matter, or the check above proves nothing"


@pytest.fixture(scope="module")
def grouped_run(four):
    """4 processes = 2 replicas x 2 (DDP inside a replica), FedAvg outer step, H = 3, 7 steps."""
    return four["grouped"]


def test_replica_groups_all_processes_identical_after_every_sync(grouped_run):
    _, ranks = grouped_run
    assert [s for s, _ in ranks[0]["digests"]] == [3, 6, 7]
    assert all(rank["digests"] == ranks[0]["digests"] for rank in ranks)


def test_replica_groups_sync_is_one_sliced_all_reduce_and_one_all_gather(grouped_run):
    """Across replicas only the sync (the contribution checks' table, then the sliced pseudo-gradient); inside a replica
    only DDP (not visible here), the members' count of the examples their steps trained on (one number, for the
    checks' `steps` rule: every member must put the same row in the table) and the slice all-gather."""
    _, ranks = grouped_run
    for rank in ranks:
        by_step: dict[int, list[str]] = {}
        for step, name in rank["calls"]:
            by_step.setdefault(step, []).append(name)
        for step in range(1, 8):
            expected = ["all_reduce", "all_reduce", "all_reduce", GATHER] if step in (3, 6, 7) else []
            assert by_step.get(step, []) == expected, f"step {step}: {by_step.get(step, [])}"


def test_replica_groups_equal_averaging_of_ddp_replicas(grouped_run):
    """Against the independent loop: 2 replicas, each the DDP pair of processes, averaged every 3 steps."""
    tmp, _ = grouped_run
    got = torch.load(tmp / "final.pt")
    want = reference_diloco(steps=7, inner_steps=3, lr=3e-3, replicas=2, group=2)
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst < 1e-5, f"largest parameter difference {worst:.2e}"


def test_replica_groups_halve_the_bytes_crossing_replicas(grouped_run, paper_run):
    """Each member sends only its half of the pseudo-gradient to the other replica: g = 2 halves the bytes."""
    rounds = {}
    for name, (tmp, _) in (("grouped", grouped_run), ("single", paper_run)):
        rounds[name] = [json.loads(line) for line in (tmp / "run" / "syncs.jsonl").read_text().splitlines()]
    numel = rounds["single"][0]["synced_parameters"]
    grouped = rounds["grouped"][0]
    assert grouped["replica_group_size"] == 2 and grouped["num_replicas"] == 2
    # Main process: half the fp32 pseudo-gradient (padded to even length) plus M x k metric slots, ring factor 1.
    assert grouped["bytes_per_replica"] == ((numel + numel % 2) // 2 + SLOTS) * 4 + check_table_bytes()
    assert rounds["single"][0]["bytes_per_replica"] == (numel + SLOTS) * 4 + check_table_bytes()
    # The all-gather inside the replica sends this member's half and its metric slots: (g - 1) / g of the result.
    assert grouped["intra_replica_bytes"] == ((numel + numel % 2) // 2 + SLOTS) * 4
    assert len(grouped["replica_losses"]) == 2


def rounds_of(tmp) -> list[dict]:
    return [json.loads(line) for line in (tmp / "run" / "syncs.jsonl").read_text().splitlines()]


def assert_reported_bytes_are_on_the_wire(tmp, ranks) -> None:
    """What a round reports sending (across and inside replicas) is what the main process wrote to its sockets.

    Measured by the kernel (bytes passed to write-like system calls during the sync, see replica_run.py); gloo
    adds a small header per message, hence the tolerance of 0.5% plus 16 kB.
    """
    rounds = rounds_of(tmp)
    measured = dict(ranks[0]["wire_bytes"])
    assert sorted(measured) == [r["step"] for r in rounds]
    for r in rounds:
        reported = r["bytes_per_replica"] + r.get("intra_replica_bytes", 0)
        assert reported > 0
        assert reported <= measured[r["step"]] <= reported * 1.005 + 16384, (r["step"], reported, measured)


def test_reported_bytes_per_round_are_the_bytes_sent(paper_run):
    tmp, ranks = paper_run
    assert_reported_bytes_are_on_the_wire(tmp, ranks)


def test_replicas_that_start_apart_take_rank_0s_parameters_before_step_1(paper_run, two):
    """Each process builds its model from another seed: the start-up check (one all-reduce of digests) finds them
    different and rank 0 broadcasts its parameters, which the first round reports as `startup_bytes`. The run then
    is the paper run, whose replicas shared seed 0 and sent only the check, to the bit."""
    paper_tmp, _ = paper_run
    folder, ranks = two["apart"]
    for rank in ranks:
        assert [name for step, name in rank["calls"] if step == 0] == ["all_reduce", "broadcast"], rank["calls"][:4]
    assert ranks[0]["digests"] == ranks[1]["digests"]
    apart, alike = (json.loads((t / "run" / "syncs.jsonl").read_text().splitlines()[0])
                    for t in (folder, paper_tmp))
    parameters = sum(p.numel() for p in torch.load(paper_tmp / "final.pt").values())
    assert apart["startup_bytes"] >= 4 * apart["synced_parameters"] and apart["synced_parameters"] <= parameters
    assert alike["startup_bytes"] < 1000, "alike replicas send only the digest check"
    mine, paper = torch.load(folder / "final.pt"), torch.load(paper_tmp / "final.pt")
    assert all(torch.equal(mine[k], paper[k]) for k in paper)


def test_inner_steps_auto_chooses_h_from_the_first_rounds_on_every_replica_alike(two):
    """inner_steps auto, starting at H = 2, waiting for syncs at most 5% of compute: after two rounds the record
    holds the choice and what it was made from; recomputed here from those numbers, H is the smallest whole number
    with sync_seconds <= 0.05 * H * step_seconds, the following rounds are H steps apart, and the replicas stay
    identical (both made the same choice at the same step)."""
    folder, ranks = two["auto_h"]
    rounds = [json.loads(line) for line in (folder / "run" / "syncs.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rounds[:2]] == [2, 4]
    (chosen_at,) = [r for r in rounds if "inner_steps_auto" in r]
    choice = chosen_at["inner_steps_auto"]
    assert chosen_at["step"] == 4 and choice["from_step"] == 4
    h = choice["chosen"]
    assert choice["sync_seconds"] <= 0.05 * h * choice["step_seconds"] + 1e-12
    assert h == 1 or choice["sync_seconds"] > 0.05 * (h - 1) * choice["step_seconds"]
    later = [r["step"] for r in rounds[2:]]
    assert later == [*range(4 + h, 40, h), 40][: len(later)] and later[-1] == 40
    assert ranks[0]["digests"] == ranks[1]["digests"]


def test_sync_delay_auto_overlaps_each_fragment_with_the_steps_its_exchange_takes(two):
    """sync_delay auto with 3 fragments (one sync every 10 steps, H = 30) over a link made slower (each all-reduce
    waits 0.3 s): every round, the fragment that synced before takes τ = the fewest steps (1 to 9) whose compute
    covers its exchange, recomputed here from the numbers the record gives, and a fragment not measured yet takes
    the τ of that exchange scaled by its size; each later sync lands τ steps after its launch (the final window
    keeps the τ it was placed with), so fragment 2's first sync already overlaps more than one step; both replicas
    land at the same steps (they chose alike)."""
    folder, ranks = two["auto_tau"]
    rounds = [json.loads(line) for line in (folder / "run" / "syncs.jsonl").read_text().splitlines()]
    delays = {}  # fragment -> τ in effect
    for number, record in enumerate(rounds):
        (fragment,) = record["fragments"]
        if number < len(rounds) - 3:  # before the final window
            assert record["step"] - record["launch_step"] == delays.get(fragment, 1), record
        choice = record.get("sync_delay_auto")
        if choice is None:
            continue
        wanted = math.ceil(choice["exchange_seconds"] / choice["step_seconds"] - 1e-9)
        assert choice["chosen"] == max(1, min(9, wanted)), choice
        assert choice["exchange_seconds"] >= SLOW_LINK, "the measured exchange includes the slower link"
        delays.update({f: choice["chosen"] for f in choice["fragments"]})
        delays.update({int(f): tau for f, tau in choice.get("estimated", {}).items()})
    first_of_2 = next(r for r in rounds if r["fragments"] == [2])
    assert first_of_2["step"] - first_of_2["launch_step"] > 1, "fragment 2 began with an estimate"
    assert set(delays) == {0, 1, 2} and max(delays.values()) > 1, delays
    assert [s for s, _ in ranks[0]["digests"]] == [s for s, _ in ranks[1]["digests"]]
    assert ranks[0]["digests"][-1] == ranks[1]["digests"][-1]


def test_sync_delay_auto_and_inner_steps_auto_together_end_staggered_on_identical_replicas(two):
    """Both autos at once over the slower link, 2 fragments, H starting at 4: H is chosen after two syncs of each
    fragment; every τ chosen after that lies within the new H (1 to H/F − 1); the end is staggered (the last sync
    was launched before the last step and lands at it), and the replicas end identical."""
    folder, ranks = two["both_autos"]
    rounds = [json.loads(line) for line in (folder / "run" / "syncs.jsonl").read_text().splitlines()]
    (chosen_at,) = [r for r in rounds if "inner_steps_auto" in r]
    h = chosen_at["inner_steps_auto"]["chosen"]
    later = [r["sync_delay_auto"]["chosen"] for r in rounds if "sync_delay_auto" in r and r["sync"] >
             chosen_at["sync"]]
    assert later and all(1 <= tau <= max(1, h // 2 - 1) for tau in later), (h, later)
    last = rounds[-1]
    assert last["step"] == 240 and last["launch_step"] < 240 and len(last["fragments"]) == 1, last
    # One record per sync, numbered on across the change of H; two syncs (one per fragment) make a round.
    assert [(r["sync"], r["round"]) for r in rounds] == [(n, (n + 1) // 2) for n in range(1, len(rounds) + 1)]
    assert ranks[0]["digests"][-1] == ranks[1]["digests"][-1]


def test_a_stop_request_from_one_replica_stops_all_at_the_round_end(two):
    """Rank 0 alone asks to stop after step 3 (H = 5): the request rides the round's sync, so both replicas stop
    after step 5 with a checkpoint, not at max_steps 12."""
    folder, ranks = two["stop"]
    for rank in ranks:
        assert [step for step, _ in rank["digests"]] == [5]
    assert ranks[0]["digests"] == ranks[1]["digests"]
    assert (folder / "run" / "checkpoint-5").is_dir()
    assert not (folder / "run" / "checkpoint-10").exists()


def test_replica_groups_with_nesterov_momentum_and_several_buckets(four):
    """g = 2, the paper's outer Nesterov SGD (lr 0.7, momentum 0.9) and buckets of 4096 values (the model has ≈ 23k
    trainable values, so every sync is several bucketed collectives): equal to the independent loop (tol 1e-5),
    the same on every process, and the bytes reported are the bytes sent."""
    from hf_diloco.outer import partition_into_buckets

    folder, ranks = four["nesterov"]
    assert all(rank["digests"] == ranks[0]["digests"] for rank in ranks)
    numels = [p.numel() for p in tiny_llama().parameters()]
    buckets = len(partition_into_buckets(numels, 4096))
    assert buckets >= 4
    for rank in ranks:
        at_sync = [name for step, name in rank["calls"] if step == 3]
        assert at_sync.count("all_reduce") == buckets + 2, \
            f"the members' examples, the checks' table, then a bucket at a time: {at_sync}"
    want = reference_diloco(steps=7, inner_steps=3, lr=3e-3, replicas=2, group=2, outer_lr=0.7, momentum=0.9,
                            nesterov=True)
    worst = max_difference(torch.load(folder / "final.pt"), want)
    assert worst < 1e-5, f"largest parameter difference {worst:.2e}"
    fedavg = reference_diloco(steps=7, inner_steps=3, lr=3e-3, replicas=2, group=2)
    assert max_difference(fedavg, want) > 1e-3, "momentum must matter, or the check above proves nothing"
    assert_reported_bytes_are_on_the_wire(folder, ranks)


def test_non_iid_sharding_with_replica_groups(four):
    """non_iid with g = 2: replica r (processes 2r, 2r + 1) reads only the r-th contiguous half of the 64 blocks,
    its two members read different blocks of it, and all four processes end every round identical."""
    _, ranks = four["non_iid_groups"]
    assert all(rank["digests"] == ranks[0]["digests"] for rank in ranks)
    halves = [set(ranks[0]["seen"]) | set(ranks[1]["seen"]), set(ranks[2]["seen"]) | set(ranks[3]["seen"])]
    assert all(b < 32 for b in halves[0]) and all(b >= 32 for b in halves[1])
    assert not set(ranks[0]["seen"]) & set(ranks[1]["seen"]) and not set(ranks[2]["seen"]) & set(ranks[3]["seen"])
    assert all(len(rank["seen"]) == 7 * 2 for rank in ranks)
    assert len(halves[0]) == 28, "each member reads 14 distinct blocks of its replica's 32"


def test_replica_groups_report_the_bytes_sent(grouped_run):
    tmp, ranks = grouped_run
    assert_reported_bytes_are_on_the_wire(tmp, ranks)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
