"""The fixed group's time-budget agreement (hf_diloco.backends.FixedGroup) with sync_delay > 0, no processes: two
replicas are two threads whose agreement all-reduce meets at a barrier (the table summed from both rows), so a
replica that waits for the other is seen waiting, and two replicas that issue their agreements in different orders
are seen stuck (the barrier times out) instead of passing by luck."""

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from hf_diloco.backends import FixedGroup
from hf_diloco.schedule import Schedule, TimeBudget

MAX_STEPS = 100


class Network:
    """The all-reduce of the agreement between two replicas: each puts its row and waits for the other's."""

    def __init__(self):
        self.barrier = threading.Barrier(2, timeout=10)
        self.rows: dict[int, torch.Tensor] = {}
        self.calls: list[tuple[int, str]] = []  # (replica, calling thread's name) of every agreement

    def replica_table(self, replica: int, tokens: float, row: list[float]) -> tuple[torch.Tensor, int]:
        self.calls.append((replica, threading.current_thread().name))
        mine = torch.zeros(2, 1 + len(row), dtype=torch.float64)
        mine[replica] = torch.tensor([tokens, *row], dtype=torch.float64)
        self.rows[replica] = mine
        self.barrier.wait()
        table = self.rows[0] + self.rows[1]
        self.barrier.wait()  # both have read the table before either puts its next row
        return table, 64


def fixed_group(network: Network, replica: int, moved: list[int], wanted=lambda before, now, sync: False,
                tau: int = 2):
    """Replica `replica`'s fixed group, landing an overlapped sync `tau` of its steps after its launch; the steps its
    verdicts move it to go to `moved` (`finish`), and `wanted` stands in for the Boundaries rule of where saves and
    evaluations fall."""
    control = SimpleNamespace(replica_table=lambda tokens, row: network.replica_table(replica, tokens, row))
    comm = SimpleNamespace(control=control, replica_index=replica, num_replicas=2)
    schedule = Schedule(10, 1, sync_delay=tau, budget=TimeBudget(1.0))
    group = FixedGroup(comm, None, schedule, resumed=False, max_steps=MAX_STEPS, overlap=True,
                       boundaries=SimpleNamespace(wanted=wanted))
    group.moves = moved
    return group


def finish(group: FixedGroup, start, step: int) -> tuple[dict, bool]:
    """The group's verdict on a sync that landed at `step`: (where its record is placed: step, sync and, where it
    names one, launch_step; restart); a step move is noted in its `moves`."""
    verdict = group.finish(start, None, step=step)
    if verdict.continue_at is not None:
        group.moves.append(verdict.continue_at)
    placed = {"step": verdict.step, "sync": verdict.sync}
    if verdict.launch_step is not None:
        placed["launch_step"] = verdict.launch_step
    return placed, verdict.restart


def in_background(group: FixedGroup, step: int, expected: list[int]):
    """What the engine's background thread does first: the backend's start (SyncEngine._in_background)."""
    result = {}
    thread = threading.Thread(target=lambda: result.update(start=group.start(step, MAX_STEPS, {}, expected,
                                                                             overlapped=True)), name="diloco-sync")
    thread.start()
    return thread, result


def launched_overlapped(groups: list[FixedGroup], steps: tuple[int, ...]) -> list:
    """Each group launches an overlapped sync at its step (100 tokens), agreeing in its background thread; their
    starts once every agreement is done."""
    threads = [in_background(group, step, group.expected_fragments(step, MAX_STEPS, {"tokens": 100}))
               for group, step in zip(groups, steps, strict=True)]
    for thread, _ in threads:
        thread.join(timeout=10)
    return [result["start"] for _, result in threads]


def test_an_overlapped_launch_agrees_in_the_background_so_the_replica_that_spent_its_budget_trains_on():
    """Replica 0 spends its budget at step 12 with 120 tokens, replica 1 at step 9 with 45. Replica 0's launch
    returns at once, without a collective (replica 1 has not arrived); the agreement runs in its background thread
    and completes only once replica 1 arrives; both get the same fragments and their tokens relative to the most as
    weights. Replica 0 lands 2 of its steps after its launch, replica 1 3 of its own: each continues at the
    furthest launch step plus its own steps since its launch."""
    network, moved = Network(), [[], []]
    fast, slow = fixed_group(network, 0, moved[0]), fixed_group(network, 1, moved[1])
    began = time.perf_counter()
    expected = fast.expected_fragments(12, MAX_STEPS, {"tokens": 120})
    assert time.perf_counter() - began < 1.0 and network.calls == [], "the launch waits for nobody"
    assert expected == [0] and fast.may_overlap()
    thread, result = in_background(fast, 12, expected)
    time.sleep(0.3)
    assert thread.is_alive(), "the agreement waits for replica 1 in the background"
    assert slow.expected_fragments(9, MAX_STEPS, {"tokens": 45}) == [0]
    slow_thread, slow_result = in_background(slow, 9, [0])
    for t in (thread, slow_thread):
        t.join(timeout=10)
    assert [name for _, name in network.calls] == ["diloco-sync", "diloco-sync"]
    starts = result["start"], slow_result["start"]
    assert [s.called_off for s in starts] == [False, False]
    assert [s.weight for s in starts] == [1.0, pytest.approx(45 / 120, abs=1e-12)]
    assert [s.fragments for s in starts] == [[0], [0]]
    for group, start, step, continues in ((fast, starts[0], 14, 14), (slow, starts[1], 12, 15)):
        record, restart = finish(group, start, step)
        assert not restart and record["step"] == continues and record["launch_step"] == 12 and record["sync"] == 1
    assert moved == [[], [15]]


def test_a_sync_where_a_save_falls_overlaps_and_every_replica_continues_at_one_step_after_its_own_tau():
    """The callback wants a save in the window of sync 1 (steps (0, 12]). Both replicas' background agreements keep
    the sync overlapped (nothing called off) and say it lands together: replica 0 (τ 3, chosen from its own step
    time as sync_delay auto does) lands it at 15, 3 of its steps after its launch at 12; replica 1 (τ 2) at 11, 2
    after its launch at 9; both then continue at the furthest launch step plus the longest τ, 15, where the window
    is handed over on both, so the save falls at one step everywhere with nothing in flight."""
    network, moved = Network(), [[], []]
    windows = []

    def wanted(before, now, sync):
        windows.append((before, now, sync))
        return True

    groups = [fixed_group(network, r, moved[r], wanted, tau=tau) for r, tau in ((0, 3), (1, 2))]
    starts = launched_overlapped(groups, (12, 9))
    assert [(s.called_off, s.lands_together) for s in starts] == [(False, True), (False, True)]
    assert windows[:2] == [(0, 12, 1)] * 2
    for r, step in ((0, 15), (1, 11)):
        record, restart = finish(groups[r], starts[r], step)
        assert not restart and record == {"step": 15, "sync": 1, "launch_step": 12}, record
        assert groups[r].take_window() == (0, 12, 1)
    assert moved == [[], [15]]
    assert len(network.calls) == 2, "one agreement each, in the background"


def test_a_save_so_near_the_end_that_tau_would_pass_it_is_called_off_then_agreed_again_blocking():
    """The same save window at sync 1, launched at steps 97 (replica 0, τ 3) and 94 (replica 1, τ 2): landed
    together, both would continue at 97 + 3 = max_steps, past the room the last sync needs. Both background
    agreements call the sync off (nothing is exchanged); each then launches again where it would have landed
    (replica 0 at 99, replica 1 at 96), agreeing in the foreground: a blocking sync that carries the window, so both
    continue at the furthest of those steps, 99, where the save falls on every replica; the called-off agreement's
    bytes go with it."""
    network, moved = Network(), [[], []]
    groups = [fixed_group(network, r, moved[r], lambda before, now, sync: True, tau=tau)
              for r, tau in ((0, 3), (1, 2))]
    assert [start.called_off for start in launched_overlapped(groups, (97, 94))] == [True, True]
    again = {}

    def land(r, step):
        group = groups[r]
        fragments = group.expected_fragments(step, MAX_STEPS, {"tokens": 150})
        assert fragments == [0] and not group.may_overlap(), "blocking"
        start = group.start(step, MAX_STEPS, {}, fragments)
        again[r] = finish(group, start, step)[0], start, group.take_window()

    landing = [threading.Thread(target=land, args=(r, step), name=f"inner-{r}") for r, step in ((0, 99), (1, 96))]
    for t in landing:
        t.start()
    for t in landing:
        t.join(timeout=10)
    assert sorted(name for _, name in network.calls[2:]) == ["inner-0", "inner-1"], "agreed again in the foreground"
    for r in (0, 1):
        record, start, window = again[r]
        assert record["step"] == 99 and "launch_step" not in record and record["sync"] == 1
        assert window == (0, 99, 1) and start.extra_bytes == 2 * 64
    assert moved == [[], [99]]


def test_the_replica_at_max_steps_calls_the_last_sync_off_and_agrees_again_in_the_same_order_as_the_others():
    """Replica 0 reaches max_steps (it agrees in the foreground: it has no step left to train) while replica 1
    launches in the background: both agreements find the end and call the sync off, replica 0 agrees again at
    once, replica 1 where it lands. The same two agreements in the same order on both (else the barrier would time
    out): the last sync carries every fragment, blocking, and ends the run."""
    network, moved = Network(), [[], []]
    fast, slow = fixed_group(network, 0, moved[0]), fixed_group(network, 1, moved[1])
    result = {}
    at_end = threading.Thread(target=lambda: result.update(
        fragments=fast.expected_fragments(MAX_STEPS, MAX_STEPS, {"tokens": 80})), name="inner-0")
    at_end.start()
    expected = slow.expected_fragments(97, MAX_STEPS, {"tokens": 30})
    thread, background = in_background(slow, 97, expected)
    thread.join(timeout=10)
    assert background["start"].called_off
    assert slow.expected_fragments(99, MAX_STEPS, {"tokens": 40}) == [0] and not slow.may_overlap()
    at_end.join(timeout=10)
    assert result["fragments"] == [0] and not fast.may_overlap()
    assert len(network.calls) == 4
    for group, step in ((fast, MAX_STEPS), (slow, 99)):
        start = group.start(step, MAX_STEPS, {}, [0])
        record = finish(group, start, step)[0]
        assert record["step"] == MAX_STEPS and group.run_over() and group.take_window() == (0, MAX_STEPS, 1)
        assert not group.due(MAX_STEPS, MAX_STEPS), "nothing follows the last sync"


def test_a_stop_asked_for_by_one_replica_calls_the_sync_off_so_every_replica_stops_at_one_step():
    """Replica 1 asks to stop: the agreement of its next sync carries the request, both replicas call that sync off,
    and the blocking one they agree on where they land puts both at one step (the stop saves there); a sync with
    no request, no window and no end is not called off."""
    network, moved = Network(), [[], []]
    groups = [fixed_group(network, r, moved[r]) for r in (0, 1)]
    for stop, called_off in ((False, False), (True, True)):
        threads = []
        for r, group in enumerate(groups):
            local = {"tokens": 100, "stop_requested": stop and r == 1}
            threads.append(in_background(group, 10, group.expected_fragments(10, MAX_STEPS, local)))
        for thread, _ in threads:
            thread.join(timeout=10)
        assert [result["start"].called_off for _, result in threads] == [called_off] * 2
        if not called_off:
            for group, (_, result) in zip(groups, threads, strict=True):
                finish(group, result["start"], 10)
    landed = {}

    def land(r, step):
        groups[r].expected_fragments(step, MAX_STEPS, {"tokens": 150, "stop_requested": r == 1})
        start = groups[r].start(step, MAX_STEPS, {}, [0])
        landed[r] = groups[r].may_overlap(), finish(groups[r], start, step)[0]["step"]

    again = [threading.Thread(target=land, args=(r, step)) for r, step in ((0, 13), (1, 11))]
    for t in again:
        t.start()
    for t in again:
        t.join(timeout=10)
    assert landed == {0: (False, 13), 1: (False, 13)}, "blocking, at one step"
