"""The tuner: the choices a run makes from what its first syncs measured, kept in hf_diloco.schedule.Schedule.

    sync_delay auto    each fragment's τ covers its last exchange (rounds of H steps: in the slowest replica's
                       steps; time budgets: in this replica's own steps, the budget stretched where a fragment's
                       time in flight would not fit in it)
    inner_steps auto   H from the first 2F syncs, so that the time syncs keep replicas waiting stays under
                       max_sync_overhead of compute; the same on every replica (it is chosen from shared numbers)
    staggered end      where each fragment's last sync is launched (final_sync), placed anew whenever τ or H change
    last budget        time-budget rounds: the last sync's budget ends as the fastest replica reaches max_steps

Every input is a number every replica holds alike (the sync's statistics), except this replica's own pace under
time budgets, where each replica lands in its own steps anyway.
"""

from __future__ import annotations

import logging
import time

from .config import DiLoCoConfig
from .records import SyncStats
from .schedule import Schedule

logger = logging.getLogger(__name__)

FLIGHT_MARGIN = 1.25  # time-budget rounds, sync_delay auto: τ and the budget cover this times the time in flight


def step_seconds(stats: SyncStats) -> float:
    """The slowest replica's seconds per inner step in a sync."""
    return float((stats.compute_seconds / stats.steps.clamp(min=1)).max())


class Tuner:
    """auto τ, auto H and the staggered end of one replica's run over `schedule`; `announce` says whether this
    process logs the choices (the main process)."""

    def __init__(self, args: DiLoCoConfig, schedule: Schedule, announce: bool):
        self.args, self.schedule, self.announce = args, schedule, announce
        self.syncs_landed = 0  # syncs landed since this process started (inner_steps auto waits for 2F)
        self.own_pace = (0.0, 0.0)  # time-budget τ auto: this replica's decayed (compute seconds, steps)
        self.fastest_span = (0.0, 0.0)  # time-budget rounds: the fastest replica's decayed (wall seconds, steps)
        self.fastest_here = False  # whether this replica took the most steps in the last sync

    def landed(self, stats: SyncStats | None, *, replica: int, measured: list[int], launched_at: int, step: int,
               max_steps: int, sizes: list[int]) -> dict:
        """A sync landed at `step`: what it measured updates the choices. Returns the record's `sync_delay_auto` and
        `inner_steps_auto` entries where a choice was made (then the staggered end must be placed anew)."""
        self.syncs_landed += 1
        choices: dict = {}
        if self.schedule.budget.last:  # this sync ran under the run's last budget (TimeBudget.size_last)
            choices["last_budget_seconds"] = self.schedule.budget.last
        if stats is None:
            return choices
        if self.args.round_seconds > 0 and stats.steps.max() > 0:
            # Wall seconds, not compute: every replica spent the same budget, the fastest on the most steps (its
            # compute seconds leave out the inner loop's own time between steps). Over its recent syncs, each older
            # one counting half as much as the next, as a single budget's count varies by a few steps.
            self.fastest_span = (0.5 * self.fastest_span[0] + self.schedule.budget.current(),
                                 0.5 * self.fastest_span[1] + float(stats.steps.max()))
            self.fastest_here = bool(stats.steps[:, replica].max() >= stats.steps.max())
        # This replica's seconds per step over its recent syncs (each older sync counts half as much as the next;
        # time-budget τ auto): a sync that waited at its landing holds a step or two, too few to time a step by.
        self.own_pace = (0.5 * self.own_pace[0] + float(stats.compute_seconds[:, replica].max()),
                         0.5 * self.own_pace[1] + float(stats.steps[:, replica].max()))
        if self.args.auto_sync_delay and measured and step < max_steps:
            choices["sync_delay_auto"] = self._choose_delays(stats, list(measured), sizes)
        if self.args.auto_inner_steps and self.schedule.auto_choice is None and \
                self.syncs_landed >= 2 * self.args.num_fragments and step < max_steps:
            choices["inner_steps_auto"] = self._choose_inner_steps(stats, launched_at)
        return choices

    def size_last_budget(self, step: int, max_steps: int, origin: float) -> None:
        """Time-budget rounds, after a sync landed and every replica continues at `step`, with the next budget
        counted from `origin` (a perf_counter time): size that budget to end as the fastest replica reaches
        max_steps, when it would within 1.5 budgets (TimeBudget.size_last)."""
        seconds, steps = self.fastest_span
        if self.args.round_seconds > 0 and steps > 0:
            self.schedule.budget.size_last(time.perf_counter() - origin, max_steps - step, seconds / steps,
                                           self.fastest_here)

    def place_end(self, max_steps: int, busy_until: int, warn: bool = False) -> int | None:
        """final_sync staggered: place the final window (Schedule.place_end) for the fragments' current τ and H,
        after the exchange in flight lands (`busy_until`). Placed anew when an auto choice changes τ or H, until the
        window begins: from then on it stays, so every fragment's last sync happens once, at the step every replica
        agreed on. Only a run too short for the first placement ends blocking. Returns how many syncs the run
        makes (None with time budgets: that depends on the replicas' speeds)."""
        if self.args.staggered_end and not self.schedule.place_end(max_steps, busy_until=busy_until) and warn and \
                self.announce:
            logger.warning("DiLoCo: the run is too short for a staggered end (final_sync); every fragment syncs at "
                           "the last step.")
        return None if self.args.round_seconds > 0 else self.schedule.total_syncs(max_steps)

    def _choose_delays(self, stats: SyncStats, measured: list[int], sizes: list[int]) -> dict:
        """sync_delay auto from what the last exchange of the `measured` fragments took. With rounds of H steps
        every replica lands at the same step, so τ covers the exchange in the slowest replica's steps; with
        time-budget rounds each replica lands in its own steps, so τ is chosen from its own seconds per step, at
        most the steps it takes in the next budget less one (its sync lands before that budget is spent). That
        budget stretches while a measured fragment's time in flight would not fit in it (TimeBudget.stretch)."""
        exchange_seconds = float(stats.previous_exchange_seconds.max())
        if self.args.round_seconds <= 0:
            return self.schedule.choose_delays(measured, exchange_seconds=exchange_seconds,
                                               step_seconds=step_seconds(stats), sizes=sizes)
        own_step = self.own_pace[0] / self.own_pace[1] if self.own_pace[1] > 0 else 0.0
        # A time-budget sync's τ covers its time in flight with a margin: a sync that lands even slightly before
        # its exchange is done waits for it, while one that lands a few steps late costs nothing.
        exchange_seconds *= FLIGHT_MARGIN
        budget = self.schedule.budget.stretch(measured, exchange_seconds, step_seconds(stats))
        # At most the steps the budget holds less one, from the budget rather than the steps this sync took: a
        # sync that waited at its landing took few steps, and τ chosen from them would stay too short.
        most = max(1, int(budget / own_step) - 1) if own_step > 0 else 1
        choice = self.schedule.choose_delays(measured, exchange_seconds=exchange_seconds, step_seconds=own_step,
                                             sizes=sizes, most=most)
        choice["budget_seconds"] = budget
        return choice

    def _choose_inner_steps(self, stats: SyncStats, launched_at: int) -> dict:
        """inner_steps auto from what the first syncs measured, the same on every replica; the new schedule
        starts at the step this sync was launched at."""
        overhead = self.args.max_sync_overhead
        choice = self.schedule.choose_inner_steps_at(
            launched_at, step_seconds=step_seconds(stats),
            sync_seconds=float(stats.previous_blocked_seconds.max()), max_sync_overhead=overhead)
        if self.announce:
            logger.warning(
                "DiLoCo inner_steps auto: an inner step takes %.4f s and a fragment's sync kept the replicas waiting "
                "%.4f s, so H = %d keeps waiting under %.0f%% of compute (%d fragment(s)); H = %d from step %d on.",
                choice["step_seconds"], choice["sync_seconds"], choice["chosen"], 100 * overhead,
                self.args.num_fragments, choice["chosen"], launched_at)
        return choice
