"""Time-budget rounds (`round_seconds`) on the fixed group (`outer_backend: torch`), with a real CPU quota.

Replica 1's process runs in a cgroup v1 `cpu` group with a quota of a quarter of a core, so it trains about four
times slower than replica 0 (whose one thread has a core of its own on 2 cores). With rounds of H steps replica 0
would wait for it at every sync; with `round_seconds` each replica syncs when its own budget is spent, after
however many steps it took, and the merge weights each by its tokens. The runs of tests/scripts/replica_run.py are
trained in turn by one launch per layout (`two`, `four`; tests/helpers.py replica_runs): the quota is replica 1's
for the runs that ask for it, and lifted between runs.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from helpers import ACCELERATE_CPU_4PROC, REPO, accelerate_launch, replica_runs
from transformers import AutoModelForCausalLM

from hf_diloco.metrics import read_syncs


def digest(model) -> str:
    """tests/scripts/replica_run.py's digest of a model's parameters (float32 bytes, in the model's order)."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()

pytestmark = pytest.mark.process  # every test here starts processes

QUOTA = 0.25  # of one core, for replica 1
ROUND_SECONDS = 0.5
MAX_STEPS = 600
TOKENS_PER_STEP = 2 * 16  # per_device_train_batch_size 2 of tests/helpers.py pattern blocks of 16 tokens
RECIPE = str(REPO / "recipes" / "tiny-pretrain.yaml")


def train_cli(*arguments: str):
    result = accelerate_launch(["-m", "hf_diloco.cli", "train", "--config", RECIPE, *arguments])
    assert result.returncode == 0, f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result


@pytest.fixture(scope="module")
def slow_group(cpu_quota_of_module):
    """A cgroup v1 `cpu` folder with a quota of QUOTA of a core (tests/conftest.py)."""
    return cpu_quota_of_module(QUOTA)


# The round's settings and the processes of each replica. Replicas of several processes are run with DDP inside:
# the budget is agreed among a replica's members the same way whatever splits the model among them (FSDP2 or
# tensor parallel, whose steps take tens of times longer on CPU and whose runs here left too little of the 2 cores
# for the timing bounds below to mean anything).
LAYOUTS = {
    "fp32": ({}, 1),
    "2-fragments-int4+ef": ({"num_fragments": 2, "compression": "int4", "error_feedback": True}, 1),
    "2x2-ddp-inside": ({"replica_group_size": 2}, 2),
}
SLOW_LINK = 0.4  # seconds each all-reduce across replicas waits first (tests/scripts/replica_run.py)
SHORT_BUDGET = 0.2  # round_seconds the slow link's exchange does not fit in


def budget_runs(slow: str, group: int) -> dict[str, dict]:
    """The runs of replicas of `group` processes, replica 1's processes under the quota of folder `slow` where
    they ask for it."""
    slow_ranks = {str(rank): slow for rank in range(group, 2 * group)}
    budget = {"inner_steps": 10, "round_seconds": ROUND_SECONDS, "max_steps": MAX_STEPS, "cgroup_by_rank": slow_ranks}
    blocking = {**budget, "sync_delay": 0}  # (time budgets overlap by default: these runs hold blocking syncs)
    runs = {}
    if group == 1:  # the runs with the tightest bounds on time spent in syncs first, in processes fresh from start
        runs["overlap"] = {**budget, "num_fragments": 2, "compression": "int4", "error_feedback": True,
                           "sync_delay": "auto", "overlap_landing": "eager"}
        runs["slow-link"] = {"inner_steps": 10, "round_seconds": SHORT_BUDGET, "max_steps": 100_000,
                             "sync_delay": "auto", "slow_sync_seconds": SLOW_LINK, "save_every_rounds": 0,
                             "stop_after_syncs": 7}
    runs.update({layout: {**blocking, **sync} for layout, (sync, size) in LAYOUTS.items() if size == group})
    if group == 1:
        # Rounds long enough that the quota's period evens out: replica 1 is about 4 times slower per round.
        runs["rounds-of-h"] = {"inner_steps": 20, "max_steps": 200, "cgroup_by_rank": {"1": slow}}
    return runs


@pytest.fixture(scope="module")
def two(tmp_path_factory, slow_group):
    """name → (folder, every rank's record) of the runs of replicas of one process, in one launch."""
    folder = tmp_path_factory.mktemp("two")
    runs = replica_runs(folder, budget_runs(str(slow_group), 1))
    return {name: (folder / name, ranks) for name, ranks in runs.items()}


@pytest.fixture(scope="module")
def four(tmp_path_factory, slow_group):
    """The same of the runs of replicas of two processes (DDP inside), in one launch of four."""
    folder = tmp_path_factory.mktemp("four")
    runs = replica_runs(folder, budget_runs(str(slow_group), 2), ACCELERATE_CPU_4PROC)
    return {name: (folder / name, ranks) for name, ranks in runs.items()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_time_budget_rounds_let_a_slow_replica_take_fewer_steps_and_weight_it_by_its_tokens(request, layout):
    """Both replicas sync every ROUND_SECONDS of training (every ROUND_SECONDS / 2 with two fragments): replica 0
    takes more steps than replica 1 (at least as many in nine syncs of ten; a round's checkpoint save is timed in
    the next budget), no process spends more than 30% of its training time inside syncs (40% with replicas of two
    processes on the 2 cores or with two fragments), every sync's merge weights are each replica's tokens over the
    most any replica trained (checked against the steps each replica counted itself), and every replica continues at
    the furthest one's step, so the run ends at max_steps on both. With one fragment every process holds the same
    parameters after every sync; with two, the fragments sync in turn, the last sync carries both, and the replicas
    end identical. Replicas of two processes (DDP inside; replica 1's two share the quota) enter each sync together, and
    member j of both replicas holds the same parameters after every sync."""
    sync, group = LAYOUTS[layout]
    folder, ranks = request.getfixturevalue("four" if group == 2 else "two")[layout]
    max_steps = MAX_STEPS
    records = read_syncs(folder / "run")

    assert len(records) >= 3, records
    if "num_fragments" in sync:
        assert [r["fragments"] for r in records] == [[n % 2] for n in range(len(records) - 1)] + [[0, 1]], records
        assert ranks[0]["digests"][-1] == ranks[group]["digests"][-1], "identical parameters at the end"
        assert all(r["compression"] == "int4+ef" for r in records)
    else:
        # member j of every replica holds the same (its shard of the) parameters after every sync
        assert all(rank["digests"] == ranks[r % group]["digests"] for r, rank in enumerate(ranks))
    fragments = sync.get("num_fragments", 1)
    assert [(r["sync"], r["round"]) for r in records] == [(n, -(-n // fragments)) for n in range(1, len(records) + 1)]
    assert records[-1]["step"] == max_steps and ranks[0]["digests"][-1][0] == max_steps
    fast, slow = ranks[0]["steps_between"], ranks[group]["steps_between"]
    assert len(fast) == len(slow) == len(records)
    assert all(rank["steps_between"] == ranks[r - r % group]["steps_between"] for r, rank in enumerate(ranks))
    # The last sync comes when replica 0 reaches max_steps, before its budget is spent (it may have taken fewer
    # steps than replica 1 since the sync before): leave it out. (A first round can hold one slow first step on both
    # replicas: counted over the run.)
    assert sum(fast[:-1]) > 1.5 * sum(slow[:-1]), (fast, slow)
    # A round's checkpoint save (save_every_rounds 1) is timed in the next sync's budget, and replica 0 writes the
    # model as well: after a save it can take a step fewer than replica 1 (measured once in 52 syncs).
    assert sum(f >= s for f, s in zip(fast[:-1], slow[:-1], strict=True)) >= 0.9 * (len(fast) - 1), (fast, slow)
    for record, steps in zip(records, zip(fast, slow, strict=True), strict=True):
        rows = record["replicas"]
        assert [m["replica"] for m in rows] == [0, 1] and all(m["participated"] for m in rows), record
        assert [m["steps"] for m in rows] == list(steps), record
        expected = [s / max(steps) for s in steps]  # tokens = steps x group x TOKENS_PER_STEP on both replicas
        assert [m["tokens"] for m in rows] == [s * group * TOKENS_PER_STEP for s in steps], record
        assert [m["weight"] for m in rows] == pytest.approx(expected, abs=1e-6), record
    # Time inside syncs: the exchange, the time-budget agreement, the contribution checks' table, and the slow
    # replica's arrival, up to one of its steps late. Replicas of two processes put 4 processes on the 2 cores and
    # replica 1's two share a quarter of one: its steps are about twice as long against the same 0.5 s budget
    # (measured: up to 30% of the training time inside syncs there, under 20% with replicas of one process). Two
    # fragments sync twice as often against the same arrival spread (measured on a loaded 2-core machine: 35%).
    share = 0.4 if group == 2 or sync.get("num_fragments", 1) > 1 else 0.3
    for r, rank in enumerate(ranks):
        waited = sum(rank["sync_seconds"])
        assert waited <= share * rank["train_seconds"], (r, waited, rank["train_seconds"])
    # Both arrive when their budget is spent: neither waited for the other longer than a step of the slow one (the
    # budget is checked after each step) plus scheduling. The last sync comes when replica 0 reaches max_steps: its
    # budget was sized from replica 0's pace to end then (TimeBudget.size_last), so replica 0 waits there for
    # less than half a budget (with the usual budget it waited for the rest of replica 1's, up to a whole one).
    slow_step = ranks[group]["train_seconds"] / max(1, sum(slow))
    assert all(m["waited_seconds"] <= 2 * slow_step + 0.1 for r in records[:-1] for m in r["replicas"]), \
        ([[m["waited_seconds"] for m in r["replicas"]] for r in records], slow_step)
    if group == 1:
        # Replicas of two processes put four on the 2 cores: their steps' times vary too much near the end for the
        # forecast (on a loaded 2-core machine replica 0 took 1 to 4 steps a budget over the last syncs, and no
        # forecast fitted 1.5 budgets before it reached max_steps, so the usual budget stood).
        assert any("last_budget_seconds" in r for r in records[-3:]), records[-3:]
        assert records[-1]["replicas"][0]["waited_seconds"] < 0.5 * ROUND_SECONDS / fragments, records[-1]
    steps = [r["step"] for r in records]
    assert steps == sorted(steps) and len(set(steps)) == len(steps), "every sync at a later agreed step"


def test_time_budget_syncs_overlap_with_each_replicas_own_steps_under_sync_delay_auto(two):
    """Two fragments in int4 + error feedback, streamed with `sync_delay: auto`, replica 1 under the quota: each
    fragment's sync is launched when the budget is spent, agreed on in its background thread, and lands τ of the
    replica's own steps later, τ chosen from its own seconds per step (replica 0's choice is made from its step
    time, under half of replica 1's), so neither replica spends more than 20% of its training time inside syncs.
    Where a round checkpoint falls (save_every_rounds 1, the default: every second sync) the sync overlaps all the
    same: every replica lands it after exactly τ of its own steps, so all continue at one step and save there with
    nothing in flight (each checkpoint holds the parameters replica 0 held right after that sync). Only the last
    sync, at max_steps, is blocking; it carries both fragments, and the replicas end identical. Every step a replica
    took is in exactly one sync's count; every replica continues at the furthest one's step plus the steps it took
    while the sync was in flight; the weights are each replica's tokens over the most."""
    folder, (fast, slow) = two["overlap"]
    records = read_syncs(folder / "run")
    assert len(records) >= 4, records
    assert [r["fragments"] for r in records] == [[n % 2] for n in range(len(records) - 1)] + [[0, 1]], records
    assert [r["sync"] for r in records] == list(range(1, len(records) + 1))
    assert records[-1]["step"] == MAX_STEPS and "launch_step" not in records[-1]
    assert fast["digests"][-1] == slow["digests"][-1], "identical parameters at the end"
    overlapped = [r for r in records if "launch_step" in r]
    assert overlapped == records[:-1], [(r["sync"], r.get("launch_step"), r["step"]) for r in records]
    saved = {int(c.name.split("-")[1]): c for c in (folder / "run").glob("checkpoint-*")}
    rounds = [r for r in records[:-1] if r["sync"] % 2 == 0]
    assert records[-1]["step"] in saved and rounds, (sorted(saved), [r["step"] for r in rounds])
    after_sync = dict(fast["digests"])  # (step, digest of replica 0's parameters right after its sync there)
    for r in rounds:  # (save_total_limit keeps the newest: check the ones still there, at least one)
        if r["step"] in saved:
            model = AutoModelForCausalLM.from_pretrained(saved[r["step"]], dtype=torch.float32)
            assert digest(model) == after_sync[r["step"]], f"checkpoint-{r['step']} is not the state after its sync"
    assert any(r["step"] in saved for r in rounds), (sorted(saved), [r["step"] for r in rounds])
    # Landed after τ >= 1 of replica 0's own steps, beyond the step both continued at.
    assert all(r["step"] > r["launch_step"] for r in overlapped)
    chosen = [r["sync_delay_auto"] for r in records if "sync_delay_auto" in r]
    slow_step = slow["train_seconds"] / max(1, slow["own_steps"])
    assert chosen and all(c["step_seconds"] < slow_step / 2 for c in chosen), (chosen, slow_step)
    for r in records:
        rows = r["replicas"]
        most = max(m["tokens"] for m in rows)
        assert [m["tokens"] for m in rows] == [TOKENS_PER_STEP * m["steps"] for m in rows], rows
        assert [m["weight"] for m in rows] == pytest.approx([m["tokens"] / most for m in rows], abs=1e-6)
    counted = [sum(m["steps"] for r in records for m in r["replicas"] if m["replica"] == k) for k in (0, 1)]
    assert counted == [fast["own_steps"], slow["own_steps"]], (counted, fast["own_steps"], slow["own_steps"])
    assert counted[0] > 1.5 * counted[1]
    for rank in (fast, slow):
        assert sum(rank["sync_seconds"]) <= 0.2 * rank["train_seconds"], (rank["sync_seconds"], rank["train_seconds"])



def test_a_link_too_slow_for_the_time_budget_stretches_it_and_nobody_waits(two):
    """A link too slow for the budget: every all-reduce across replicas first waits SLOW_LINK s, so a sync's
    exchange takes longer than the steps of a SHORT_BUDGET s budget can cover (a ring all-reduce runs at its
    slowest link for everyone). With `sync_delay: auto` the first exchange is still running when the next budget
    is spent: the next sync waits for it to land while the replicas train on (an overlapped sync lands once its
    exchange is done), so it keeps replica 0 under an eighth of SLOW_LINK (landing it when the next sync came due
    waited for the rest of the exchange, 0.24 s measured); once one has been measured and agreed, the budget
    stretches to the exchange plus two of the slowest replica's steps (TimeBudget.stretch), τ covers the sync's
    time in flight (the agreement, then the exchange) with a margin, and the later overlapped syncs keep replica 0
    waiting under an eighth of SLOW_LINK at the median and a quarter on average. The replicas end identical."""
    folder, (fast, slow) = two["slow-link"]
    assert fast["digests"][-1] == slow["digests"][-1], "identical parameters at the end"
    records = read_syncs(folder / "run")
    assert len(records) >= 8, records
    # The first sync's exchange outlasted the budget: the replica trained on through it, past the next budget
    assert records[0]["sync_seconds"] >= SLOW_LINK and "launch_step" in records[0], records[0]
    assert records[0]["blocked_seconds"] < SLOW_LINK / 8, records[0]
    choices = [(r["sync"], r["sync_delay_auto"]) for r in records if "sync_delay_auto" in r]
    stretched = [(n, c) for n, c in choices if c["budget_seconds"] > SHORT_BUDGET]
    assert stretched and stretched[0][0] <= 3, choices
    for _, choice in stretched:  # the budget holds the time in flight (with its margin) and more
        assert choice["budget_seconds"] > choice["exchange_seconds"] >= SLOW_LINK, choices
    settled = [r for r in records[:-1] if r["sync"] > stretched[0][0] + 1 and "launch_step" in r]
    assert len(settled) >= 3, records
    blocked = sorted(r["blocked_seconds"] for r in settled)
    assert blocked[len(blocked) // 2] <= SLOW_LINK / 8 and sum(blocked) / len(blocked) <= SLOW_LINK / 4, settled


def test_with_rounds_of_h_steps_the_record_says_how_long_the_fast_replica_waited_for_the_slow_one(two):
    """Without a time budget both replicas take H steps a round, and replica 0 waits at every sync for replica 1
    (a quarter of a core). Each record's replica rows say how long before the last replica each arrived
    (`waited_seconds`); checked against what each process measured itself: both leave the sync together, so
    replica 0's seconds inside the sync exceed replica 1's by its wait (up to the outer step and a quota period of
    replica 1's)."""
    folder, (fast, slow) = two["rounds-of-h"]
    records = read_syncs(folder / "run")
    assert len(records) == len(fast["sync_seconds"]) == len(slow["sync_seconds"]) == 10, records
    waits = [[m["waited_seconds"] for m in r["replicas"]] for r in records]
    for (fast_waited, slow_waited), inside_fast, inside_slow in zip(waits, fast["sync_seconds"],
                                                                    slow["sync_seconds"], strict=True):
        assert slow_waited == 0.0, waits
        assert fast_waited == pytest.approx(inside_fast - inside_slow, abs=0.1 + 0.1 * fast_waited), \
            (waits, fast["sync_seconds"], slow["sync_seconds"])
    assert sum(w for w, _ in waits) >= 0.4 * fast["train_seconds"], (waits, fast["train_seconds"])


def test_a_time_budget_run_resumes_from_its_round_checkpoint_and_numbers_its_syncs_on(tmp_path):
    """A time-budget run (no quota: two replicas at about the same speed, sync_delay unset: overlapped) saves a
    checkpoint at every sync, each landed together at one step, every sync but the last overlapped; resumed
    from its first one it continues the sync count the checkpoint holds, every replica at the checkpoint's step, and
    ends at max_steps. What is exact: the step, the sync numbering and the schedule. How many steps each replica
    takes before a sync follows its clock, so the parameters are not compared with the uninterrupted run's (given
    the same per-replica steps the merge is the same; tests/test_distributed.py checks the merge's arithmetic)."""
    common = ["--max_steps", "60", "--round_seconds", "0.4", "--block_size", "64", "--per_device_train_batch_size",
              "4", "--eval_strategy", "no", "--eval_on_start", "false", "--save_total_limit", "50",
              "--disable_tqdm", "true", "--report_to", "none"]
    full = tmp_path / "full"
    train_cli("--output_dir", str(full), *common)
    records = read_syncs(full)
    checkpoints = sorted(full.glob("checkpoint-*"), key=lambda c: int(c.name.split("-")[1]))
    assert [int(c.name.split("-")[1]) for c in checkpoints] == [r["step"] for r in records], "a save every sync"
    assert all("launch_step" in r for r in records[:-1]), "time budgets overlap by default, saves included"
    first = checkpoints[0]
    state = torch.load(first / "process-1" / "diloco_replica.pt", weights_only=True)
    assert state["backend"] == {"syncs": 1}
    resumed = tmp_path / "resumed"
    train_cli("--output_dir", str(resumed), "--resume_from_checkpoint", str(first), *common)
    again = read_syncs(resumed)
    assert again[0]["sync"] == 2 and again[0]["step"] > records[0]["step"], again[0]
    assert [r["sync"] for r in again] == list(range(2, len(again) + 2))
    assert again[-1]["step"] == 60 and again[0]["resumed_from"] == str(first)
