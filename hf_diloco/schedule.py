"""When each fragment syncs, and the inner_steps auto choice: arithmetic only, no torch, no state but numbers.

Streaming DiLoCo (arXiv 2501.18512) staggers F fragments: fragment f syncs at the steps s with
s mod H = (f + 1)·H/F mod H, so one fragment syncs every H/F steps and each fragment every H steps. F = 1 is plain
DiLoCo (every H steps). A round is one fragment's sync, counted from 1.

The end of a run makes the final model the global one, in one of two ways:
- blocking (the default without overlap): every fragment syncs at the last step, and the replicas wait for the
  whole model's exchange;
- staggered (`final_sync: staggered`, the default when syncs overlap inner steps): each fragment's last sync is
  launched so that it lands as the next one is launched, the last one landing at the last step,

      e_last = max_steps − τ_last,   e_f = e_next − τ_f,   so the window starts at W = max_steps − Σ_f τ_f,

  and no regular round is launched that would still be in flight at W. Nothing waits at the end beyond what every
  overlapped round waits; what a fragment trains after its last sync is launched (at most Σ τ steps) is left out
  of the final model, which takes θ_global for every fragment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class Schedule:
    """The sync schedule of a run: from step `origin_step` (round `origin_round`) one fragment syncs every
    `inner_steps / num_fragments` steps. Fixed for a run, except once with inner_steps auto, which starts a new
    schedule at the step it decides.

    >>> s = Schedule(inner_steps=4, num_fragments=2)
    >>> [s.due_fragments(step, max_steps=9) for step in range(1, 10)]
    [[], [0], [], [1], [], [0], [], [1], [0, 1]]
    >>> s.round_at(8), s.total_rounds(9)
    (4, 5)
    """

    inner_steps: int
    num_fragments: int = 1
    origin_step: int = 0
    origin_round: int = 0
    end: FinalWindow | None = None  # the staggered end, once `stagger_end` placed it

    @property
    def sync_every(self) -> int:
        return self.inner_steps // self.num_fragments

    def due_fragments(self, step: int, max_steps: int) -> list[int]:
        """Fragments whose round is launched at `step`: every fragment at the last step, or with a staggered end
        one fragment at each of the final window's launch steps and none at the last step."""
        if self.end is not None:
            if step in self.end.launches:
                return [self.end.launches[step][0]]
            if step > self.end.last_regular:
                return []
        elif step >= max_steps:
            return list(range(self.num_fragments))
        since = step - self.origin_step
        if since <= 0 or since % self.sync_every:
            return []
        return [(self.round_at(step) - 1) % self.num_fragments]

    def round_at(self, step: int) -> int:
        """The number of the round launched at `step`, counted from 1."""
        if self.end is not None and step in self.end.launches:
            return self.end.launches[step][1]
        return self.origin_round + math.ceil((step - self.origin_step) / self.sync_every)

    def total_rounds(self, max_steps: int) -> int | None:
        if self.end is not None:
            return max(number for _, number, _ in self.end.launches.values())
        return self.round_at(max_steps) if max_steps > 0 else None

    def restart_at(self, step: int, inner_steps: int) -> None:
        """A new H from `step` on (the round launched at `step` keeps its number)."""
        self.origin_round, self.origin_step = self.round_at(step), step
        self.inner_steps = inner_steps

    def final_delay(self, step: int) -> int | None:
        """τ of the final-window round launched at `step` (it lands as the next is launched), else None."""
        if self.end is None or step not in self.end.launches:
            return None
        return self.end.launches[step][2]

    def stagger_end(self, max_steps: int, delays: list[int], busy_until: int = 0) -> bool:
        """Place the staggered end for the fragments' τ `delays` (see the module's docstring), after step
        `busy_until` (where the exchange in flight lands; every round launched before it is kept). A window that
        has begun by then stays as it is. Where Σ τ no longer fits between `busy_until` and the last step (τ grew
        after the window was first placed), the window starts at `busy_until` and its syncs get shorter τ, the
        longest shortened first: they wait for the rest of their exchange, the end is still staggered. Returns
        False, and leaves the blocking end, where the window does not fit (a first placement never shortens τ).

        >>> s = Schedule(inner_steps=6, num_fragments=3)       # one fragment every 2 steps, τ = 1 each
        >>> s.stagger_end(13, [1, 1, 1])
        True
        >>> [(step, s.due_fragments(step, 13)) for step in range(1, 14) if s.due_fragments(step, 13)]
        [(2, [0]), (4, [1]), (6, [2]), (8, [0]), (10, [1]), (11, [2]), (12, [0])]
        >>> s.round_at(10), s.round_at(11), s.round_at(12), s.total_rounds(13), s.final_delay(12)
        (5, 6, 7, 7, 1)
        >>> s.stagger_end(13, [2, 2, 2], busy_until=10)          # begun: it stays
        True
        >>> sorted(s.end.launches)
        [10, 11, 12]
        >>> s = Schedule(inner_steps=20, num_fragments=2)      # τ grew to 9 by step 21: 18 steps don't fit in 14
        >>> s.stagger_end(35, [1, 1]), s.stagger_end(35, [9, 9], busy_until=21), s.end.launches
        (True, True, {21: (0, 3, 7), 28: (1, 4, 7)})
        """
        if self.end is not None and busy_until >= min(self.end.launches):
            return True
        placed, self.end = self.end is not None, None
        delays = list(delays)
        while placed and sum(delays) > max_steps - max(busy_until, self.origin_step + 1) and max(delays) > 1:
            delays[delays.index(max(delays))] -= 1
        window = max_steps - sum(delays)
        if min(delays) < 1 or window <= self.origin_step or window < busy_until:
            return False
        # The regular rounds kept are those launched before the exchange in flight lands and those that land by
        # the window's start; the window goes on in their order.
        last_regular = self.origin_step
        step = self.origin_step + self.sync_every
        while step < window and (step < busy_until or
                                 step + delays[(self.round_at(step) - 1) % self.num_fragments] <= window):
            last_regular, step = step, step + self.sync_every
        kept = self.round_at(last_regular) if last_regular > self.origin_step else self.origin_round
        launches, at = {}, window
        for j in range(self.num_fragments):
            fragment = (kept + j) % self.num_fragments
            launches[at] = (fragment, kept + 1 + j, delays[fragment])
            at += delays[fragment]
        self.end = FinalWindow(launches=launches, last_regular=last_regular)
        return True


@dataclass
class FinalWindow:
    """A staggered end: launch step -> (fragment, round number, τ), and the last regular round's launch step."""

    launches: dict[int, tuple[int, int, int]]
    last_regular: int


def choose_inner_steps(step_seconds: float, sync_seconds: float, *, num_fragments: int, sync_delay: int,
                       max_sync_overhead: float) -> int:
    """inner_steps auto: the smallest H whose syncs keep the replicas waiting at most `max_sync_overhead` of their
    compute time:

        H = F · t_sync / (max_sync_overhead · t_step), rounded up to a multiple of F, and at least F · (τ + 1), so
        an overlapped sync still lands before the next is due

    with t_step the slowest replica's seconds per inner step and t_sync the longest a replica waited for one
    fragment's sync.

    >>> choose_inner_steps(0.1, 0.5, num_fragments=1, sync_delay=0, max_sync_overhead=0.05)   # 0.5 / 0.005
    100
    >>> choose_inner_steps(0.1, 0.5, num_fragments=3, sync_delay=0, max_sync_overhead=0.05)   # 300, a multiple of 3
    300
    >>> choose_inner_steps(0.1, 0.0, num_fragments=2, sync_delay=4, max_sync_overhead=0.05)   # floor F (τ + 1)
    10
    """
    fragments = num_fragments
    wanted = fragments * sync_seconds / (max_sync_overhead * step_seconds) if step_seconds > 0 else fragments
    return max(fragments * (sync_delay + 1), fragments * math.ceil(wanted / fragments))


def choose_sync_delay(exchange_seconds: float, step_seconds: float, *, most: int) -> int:
    """sync_delay auto: the fewest inner steps (at least 1, at most `most` = H/F − 1, so a fragment's sync lands
    before the next is due) whose compute time covers a fragment's exchange:

        τ = ceil(t_exchange / t_step), clamped to [1, H/F − 1]

    with t_exchange the longest any replica's last exchange of that fragment took and t_step the slowest
    replica's seconds per inner step.

    >>> choose_sync_delay(0.25, 0.1, most=9)      # 2.5 steps of compute cover the transfer: 3
    3
    >>> choose_sync_delay(0.01, 0.1, most=9), choose_sync_delay(5.0, 0.1, most=9)
    (1, 9)
    """
    wanted = math.ceil(exchange_seconds / step_seconds - 1e-9) if step_seconds > 0 else most
    return max(1, min(most, wanted))
