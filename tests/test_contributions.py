"""Contribution checks (hf_diloco.contributions): the rules against tables built by hand and an independent
computation, then real runs on both backends where one replica goes wrong the way a user's site would.

The real runs share one setting (the tiny-llama recipe, block 32, batch 4, H = 10, 200 steps: 20 syncs, one held-out
evaluation at the end) and the built-in corpus written out as JSON lines, so that a corrupted copy can be handed to
one replica. "The run without that replica" is the same launch in which every replica's checks leave that replica
out from the first sync (the test hook in tests/scripts/contribution_hook), or on torchft the other two sites alone:
the healthy replicas read the same shards in both.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    ACCELERATE_CPU_4PROC,
    REPO,
    accelerate_launch,
    cli,
    corrupted_corpora,
    env,
    lighthouse,
    replica_training_pid,
    train_runs,
    wait_for,
)

from hf_diloco.contributions import ContributionChecks, Limits, judge, leave_one_out
from hf_diloco.metrics import read_syncs

HOOK = REPO / "tests" / "scripts" / "contribution_hook"
RUN_MARK = "=== run {} ==="  # what tests/scripts/train_runs.py prints before each run
SETTINGS = ["--max_steps", "200", "--inner_steps", "10", "--block_size", "32", "--per_device_train_batch_size", "4",
            "--eval_strategy", "steps", "--eval_steps", "200", "--disable_tqdm", "true", "--report_to", "none"]


# --- the rules ------------------------------------------------------------------------------------------------------


def test_leave_one_out_agreement_matches_the_vectors_it_comes_from():
    """λ_i from (W, w_i, Δ_i·Δ, ‖Δ_i‖², ‖Δ‖²) against cos(Δ_i, Σ_{j≠i} w_j Δ_j) formed from the vectors, for weights
    of 1, unequal weights and a replica of weight 0 (left out: its agreement with the average of the others)."""
    generator = torch.Generator().manual_seed(3)
    deltas = [torch.randn(200, generator=generator, dtype=torch.float64) for _ in range(4)]
    deltas[1] += deltas[0]  # some agreement, some not
    for weights in ([1.0, 1.0, 1.0, 1.0], [1.0, 0.4, 0.7, 0.2], [1.0, 0.0, 0.5, 1.0]):
        total = sum(weights)
        average = sum(w * d for w, d in zip(weights, deltas, strict=True)) / total
        for i, (w, d) in enumerate(zip(weights, deltas, strict=True)):
            others = sum(weights[j] * deltas[j] for j in range(4) if j != i)
            want = float(d @ others / (d.norm() * others.norm()))
            got = leave_one_out(total, w, dot=float(d @ average), norm_sq=float(d @ d),
                                average_norm_sq=float(average @ average))
            assert got == pytest.approx(want, abs=1e-9), (weights, i)


@pytest.mark.process
def test_with_a_codec_the_agreement_is_measured_on_what_the_others_decoded(tmp_path):
    """Four processes (tests/scripts/decoded_agreement.py): 4 replicas of one process and 2 replicas of 2, sparse and
    int4 with error feedback, unequal weights, 4 syncs. λ_i as the round engine forms it from the exchange's scalar
    terms matches cos(D_i, W·Δ − D_i) formed from the vectors (D_i taken from the error-feedback residuals, gathered
    whole) to 1e-4. Measured on Δ_i as trained instead, the sparse codec's unsent part would count as the others'
    and point against Δ_i: a clean replica's agreement falls below the `opposed` threshold."""
    result = accelerate_launch([str(REPO / "tests" / "scripts" / "decoded_agreement.py"), str(tmp_path)],
                               config=ACCELERATE_CPU_4PROC)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"decoded{r}.json").read_text()) for r in range(4)]
    assert set(ranks[0]) == {"g=1 sparse", "g=1 int4", "g=2 sparse", "g=2 int4"}
    for rank in ranks:
        for setting, syncs in rank.items():
            assert len(syncs) == 4
            for sync in syncs:
                assert sync["from_terms"] == pytest.approx(sync["from_vectors"], abs=1e-4), (setting, sync)
                assert sync["from_vectors"] > 0.15, (setting, sync)  # the made-up Δ_i share a part
    trained = [sync["before_codec"] for rank in ranks for sync in rank["g=1 sparse"]]
    assert min(trained) < Limits().min_agreement, trained


def rows(*replicas: tuple) -> dict[int, list[float]]:
    """Check rows from (norm, η over one step, λ last, λ before, left out of the last sync): NaN for a λ not given,
    0 for the last; no loss gain; the replica's base learning rate its η."""
    table = {}
    for r, values in enumerate(replicas):
        padded = [*values[:4], *[float("nan")] * (4 - len(values[:4]))]
        table[r] = [float(padded[0]), 1.0, *map(float, padded[1:])] + [float(values[4]) if len(values) > 4 else 0.0,
                                                                      float("nan"), float(padded[1])]
    return table


def test_each_rule_leaves_out_the_replica_it_is_about_and_no_other():
    limits = Limits()
    p = 10_000  # √P = 100; Ση = 0.01: AdamW steps make a norm of about 1 at most
    # size: 30x what AdamW can make at the agreed rate, at M = 2 as well (the smaller of two rates is agreed)
    assert list(judge(rows((0.4, 0.01), (30.0, 1.0)), p, adam=True, limits=limits)) == [1]
    assert judge(rows((0.4, 0.01), (30.0, 1.0)), p, adam=True, limits=limits)[1].startswith("size: ")
    assert judge(rows((0.4, 0.01), (30.0, 1.0)), p, adam=False, limits=limits) == {}, "size is for AdamW only"
    nan = float("nan")
    unequal = {0: [0.3, 3.0, 0.01, nan, nan, 0.0, nan, 0.01], 1: [9.0, 10.0, 0.01, nan, nan, 0.0, nan, 0.01]}
    assert judge(unequal, p, adam=True, limits=limits) == {}, "bounded by each replica's own steps (time budgets)"
    assert judge(rows((30.0, 0.01), (31.0, 0.01)), p, adam=True, limits=limits) == {}, \
        "every replica beyond it: the run's own rate is too high, nobody is told apart"
    # outlier: needs three replicas reporting; a NaN norm (a joining or diverged replica) does not report
    three = rows((1.0, 0.01), (1.2, 0.01), (2.9, 0.01))
    assert list(judge(three, p, adam=False, limits=limits)) == [2]
    assert judge(rows((1.0, 0.01), (2.9, 0.01)), p, adam=False, limits=limits) == {}
    assert judge(rows((1.0, 0.01), (float("nan"), 0.01), (2.9, 0.01)), p, adam=False, limits=limits) == {}
    assert judge(rows((1.0, 0.01), (1.2, 0.01), (2.2, 0.01)), p, adam=False, limits=limits) == {}, "under 2.3x"
    # opposed: λ below -0.3 in the last sync, at M >= 3 only (at M = 2 both replicas have the same λ)
    opposed = judge(rows((1, .01, .6, .6), (1, .01, -.5, .6), (1, .01, .5, .5)), p, adam=False, limits=limits)
    assert list(opposed) == [1] and opposed[1].startswith("opposed: ")
    assert judge(rows((1, .01, -.5, .6), (1, .01, -.5, .6)), p, adam=False, limits=limits) == {}
    # apart: a gap above 0.35 to the others' median in each of the last two syncs; once is not enough, unless the
    # replica was left out of its last sync (it is taken back after two syncs that agree)
    twice = rows((1, .01, .6, .6), (1, .01, .7, .5), (1, .01, .1, .1))
    assert list(judge(twice, p, adam=False, limits=limits)) == [2]
    once = rows((1, .01, .6, .6), (1, .01, .7, .5), (1, .01, .1, .5))
    assert judge(once, p, adam=False, limits=limits) == {}
    kept_out = rows((1, .01, .6, .6), (1, .01, .7, .5), (1, .01, .6, .1, 1))
    assert list(judge(kept_out, p, adam=False, limits=limits)) == [2]
    # loss (contribution_loss_check): its round raised the held-out loss by more than the margin below min(0, median
    # gain); works at M = 2, where the other replica's gain sets the median
    def gains(*values: float) -> dict[int, list[float]]:
        return {r: [1.0, 10.0, 0.01, *[float("nan")] * 2, 0.0, g] for r, g in enumerate(values)}

    assert list(judge(gains(0.3, -1.0), p, adam=False, limits=limits)) == [1]
    assert judge(gains(0.3, -1.0), p, adam=False, limits=limits)[1].startswith("loss: its round raised the held-out "
                                                                               "batch's loss by 1.000")
    assert judge(gains(-0.5, -0.54), p, adam=False, limits=limits) == {}, "both worse alike: the run's own doing"
    assert judge(gains(0.3, -0.04), p, adam=False, limits=limits) == {}, "within the margin of no change"
    assert list(judge(gains(0.3, 0.2, -0.3), p, adam=False, limits=limits)) == [2]
    # a peer's agreement outside [-1, 1] is not judged by (nor lets it judge the others)
    assert judge(rows((1, .01, .6, .6), (1, .01, -7.0, .6), (1, .01, .5, .5)), p, adam=False, limits=limits) == {}
    # never everyone: three replicas all opposed to each other tell nothing apart
    assert judge(rows((1, .01, -.5), (1, .01, -.6), (1, .01, -.7)), p, adam=False, limits=limits) == {}


def test_the_size_rule_bounds_the_steps_each_pseudo_gradient_covers_and_judges_a_lone_contribution():
    """The sites of a real run come and go (issue: a lone wrong site moved the shared model; an honest site that
    missed a sync was left out). Rows as CHECK_FIELDS: norm, steps, mean η over them, λ, λ before, left out, loss
    gain, base learning rate. P = 10,000 (√P = 100)."""
    limits, p, nan = Limits(), 10_000, float("nan")
    joined = ContributionChecks("exclude", limits, faulty_after=3, base_lr=1e-3).presence_row()
    # A lone contribution at 100x the learning rate, with a site that joined with no steps given the recipe's: left
    # out, although it is every contribution there is (the sync then moves nothing: its total weight is 0).
    wrong = [5.0, 10.0, 0.0275, nan, nan, 0.0, nan, 0.1]  # 10 warm-up steps at 100x: Σ η 0.275
    verdict = judge({1: joined, 2: wrong}, p, adam=True, limits=limits)
    assert list(verdict) == [2] and verdict[2].startswith("size: ") and "(it was given 0.1)" in verdict[2], verdict
    # Σ η at the agreed 1e-3 is 0.00275 over those steps: 5 / (100 · 0.00275) = 18x
    assert "is 18.2x what its 10 inner steps can make at the agreed learning rate 0.001" in verdict[2], verdict
    right = [0.05, 10.0, 0.000275, nan, nan, 0.0, nan, 1e-3]
    assert judge({1: joined, 2: right}, p, adam=True, limits=limits) == {}, "the same site at the recipe's rate"
    assert judge({2: wrong}, p, adam=True, limits=limits) == {}, "truly alone: nothing to tell it from"
    broken = [nan, 0.0, nan, nan, nan, 0.0, nan, float("inf")]  # a peer's base rate that is no number to agree on
    assert list(judge({1: joined, 2: wrong, 3: broken}, p, adam=True, limits=limits)) == [2]
    # A majority given the recipe's rate outvotes one given another, whoever brings steps.
    assert list(judge({0: joined, 1: joined, 2: wrong}, p, adam=True, limits=limits)) == [2]
    # A site that missed a sync late in a decaying schedule: its Δ covers 20 steps at their own (higher) rates.
    # Bounded by exactly those (Σ η 6e-4: 0.1 is 1.7x), not by 20 steps at the others' mean rate of their last 10
    # (1e-5: 5x).
    late = {0: [0.1, 20.0, 3e-5, nan, nan, 0.0, nan, 1e-3], 1: [0.015, 10.0, 1e-5, nan, nan, 0.0, nan, 1e-3],
            2: [0.016, 10.0, 1e-5, nan, nan, 0.0, nan, 1e-3]}
    assert judge(late, p, adam=True, limits=limits) == {}
    # Every contribution beyond the bound, each given the agreed rate: the run's own rate is too high, none is out.
    high = {0: [9.0, 10.0, 1e-3, nan, nan, 0.0, nan, 1e-3], 1: [8.0, 10.0, 1e-3, nan, nan, 0.0, nan, 1e-3]}
    assert judge(high, p, adam=True, limits=limits) == {}


def test_a_restarted_replicas_fresh_optimizer_is_not_an_outlier_among_older_ones():
    """A replica started again heals and brings its first H steps taken by a fresh AdamW (moments from zero: steps
    of about η per value), 2.3x and more the median norm of replicas whose optimizers are 64 steps old (seen in a
    real torchft run: an honest restarted replica left out as an outlier). Its optimizer's age (CHECK_FIELDS'
    last) sets it apart from `outlier` and from the others' median; the same norm from a replica whose optimizer is
    as old as the others' is still left out, and at a run's start, where every optimizer is as young as its steps,
    the rule judges as before. `size` still bounds a fresh one."""
    limits, p, nan = Limits(), 10_000, float("nan")

    def row(norm, age, steps=4.0):
        return [norm, steps, 1e-3, nan, nan, 0.0, nan, 1e-3, age]

    restarted = {0: row(0.10, 68.0), 1: row(0.11, 68.0), 2: row(0.26, 4.0)}
    assert judge(restarted, p, adam=True, limits=limits) == {}
    older = {**restarted, 2: row(0.26, 68.0)}
    assert list(judge(older, p, adam=True, limits=limits)) == [2] and \
        judge(older, p, adam=True, limits=limits)[2].startswith("outlier: ")
    start = {0: row(0.10, 4.0), 1: row(0.11, 4.0), 2: row(0.9, 4.0)}
    assert list(judge(start, p, adam=True, limits=limits)) == [2], "at the start every optimizer is young"
    # 5 / (√P · Σ η = 100 · 0.004) = 12.5x the size bound: fresh or not, it is left out
    too_big = {**restarted, 2: row(5.0, 4.0)}
    assert judge(too_big, p, adam=True, limits=limits)[2].startswith("size: ")
    # The age is the replica's own word: it counts only with a new process's row (no λ from a last sync), and a
    # negative one not at all.
    claims = {**restarted, 2: [0.26, 4.0, 1e-3, 0.5, 0.5, 0.0, nan, 1e-3, 4.0]}
    assert list(judge(claims, p, adam=True, limits=limits)) == [2]
    assert list(judge({**restarted, 2: row(0.26, -1.0)}, p, adam=True, limits=limits)) == [2]
    # A row of an earlier version, without the age, is judged as before.
    assert list(judge({r: v[:8] for r, v in older.items()}, p, adam=True, limits=limits)) == [2]


def test_the_steps_rule_checks_each_replicas_steps_against_the_examples_they_trained_on():
    """A replica's steps set its size bound (Σ η over them): a step counter that counts micro-batches (4 per step
    here) would loosen it 4x. Its rows give away the miscount, from its own numbers alone, at any M and for a lone
    contribution beside a replica that joined: 40 steps of a batch of 4 cannot have trained on 40 examples (25% of
    their batches; only an epoch's last batch is short). Steps too few for the examples are left out as well; an
    epoch's short last batch, a row of an earlier version and a replica that cannot count its rows (NaN, a
    preference pair's inputs) are not."""
    limits, p, nan = Limits(), 10_000, float("nan")

    def row(steps: float, examples: float, batch: float = 4.0) -> list[float]:  # a norm in line with its steps
        return [0.005 * steps, steps, 1e-3, nan, nan, 0.0, nan, 1e-3, nan, examples, batch]

    miscounted = judge({0: row(10, 40), 1: row(40, 40)}, p, adam=True, limits=limits)
    assert list(miscounted) == [1] and miscounted[1] == (
        "steps: it reports 40 steps, but its 40 examples fill 25% of that many batches of 4 (only an epoch's last "
        "batch is short; the check leaves out below 50%): are its steps counted once per optimizer step?")
    joined = ContributionChecks("exclude", limits, faulty_after=3, base_lr=1e-3).presence_row()
    assert list(judge({0: joined, 1: row(40, 40)}, p, adam=False, limits=limits)) == [], \
        "never every contribution: a lone one is not left out by a rule on its own numbers"
    three = judge({0: row(10, 40), 1: row(10, 38), 2: row(10, 41)}, p, adam=False, limits=limits)
    assert list(three) == [2] and three[2].startswith("steps: its 41 examples take at least 11 steps of its batch")
    short_last = {0: row(10, 40), 1: row(10, 37), 2: row(2, 5)}  # 2 steps: 4 examples, then an epoch's last 1
    assert judge(short_last, p, adam=False, limits=limits) == {}
    assert judge({0: row(10, 40), 1: row(40, 40)[:9]}, p, adam=False, limits=limits) == {}, "an older row"
    assert judge({0: row(10, 40), 1: row(40, nan)}, p, adam=False, limits=limits) == {}, "rows it cannot count"


def test_a_fragment_counts_the_examples_since_its_base_across_a_missed_sync_and_keeps_alphas_share():
    """since_base: the steps, Σ η and examples of the sync launched last, plus whatever a sync that did not carry
    the fragment (or rolled back) left; α of them stay after a sync that carried it."""
    from types import SimpleNamespace

    import torch.nn as nn

    from hf_diloco.fragments import Fragment, since_base
    from hf_diloco.outer import OuterState

    fragment = Fragment(0, [0], OuterState([nn.Parameter(torch.zeros(1))], lr=0.7, momentum=0.9, nesterov=True))
    fragment.launched(10, SimpleNamespace(steps=10, lr_sum=0.01, examples=40), carried=True)
    fragment.decided(10, synced=False, alpha=0.0)  # rolled back: those steps stay in its Δ_i
    fragment.launched(20, SimpleNamespace(steps=10, lr_sum=0.02, examples=37), carried=True)
    assert since_base([fragment], [0]) == (20, 0.03, 77)
    fragment.decided(20, synced=True, alpha=0.5)
    fragment.launched(30, SimpleNamespace(steps=10, lr_sum=0.01, examples=40), carried=True)
    assert since_base([fragment], [0]) == pytest.approx((20, 0.025, 78.5))


def test_a_sync_whose_every_contribution_is_left_out_does_not_move_theta_global():
    """Weights all 0 (every contribution left out): θ_global and the outer momentum stay as they were, with outer
    Nesterov momentum already built up, and the replica takes θ_global."""
    import torch.nn as nn

    from hf_diloco.comm import ReplicaComm
    from hf_diloco.fragments import fragments_of, outer_round
    from hf_diloco.outer import OuterState

    replica = [nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))]
    outer = OuterState(replica, lr=0.7, momentum=0.9, nesterov=True)
    comm = ReplicaComm()
    with torch.no_grad():
        replica[0].sub_(0.5)
    outer_round(fragments_of(outer), comm)  # a first sync that counts: momentum now holds its Δ
    before = [t.clone() for t in outer.global_params]
    momentum = outer.optimizer.state[outer.global_params[0]]["momentum_buffer"].clone()
    with torch.no_grad():
        replica[0].add_(10.0)  # a contribution that will be left out
    result = outer_round(fragments_of(outer), comm, weight=0.0)
    assert result.participants == 0
    assert torch.equal(outer.global_params[0], before[0])
    assert torch.equal(outer.optimizer.state[outer.global_params[0]]["momentum_buffer"], momentum)
    assert torch.equal(replica[0].detach(), before[0]), "the replica takes θ_global"


def test_a_verdict_goes_into_the_record_and_a_replica_left_out_three_times_is_called_faulty():
    checks = ContributionChecks("exclude", Limits(), faulty_after=3)
    lines = []
    for sync in (1, 2, 3, 4):
        record = {"sync": sync, "replicas": [{"replica": r, "participated": True, "weight": 1.0} for r in range(3)],
                  "non_finite_replicas": [2], "participants": 2}
        lines += checks.record({2: "outlier: too large"}, record)
        assert record["excluded"] == [{"replica": 2, "reason": "outlier: too large"}]
        assert record["replicas"][2] == {"replica": 2, "participated": False, "weight": 0.0,
                                        "excluded": "outlier: too large"}
        assert "non_finite_replicas" not in record, "left out by a check, not for a NaN"
    assert len(lines) == 1 and lines[0].startswith("[diloco] replica 2 looks faulty: its contribution was left out "
                                                   "of 3 syncs in a row (outlier: too large)")
    warned = ContributionChecks("warn", Limits(), faulty_after=3)
    record = {"sync": 5, "replicas": [{"replica": 0, "participated": True, "weight": 1.0}]}
    assert warned.record({0: "size: too large"}, record) == ["[diloco] sync 5: replica 0 would be left out "
                                                              "(size: too large)"]
    assert record["excluded"] == [] and record["flagged"] == [{"replica": 0, "reason": "size: too large"}]
    assert record["replicas"][0]["participated"] is True


# --- real runs ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, Path]:
    return corrupted_corpora(tmp_path_factory.mktemp("corpora"))


def torch_launches(folder: Path, data: dict[str, Path], runs: dict[str, tuple[str, dict, list[str]]],
                   replicas: int = 3) -> dict[str, Path]:
    """`replicas` on the torch backend, each reading its own slice (non_iid), training each of `runs` (name →
    corpus, test hook settings, flags) in turn, as `hf-diloco train` does, in one `accelerate launch`
    (tests/scripts/train_runs.py: the start-up of the processes is paid once; the launch's own checks are
    tests/test_launch_checks.py's). Returns name → the run's folder, with its share of the console in console.log."""
    payload = [{"name": name, "recipe": "recipes/tiny-pretrain.yaml", "env": hook,
                "args": [*SETTINGS, "--output_dir", str(folder / name), "--eval_on_start", "false",
                         "--save_every_rounds", "0", "--data_sharding", "non_iid", "--dataset_name", str(data[corpus]),
                         *extra]}
               for name, (corpus, hook, extra) in runs.items()]
    result = train_runs(payload, ACCELERATE_CPU_4PROC, processes=replicas, environ={"PYTHONPATH": str(HOOK)})
    console = result.stdout + result.stderr
    for name in runs:
        mark = RUN_MARK.format(name)
        (folder / name / "console.log").write_text(
            "".join(part.split("=== run ")[0] for part in console.split(mark + "\n")[1:]))
    return {name: folder / name for name in runs}


SHORT = ["--max_steps", "80", "--eval_steps", "80"]  # 8 syncs: enough for a fault found out from the first or second
# The faulty and clean runs of three replicas on the torch backend, trained by one launch (name → corpus, hook,
# flags): the tests below read their records.
THREE_REPLICAS = {
    "garbage": ("garbage", {}, []),
    "without": ("garbage", {"CONTRIBUTION_HOOK_LEAVE_OUT": "0"}, []),
    "sparse-garbage": ("garbage", {}, ["--compression", "sparse", "--error_feedback", "true", "--sync_delay", "1"]),
    "scaled": ("clean", {"CONTRIBUTION_HOOK_SCALE": "3", "CONTRIBUTION_HOOK_RANK": "1"}, SHORT),
    "flipped": ("clean", {"CONTRIBUTION_HOOK_SCALE": "-1", "CONTRIBUTION_HOOK_RANK": "1"},
                [*SHORT, "--contribution_checks", "warn"]),
    "miscounted": ("clean", {"CONTRIBUTION_HOOK_STEPS": "4", "CONTRIBUTION_HOOK_RANK": "2"}, SHORT),
    "clean-40-rounds": ("clean", {}, ["--max_steps", "200", "--inner_steps", "5", "--eval_steps", "200"]),
}


@pytest.fixture(scope="module")
def three_replicas(tmp_path_factory, corpora) -> dict[str, Path]:
    return torch_launches(tmp_path_factory.mktemp("three-replicas"), corpora, THREE_REPLICAS)


def left_out(records: list[dict], key: str = "excluded") -> dict[int, list[int]]:
    """sync → the replicas the record names under `key`."""
    return {r["sync"]: [e["replica"] for e in r[key]] for r in records if r.get(key)}


def assert_found_out(records: list[dict], replica: int, by_sync: int, key: str = "excluded",
                     share: float = 2 / 3) -> None:
    """`replica` alone is named, first by `by_sync`, then in at least `share` of the syncs after it."""
    named = left_out(records, key)
    assert all(who == [replica] for who in named.values()), named
    assert min(named, default=99) <= by_sync, named
    after = [r["sync"] for r in records if r["sync"] >= by_sync]
    assert sum(s in named for s in after) >= share * len(after), named


def final_eval(records: list[dict], steps: int = 200) -> float:
    assert records[-1]["step"] == steps and records[-1].get("eval_loss") is not None
    return records[-1]["eval_loss"]


@pytest.mark.process
def test_torch_backend_a_garbage_shard_is_left_out_and_the_run_ends_as_without_it(three_replicas):
    """Replica 0 reads random characters (its third of a local dataset is garbage): from its third sync on it is
    left out (its agreement with the others is far below theirs), the records say why, and the run's held-out loss
    ends no more than 2% above the same launch with replica 0 left out from the first sync."""
    faulty, without = read_syncs(three_replicas["garbage"]), read_syncs(three_replicas["without"])
    assert_found_out(faulty, 0, by_sync=4)
    reasons = {e["reason"].split(":")[0] for r in faulty for e in r["excluded"]}
    assert reasons <= {"apart", "opposed", "outlier"} and "apart" in reasons, reasons
    first = next(r for r in faulty if r["excluded"])
    assert [m["participated"] for m in first["replicas"]] == [False, True, True]
    assert first["replicas"][0]["excluded"] == first["excluded"][0]["reason"]
    assert sum(len(r["excluded"]) for r in faulty) == json.loads(
        (three_replicas["garbage"] / "diloco_summary.json").read_text())["contributions_excluded"]
    assert final_eval(faulty) <= 1.02 * final_eval(without), (final_eval(faulty), final_eval(without))
    console = (three_replicas["garbage"] / "console.log").read_text()
    assert "left out: replica 0 (apart)" in console and "[diloco] replica 0 looks faulty" in console


@pytest.mark.process
def test_with_a_sparse_codec_and_an_overlapped_sync_a_garbage_shard_is_left_out_as_well(three_replicas):
    """The garbage shard again, sent through the sparse codec (64 of every 4096 values, error feedback) with the
    exchange overlapped one step (sync_delay 1). The agreement is measured on the decoded values, about a fifth of
    the full Δ_i's for every replica, and the `apart` gap scales down with it: over 20 syncs replica 0 is left out by
    its fourth and in more than half of those after (13 of 20 in docs/guides/contributions.md's run; the rate differs
    with the machine's floating point). Left out of an overlapped sync it keeps its Δ_i unsent, so its agreement is
    still measured and it stays out. (Its held-out loss against the run without it, docs/guides/contributions.md: 3.1027
    against 3.0572.)"""
    faulty = read_syncs(three_replicas["sparse-garbage"])
    assert len(faulty) == 20
    assert_found_out(faulty, 0, by_sync=4, share=0.55)
    assert "apart" in {e["reason"].split(":")[0] for r in faulty for e in r["excluded"]}
    assert all(r["compression"] == "sparse+ef" and r.get("launch_step", r["step"]) == r["step"] - 1 for r in faulty)


@pytest.mark.process
def test_torch_backend_a_scaled_pseudo_gradient_is_left_out_and_a_sign_flip_flagged_in_warn_mode(three_replicas):
    """At M = 3, replica 1 sends 3 Δ_1 (a test hook): left out from the first sync, as an outlier. Replica 1 sends
    −Δ_1 with contribution_checks warn: flagged from its second sync on (its agreement in the first is negative),
    named on the console, and still merged (every replica's weight stays 1)."""
    scaled = read_syncs(three_replicas["scaled"])
    assert_found_out(scaled, 1, by_sync=1)
    assert scaled[0]["excluded"][0]["reason"].startswith("outlier: ")
    flipped = read_syncs(three_replicas["flipped"])
    assert_found_out(flipped, 1, by_sync=2, key="flagged")
    assert all(r["excluded"] == [] and all(m["weight"] == 1.0 for m in r["replicas"]) for r in flipped)
    assert "opposed" in flipped[1]["flagged"][0]["reason"]
    assert "sync 2: replica 1 would be left out (opposed:" in (three_replicas["flipped"] / "console.log").read_text()


@pytest.mark.process
def test_torch_backend_a_replica_that_counts_micro_batches_as_steps_is_left_out(three_replicas):
    """At M = 3, replica 2 reports 4x the inner steps its pseudo-gradient covers (a test hook: a step counter that
    counts micro-batches, which would loosen its size bound 4x): left out from the first sync on by the `steps`
    rule, its rows' examples filling a quarter of the batches it claims."""
    records = read_syncs(three_replicas["miscounted"])
    assert_found_out(records, 2, by_sync=1)
    assert all(e["reason"].startswith("steps: it reports 40 steps, but its 40 examples fill 25%")
               for r in records for e in r["excluded"]), records


@pytest.mark.process
def test_a_clean_run_of_40_rounds_leaves_nothing_out(three_replicas):
    """Three replicas on their own thirds (non_iid), 40 rounds of H = 5 (200 steps, learning-rate warm-up and decay
    included): no contribution is left out or flagged, and every replica takes part in every sync."""
    records = read_syncs(three_replicas["clean-40-rounds"])
    assert len(records) == 40
    assert all(r["excluded"] == [] and "flagged" not in r for r in records)
    assert all(m["participated"] for r in records for m in r["replicas"])


@pytest.mark.process
def test_the_loss_check_names_a_garbage_shard_at_2_replicas(tmp_path, corpora):
    """At M = 2 no gradient statistic says which replica reads garbage; with contribution_loss_check the replica whose
    rounds raise the held-out batch's loss is left out (rule `loss`) from its fifth sync on, in most syncs, and the
    healthy one never. A setting the check cannot serve is refused in one sentence before anything starts."""
    loss = torch_launches(tmp_path, corpora, {"loss": ("garbage-half", {}, ["--contribution_loss_check", "true"])},
                          replicas=2)
    records = read_syncs(loss["loss"])
    assert_found_out(records, 0, by_sync=6)
    assert {e["reason"].split(":")[0] for r in records for e in r["excluded"]} == {"loss"}
    refused = cli("train", "--config", "recipes/tiny-pretrain.yaml", "--contribution_loss_check", "true",
                  "--sync_delay", "1", "--output_dir", str(tmp_path / "refused"))
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines()[-1].startswith("hf-diloco: error: contribution_loss_check scores a "
                                                                 "round against the global parameters it started from")


def start_site(out: Path, address: str, k: int, extra: list[str], hook: dict | None = None
               ) -> tuple[subprocess.Popen, Path]:
    """Site k started as docs/guides/elastic.md ("Across machines or sites") starts one: `hf-diloco launch ...
    --lighthouse URL --replica_id k --num_replicas 3 --replica_address 127.0.0.1 --max-restarts 3` (`extra`: its
    settings beyond SETTINGS; `hook`: test hook settings, tests/scripts/contribution_hook); its launch and its
    console's file."""
    log = out / f"site-{k}.log"
    hooked = {"PYTHONPATH": str(HOOK), **hook} if hook else {}
    process = subprocess.Popen(
        [sys.executable, "-m", "hf_diloco.cli", "launch", "recipes/torchft-3.yaml", "--accelerate-config",
         "accelerate_configs/torchft-replica.yaml", "--lighthouse", address, "--replica_id", str(k),
         "--num_replicas", "3", "--replica_address", "127.0.0.1", "--max-restarts", "3", "--", *SETTINGS,
         "--output_dir", str(out / f"replica-{k}"), *extra],
        cwd=REPO, env={**env(), **hooked}, stdout=log.open("w"), stderr=subprocess.STDOUT)
    return process, log


def site_step(out: Path, k: int) -> int:
    from hf_diloco.files import read_json

    return int(read_json(out / f"replica-{k}" / "progress.json", {}).get("step") or 0)


def finish_sites(sites: dict[int, tuple[subprocess.Popen, Path]]) -> dict[int, str]:
    for process, log in sites.values():
        assert process.wait(timeout=400) == 0, log.read_text()[-3000:]
    return {k: log.read_text() for k, (_, log) in sites.items()}


def merged_from(records: list[dict], replica: int) -> list[float]:
    """The weights `replica`'s contributions were merged with, in the committed syncs where it brought steps."""
    return [m["weight"] for r in records if r.get("committed", True) for m in r["replicas"]
            if m["replica"] == replica and m.get("steps", 0) > 0]


@pytest.mark.process
def test_torchft_sites_that_come_and_go_a_faulty_one_never_moves_the_model_and_clean_ones_none_is_left_out(
        tmp_path, corpora):
    """Three torchft sites against one Lighthouse, each started as docs/guides/elastic.md starts one (a round needs
    two, and waits 3 s for the third), H = 10 on a decaying schedule (warm-up 20, cosine): 100 steps with a faulty
    site, 200 without.

    Faulty: site 2 is given --learning_rate 0.1 (100x the recipe's), and its first sync carries its contribution
    alone: sites 1 and 2 start, site 1 holds after joining (a test hook) while site 2 trains its first round, then
    site 0 starts and joins site 2's first sync with no steps (site 1 is released once that sync is recorded). That
    lone contribution is left out (rule `size`, against the learning rate the site that joined was given, which
    its record names), so the sync does not move θ_global, and so is every later one: on every site's records its
    contributions are merged with weight 0, always; its launch says it looks faulty; sites 0 and 1 end with one
    model, trained (held-out loss under 4, from about 5.5).

    Clean: the three sites at the recipe's rate, and site 0 stopped (SIGSTOP) for 5 s just after its sync at step
    120, past the next sync's grace: it misses syncs late in the decaying schedule (and comes back where it can, or
    heals the final model). No site is left out or flagged in any sync of any site. (A pseudo-gradient that covers
    a missed sync's steps, bounded by their own learning rates: test_the_size_rule_bounds_the_steps_each_...)"""
    data = ["--dataset_name", str(corpora["clean"])]
    faulty, clean = tmp_path / "faulty", tmp_path / "clean"
    for out in (faulty, clean):
        out.mkdir()
    together = [*data, "--min_replicas", "2", "--sync_grace_seconds", "3"]
    release = faulty / "release-site-1"
    with lighthouse(min_replicas=2, grace=3, log=faulty / "lighthouse.log") as address:
        short = [*together, "--max_steps", "100", "--eval_steps", "100"]
        sites = {2: start_site(faulty, address, 2, [*short, "--learning_rate", "0.1"]),
                 1: start_site(faulty, address, 1, short, hook={"CONTRIBUTION_HOOK_HOLD": str(release)})}
        wait_for(lambda: site_step(faulty, 2) >= 1, 120, "site 2 training its first round")
        sites[0] = start_site(faulty, address, 0, short)
        wait_for(lambda: read_syncs(faulty / "replica-2"), 120, "site 2's first sync")
        release.touch()
        consoles = finish_sites(sites)
    with lighthouse(min_replicas=2, grace=3, log=clean / "lighthouse.log") as address:
        sites = {k: start_site(clean, address, k, together) for k in range(3)}
        # Just after its sync at step 120 is written, site 0 is a step or two into the next round.
        wait_for(lambda: any(r["step"] >= 120 for r in read_syncs(clean / "replica-0")), 300,
                 "site 0's sync at step 120", every=0.05)
        pid = replica_training_pid(clean, 0)
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(5.0)
        finally:
            os.kill(pid, signal.SIGCONT)
        finish_sites(sites)
    records = {k: [r for r in read_syncs(faulty / f"replica-{k}")] for k in range(3)}
    first = next(r for r in records[2] if r.get("committed", True) and merged_from([r], 2))
    assert [m["replica"] for m in first["replicas"] if m.get("steps", 0) > 0] == [2], "a lone contribution"
    assert [e["replica"] for e in first["excluded"]] == [2], first
    reason = first["excluded"][0]["reason"]
    assert reason.startswith("size: ") and "(it was given 0.1)" in reason, reason
    for k in range(3):
        weights = merged_from(records[k], 2)
        assert weights and set(weights) == {0.0}, (k, weights)
    assert "[diloco] replica 2 looks faulty" in consoles[2], consoles[2][-2000:]
    from safetensors.torch import load_file

    a, b = (load_file(faulty / f"replica-{k}" / "model.safetensors") for k in (0, 1))
    assert all(torch.equal(a[key], b[key]) for key in a), "sites 0 and 1 end with one model"
    ran = {k: [r for r in read_syncs(clean / f"replica-{k}") if r.get("committed", True)] for k in range(3)}
    assert all(r["excluded"] == [] and "flagged" not in r for k in ran for r in ran[k]), \
        {k: [r["excluded"] for r in ran[k] if r["excluded"]] for k in ran}
    missed = [r["step"] for r in ran[1] if r["step"] > 120
              and not any(m["replica"] == 0 and m.get("participated") for m in r["replicas"])]
    assert missed, "site 0 missed syncs after step 120"
    faulty_loss = final_eval([r for r in read_syncs(faulty / "replica-1") if r.get("committed", True)], steps=100)
    assert math.isfinite(faulty_loss) and faulty_loss < 4.0, "sites 0 and 1 trained on (the start is about 5.5)"


def test_the_checks_settings_are_refused_in_one_sentence(tmp_path):
    from hf_diloco.config import ConfigError, DiLoCoConfig

    said = {}
    for name, value in (("contribution_checks", "maybe"), ("contribution_norm_ratio", 0.5),
                        ("contribution_faulty_after", 0), ("contribution_loss_check", True)):
        with pytest.raises(ConfigError) as error:
            DiLoCoConfig(output_dir=str(tmp_path), use_cpu=True, **{name: value},
                         **({"num_fragments": 2, "inner_steps": 4} if name == "contribution_loss_check" else {}))
        said[name] = str(error.value)
    assert said["contribution_checks"] == "contribution_checks must be one of exclude, warn, off, got 'maybe'."
    assert said["contribution_norm_ratio"] == "contribution_norm_ratio must be above 1, got 0.5."
    assert said["contribution_faulty_after"] == "contribution_faulty_after must be a whole number of at least 1, got 0."
    assert said["contribution_loss_check"].startswith("contribution_loss_check scores a round against the global "
                                                      "parameters it started from, so it needs num_fragments 1")
