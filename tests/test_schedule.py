"""The staggered end of a streamed run, checked by simulating the schedule step by step (no processes).

For many H, F, per-fragment τ and run lengths: the rounds launched never overlap (one exchange in flight at a
time), each lands by the last step, the last one exactly at it, every fragment's last sync is in the final window
once, the round numbers count up by one, and `total_syncs` is the number of rounds launched.
"""

import random

import pytest

from hf_diloco.schedule import Schedule


def launched_rounds(schedule: Schedule, max_steps: int, delays: list[int]) -> list[tuple[int, int, int, int]]:
    """(launch step, fragment, τ, round number) of every round the schedule launches, step by step."""
    rounds = []
    for step in range(1, max_steps + 1):
        due = schedule.due_fragments(step, max_steps)
        assert len(due) <= 1, f"step {step}: a staggered end never syncs two fragments at once"
        for fragment in due:
            tau = schedule.final_delay(step) or delays[fragment]
            rounds.append((step, fragment, tau, schedule.sync_at(step)))
    return rounds


@pytest.mark.parametrize("seed", range(40))
def test_a_staggered_end_lands_every_fragment_once_and_the_last_at_the_last_step(seed):
    rng = random.Random(seed)
    fragments = rng.choice([1, 2, 3, 5])
    every = rng.randint(2, 12)  # H / F
    delays = [rng.randint(1, every - 1) for _ in range(fragments)]
    max_steps = rng.randint(fragments * every + sum(delays), 8 * fragments * every)
    schedule = Schedule(inner_steps=every * fragments, num_fragments=fragments)
    assert schedule.stagger_end(max_steps, delays)
    rounds = launched_rounds(schedule, max_steps, delays)
    for (step, _, tau, _), (following, _, _, _) in zip(rounds, rounds[1:], strict=False):
        assert step + tau <= following, "a round is launched before the one before it landed"
    last_step, _, last_tau, _ = rounds[-1]
    assert last_step + last_tau == max_steps
    window = [fragment for step, fragment, _, _ in rounds if step >= max_steps - sum(delays)]
    assert sorted(window) == list(range(fragments))
    assert [number for *_, number in rounds] == list(range(1, len(rounds) + 1))
    assert schedule.total_syncs(max_steps) == len(rounds)


def test_a_run_too_short_for_the_window_keeps_the_blocking_end():
    schedule = Schedule(inner_steps=6, num_fragments=3)
    assert not schedule.stagger_end(5, [2, 2, 2])
    assert schedule.due_fragments(5, 5) == [0, 1, 2]


@pytest.mark.parametrize("seed", range(40))
def test_tau_changing_after_the_window_was_placed_still_ends_staggered(seed):
    """τ chosen anew at random landings (as sync_delay auto does), growing as well as shrinking, with the window
    placed again after each: the end stays staggered (never two fragments at one step), no round is launched
    before the one before it landed, the last lands at the last step, every fragment syncs in the window once,
    and round numbers count up by one."""
    rng = random.Random(1000 + seed)
    fragments = rng.choice([1, 2, 3, 5])
    every = rng.randint(2, 12)
    delays = [rng.randint(1, every - 1) for _ in range(fragments)]
    max_steps = rng.randint(fragments * every + sum(delays), 8 * fragments * every)
    schedule = Schedule(inner_steps=every * fragments, num_fragments=fragments)
    assert schedule.stagger_end(max_steps, delays)
    rounds, lands_at = [], None  # (launch step, fragment, τ, number); the step the exchange in flight lands at
    for step in range(1, max_steps + 1):
        if lands_at == step:
            lands_at = None
            if rng.random() < 0.5:
                delays = [rng.randint(1, every - 1) for _ in range(fragments)]
                assert schedule.stagger_end(max_steps, delays, busy_until=step)
        due = schedule.due_fragments(step, max_steps)
        assert len(due) <= 1, f"step {step}: two fragments at once, the end fell back to blocking"
        for fragment in due:
            assert lands_at is None, f"step {step}: launched while a round was in flight"
            tau = schedule.final_delay(step) or delays[fragment]
            rounds.append((step, fragment, tau, schedule.sync_at(step)))
            lands_at = step + tau
    last_step, _, last_tau, _ = rounds[-1]
    assert last_step + last_tau == max_steps
    window = schedule.end.launches
    assert sorted(fragment for fragment, _, _ in window.values()) == list(range(fragments))
    assert [number for *_, number in rounds] == list(range(1, len(rounds) + 1))
    assert schedule.total_syncs(max_steps) == len(rounds)
