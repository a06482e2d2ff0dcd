"""When each fragment syncs, and the inner_steps auto choice: arithmetic only, no torch, no state but numbers.

Streaming DiLoCo (arXiv 2501.18512) staggers F fragments: fragment f syncs at the steps s with
s mod H = (f + 1)·H/F mod H, so one fragment syncs every H/F steps and each fragment every H steps. F = 1 is plain
DiLoCo (every H steps). Every fragment syncs at the last step, so the final model is the global one. A round is one
fragment's sync, counted from 1.
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

    @property
    def sync_every(self) -> int:
        return self.inner_steps // self.num_fragments

    def due_fragments(self, step: int, max_steps: int) -> list[int]:
        """Fragments whose round ends at `step`: every fragment at the last step."""
        if step >= max_steps:
            return list(range(self.num_fragments))
        since = step - self.origin_step
        if since <= 0 or since % self.sync_every:
            return []
        return [(self.round_at(step) - 1) % self.num_fragments]

    def round_at(self, step: int) -> int:
        """The number of the round launched at `step`, counted from 1."""
        return self.origin_round + math.ceil((step - self.origin_step) / self.sync_every)

    def total_rounds(self, max_steps: int) -> int | None:
        return self.round_at(max_steps) if max_steps > 0 else None

    def restart_at(self, step: int, inner_steps: int) -> None:
        """A new H from `step` on (the round launched at `step` keeps its number)."""
        self.origin_round, self.origin_step = self.round_at(step), step
        self.inner_steps = inner_steps


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
