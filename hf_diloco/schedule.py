"""When each fragment syncs, with what τ, and the auto choices of H and τ: arithmetic only, no torch.

`Schedule` is the one owner of these decisions for both backends; it holds no tensor, and its `state_dict` goes
into each replica's checkpoint so that a resumed run keeps what the auto choices decided.

Streaming DiLoCo (arXiv 2501.18512) staggers F fragments: fragment f syncs at the steps s with
s mod H = (f + 1)·H/F mod H, so one fragment syncs every H/F steps and each fragment every H steps. F = 1 is plain
DiLoCo (every H steps).

Two words, used the same way in the code, the records, the app, the card and the docs:
- a **sync** is one launch and landing: one fragment's exchange and outer step (every fragment's, at a blocking
  end). Syncs are numbered from 1; each writes one record.
- a **round** is H inner steps, in which every fragment syncs once: round r holds syncs (r − 1)·F + 1 .. r·F
  (`round_of`). With F = 1 they are the same.

The end of a run makes the final model the global one, in one of two ways:
- blocking (the default without overlap): every fragment syncs at the last step, and the replicas wait for the
  whole model's exchange;
- staggered (`final_sync: staggered`, the default when syncs overlap inner steps): each fragment's last sync is
  launched so that it lands as the next one is launched, the last one landing at the last step,

      e_last = max_steps − τ_last,   e_f = e_next − τ_f,   so the window starts at W = max_steps − Σ_f τ_f,

  and no regular sync is launched that would still be in flight at W. Nothing waits at the end beyond what every
  overlapped sync waits; what a fragment trains after its last sync is launched (at most Σ τ steps) is left out
  of the final model, which takes θ_global for every fragment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class TimeBudget:
    """Time-budget rounds (`round_seconds`): the seconds of inner steps after which a replica's next sync is due,
    the same on every replica (each counts them on its own clock): the set budget, stretched while a slow link's
    exchanges do not fit in it (sync_delay auto), and the run's last one, sized to end as the fastest replica
    reaches max_steps. Falsy when the run has rounds of H steps."""

    seconds: float = 0.0  # the set budget: round_seconds / F; 0: off
    stretched: float = 0.0  # a longer budget sync_delay auto chose while an exchange did not fit the set one
    last: float = 0.0  # the budget of a run's last sync, sized to end as the fastest replica finishes
    finishes: bool = False  # this replica took the most steps in the last sync (`size_last`)
    flights: dict[int, float] = field(default_factory=dict)  # each measured fragment's last time in flight

    def __bool__(self) -> bool:
        return self.seconds > 0

    def current(self) -> float:
        """Seconds of inner steps before the next time-budget sync: the set budget, a longer one while exchanges
        take longer than it allows (`stretch`), or the last one (`size_last`)."""
        return self.last or max(self.seconds, self.stretched)

    def due(self) -> float:
        """The budget after which this replica's next time-budget sync is due: none under the last budget for the
        replica expected to reach max_steps first (it syncs there), else `current`."""
        return math.inf if self.last and self.finishes else self.current()

    def spent(self, elapsed: float, step_seconds: float) -> bool:
        """Whether this replica's sync is due, `elapsed` seconds into its budget at `step_seconds` a step: once it
        has taken the step whose end falls nearest the budget, so that every replica reaches the sync within half
        a step of it, whatever its speed. Under the run's last budget (`size_last`), the replica that reaches
        max_steps syncs there and has nothing left to train while it waits, so the others take only the steps
        that end within the budget: they arrive up to a step early and wait for it, not it for them.

        >>> b = TimeBudget(1.0)
        >>> b.spent(0.7, 0.5), b.spent(0.8, 0.5)       # the next step ends 0.2 s past (take it), then 0.3 s past
        (False, True)
        >>> b.size_last(0.0, 8, 0.125, False), b.spent(0.7, 0.5)   # the last budget: no step that ends past it
        (1.0, True)
        """
        late = step_seconds if self.last and not self.finishes else step_seconds / 2
        return elapsed + late >= self.due()

    def size_last(self, elapsed: float, steps_left: int, fastest_step_seconds: float, finishes: bool) -> float:
        """Time-budget rounds: the replica that reaches max_steps first syncs at once, and would wait for the rest
        of the others' budgets (up to a whole one). So when the fastest replica (`fastest_step_seconds` a step,
        this replica if `finishes`) would reach max_steps within 1.5 budgets of the budget's start (`elapsed` s
        ago, `steps_left` steps to go), the next budget ends then for the others, and the fastest syncs at
        max_steps only (`due`): where the forecast is short (a save after the sync takes a larger share of a
        short budget) the others wait for it, not it for them. Returns the next budget.

        >>> b = TimeBudget(1.0)
        >>> b.size_last(0.25, 30, 0.125, False), b.size_last(0.0, 4, 0.125, False)  # 4 s to go, then 0.5 s
        (1.0, 0.5)
        >>> b.due(), b.size_last(0.0, 4, 0.125, True), b.due()
        (0.5, 0.5, inf)
        """
        ends = elapsed + steps_left * fastest_step_seconds
        self.finishes = finishes
        fits = 0 < steps_left and ends <= 1.5 * max(self.seconds, self.stretched)
        self.last = ends if self.seconds > 0 and fits else 0.0
        return self.current()

    def stretch(self, fragments: list[int], exchange_seconds: float, slowest_step_seconds: float) -> float:
        """sync_delay auto with time-budget rounds: a sync overlaps its exchange with at most the steps of one
        budget less one, so an exchange longer than that (a slow link: a ring all-reduce runs at its slowest link
        for everyone) would keep every replica waiting at the landing. Given that the last exchange of `fragments`
        took `exchange_seconds`, the budget stretches to

            T' = max over the measured fragments of t_exchange + 2 · t_step (the slowest replica's seconds per step)

        so that every replica's τ covers the exchange with a step to spare, back to the set budget once exchanges
        fit again (the same on every replica): syncs are rarer while the link is slow, and nobody waits.

        >>> b = TimeBudget(1.0)
        >>> b.stretch([0], 3.0, 0.25), b.stretch([1], 0.4, 0.25)  # fragment 0's 3 s still counts
        (3.5, 3.5)
        >>> b.stretch([0], 0.4, 0.25)                             # until the link recovers
        1.0
        """
        self.flights.update({fragment: exchange_seconds for fragment in fragments})
        wanted = max(self.flights.values(), default=0.0) + 2 * slowest_step_seconds
        self.stretched = wanted if self.seconds > 0 and wanted > self.seconds else 0.0
        return self.current()


@dataclass(frozen=True)
class Boundaries:
    """Where Trainer's saves and evaluations fall when the step a sync lands at is known only as it lands
    (time-budget rounds: every replica continues at the furthest one's step): at a multiple of `eval_steps` or
    `save_steps` passed in the steps (before, now], at every `save_every_syncs`-th sync, and at the run's end.
    0 turns a rule off. The same value on every replica: Trainer's resolved intervals and the configuration
    (hf_diloco.diloco_callback builds it); the fixed group's agreement asks it where a sync must land at one step
    everywhere.

    >>> rule = Boundaries(eval_steps=10, save_steps=25, eval_delay=0, save_every_syncs=0, max_steps=100)
    >>> rule.steps_due(8, 12), rule.steps_due(20, 26), rule.steps_due(97, 100), rule.steps_due(1, 5)
    ((True, False), (False, True), (True, True), (False, False))
    >>> Boundaries(0, 0, 0, save_every_syncs=4, max_steps=100).wanted(40, 45, sync=8)
    True
    """

    eval_steps: float
    save_steps: float
    eval_delay: float
    save_every_syncs: int
    max_steps: int

    def steps_due(self, before: int, now: int) -> tuple[bool, bool]:
        """(evaluate, save): whether a multiple of eval_steps / save_steps lies in the steps (before, now], or now
        is the end."""
        def passed(every: float) -> bool:
            return bool(every) and (now // every > before // every or now >= self.max_steps)

        return now >= self.eval_delay and passed(self.eval_steps), passed(self.save_steps)

    def at(self, before: int, now: int, sync: int) -> tuple[bool, bool]:
        """(evaluate, save) at sync number `sync`, agreed at step `now` after the last boundary at `before`: the
        step rules, and a save every save_every_syncs syncs and at the end."""
        evaluate, save = self.steps_due(before, now)
        every = self.save_every_syncs
        return evaluate, save or (bool(every) and (sync % every == 0 or now >= self.max_steps))

    def wanted(self, before: int, now: int, sync: int) -> bool:
        """Whether a save or an evaluation falls at that sync."""
        return any(self.at(before, now, sync))


@dataclass
class Schedule:
    """The sync schedule of a run: from step `origin_step` (sync number `origin_sync`) one fragment syncs every
    `inner_steps / num_fragments` steps. Fixed for a run, except once with inner_steps auto, which starts a new
    schedule at the step it decides. Each fragment's sync lands `delay(fragment)` steps after its launch: the run's
    sync_delay, or what sync_delay auto chose for it from its measured exchanges.

    >>> s = Schedule(inner_steps=4, num_fragments=2)
    >>> [s.due_fragments(step, max_steps=9) for step in range(1, 10)]
    [[], [0], [], [1], [], [0], [], [1], [0, 1]]
    >>> s.sync_at(8), s.total_syncs(9), s.round_of(4), s.round_of(5)
    (4, 5, 2, 3)
    """

    inner_steps: int
    num_fragments: int = 1
    origin_step: int = 0
    origin_sync: int = 0
    end: FinalWindow | None = None  # the staggered end, once `stagger_end` placed it
    sync_delay: int = 0  # τ the run asked for; a fragment keeps it until sync_delay auto chooses its own
    delays: dict[int, int] = field(default_factory=dict)  # τ of each fragment chosen by sync_delay auto
    measured: set[int] = field(default_factory=set)  # fragments whose τ came from their own measured exchange
    exchanged: tuple[list[int], float] = ([], 0.0)  # the last exchange's fragments and seconds in flight
    auto_choice: dict | None = None  # the inner_steps auto decision, once made
    budget: TimeBudget = field(default_factory=TimeBudget)  # time-budget rounds (round_seconds)

    @property
    def sync_every(self) -> int:
        return self.inner_steps // self.num_fragments

    def delay(self, fragment: int) -> int:
        """τ of `fragment`'s next sync: sync_delay, or what sync_delay auto chose for it."""
        return self.delays.get(fragment, self.sync_delay)

    def launch_delay(self, step: int, fragments: list[int]) -> int:
        """τ of the sync launched at `step` over `fragments`: the final window's, else the longest of theirs."""
        return self.final_delay(step) or max(self.delay(f) for f in fragments)

    def fragments_of_sync(self, number: int, total: int | None, last: bool) -> list[int]:
        """The fragments sync `number` carries when syncs are counted rather than placed at steps (torchft): one in
        turn, or all of them in the run's last sync or when a participant is at its last step.

        >>> Schedule(inner_steps=4, num_fragments=2).fragments_of_sync(3, total=5, last=False)
        [0]
        >>> Schedule(inner_steps=4, num_fragments=2).fragments_of_sync(5, total=5, last=False)
        [0, 1]
        """
        if last or (total is not None and number >= total):
            return list(range(self.num_fragments))
        return [(number - 1) % self.num_fragments]

    def due_fragments(self, step: int, max_steps: int) -> list[int]:
        """Fragments whose sync is launched at `step`: every fragment at the last step, or with a staggered end
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
        return [(self.sync_at(step) - 1) % self.num_fragments]

    def sync_at(self, step: int) -> int:
        """The number of the sync launched at `step`, counted from 1."""
        if self.end is not None and step in self.end.launches:
            return self.end.launches[step][1]
        return self.origin_sync + math.ceil((step - self.origin_step) / self.sync_every)

    def round_of(self, sync: int) -> int:
        """The round sync number `sync` belongs to: F syncs make a round."""
        return math.ceil(sync / self.num_fragments)

    def name_sync(self, sync: int) -> str:
        """How the logs name sync number `sync`: "round 3" where a sync is a round, else "sync 5 (round 3)"."""
        return f"round {sync}" if self.num_fragments == 1 else f"sync {sync} (round {self.round_of(sync)})"

    def total_syncs(self, max_steps: int) -> int | None:
        """How many syncs the run launches, as placed now (None before a step count is known)."""
        if self.end is not None:
            return max(number for _, number, _ in self.end.launches.values())
        return self.sync_at(max_steps) if max_steps > 0 else None

    def restart_at(self, step: int, inner_steps: int) -> None:
        """A new H from `step` on (the sync launched at `step` keeps its number)."""
        self.origin_sync, self.origin_step = self.sync_at(step), step
        self.inner_steps = inner_steps

    def final_delay(self, step: int) -> int | None:
        """τ of the final-window sync launched at `step` (it lands as the next is launched), else None."""
        if self.end is None or step not in self.end.launches:
            return None
        return self.end.launches[step][2]

    def stagger_end(self, max_steps: int, delays: list[int], busy_until: int = 0) -> bool:
        """Place the staggered end for the fragments' τ `delays` (see the module's docstring), after step
        `busy_until` (where the exchange in flight lands; every sync launched before it is kept). A window that
        has begun by then stays as it is. Where Σ τ no longer fits between `busy_until` and the last step (τ grew
        after the window was first placed), the window starts at `busy_until` and its syncs get shorter τ, the
        longest shortened first: they wait for the rest of their exchange, the end is still staggered. Returns
        False, and leaves the blocking end, where the window does not fit (a first placement never shortens τ).

        >>> s = Schedule(inner_steps=6, num_fragments=3)       # one fragment every 2 steps, τ = 1 each
        >>> s.stagger_end(13, [1, 1, 1])
        True
        >>> [(step, s.due_fragments(step, 13)) for step in range(1, 14) if s.due_fragments(step, 13)]
        [(2, [0]), (4, [1]), (6, [2]), (8, [0]), (10, [1]), (11, [2]), (12, [0])]
        >>> s.sync_at(10), s.sync_at(11), s.sync_at(12), s.total_syncs(13), s.final_delay(12)
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
        # The regular syncs kept are those launched before the exchange in flight lands and those that land by
        # the window's start; the window goes on in their order.
        last_regular = self.origin_step
        step = self.origin_step + self.sync_every
        while step < window and (step < busy_until or
                                 step + delays[(self.sync_at(step) - 1) % self.num_fragments] <= window):
            last_regular, step = step, step + self.sync_every
        kept = self.sync_at(last_regular) if last_regular > self.origin_step else self.origin_sync
        launches, at = {}, window
        for j in range(self.num_fragments):
            fragment = (kept + j) % self.num_fragments
            launches[at] = (fragment, kept + 1 + j, delays[fragment])
            at += delays[fragment]
        self.end = FinalWindow(launches=launches, last_regular=last_regular)
        return True


    def place_end(self, max_steps: int, busy_until: int = 0) -> bool:
        """`stagger_end` for every fragment's current τ (placed anew when an auto choice changes τ or H, until the
        window begins)."""
        return self.stagger_end(max_steps, [self.delay(f) for f in range(self.num_fragments)], busy_until)

    # --- the auto choices: every number comes from a sync's statistics, which every replica received alike ---

    def choose_inner_steps_at(self, step: int, *, step_seconds: float, sync_seconds: float,
                              max_sync_overhead: float) -> dict:
        """inner_steps auto (see `choose_inner_steps`): the new H, in force from `step` (the launch step of the sync
        whose statistics decided it). Returns the decision, as the sync's record shows it.

        >>> s = Schedule(inner_steps=20)
        >>> s.choose_inner_steps_at(40, step_seconds=0.1, sync_seconds=0.5, max_sync_overhead=0.05)["chosen"]
        100
        >>> s.due_fragments(140, max_steps=1000), s.sync_at(140)
        ([0], 3)
        """
        chosen = choose_inner_steps(step_seconds, sync_seconds, num_fragments=self.num_fragments,
                                    sync_delay=self.sync_delay, max_sync_overhead=max_sync_overhead)
        self.restart_at(step, chosen)
        self.auto_choice = {"step_seconds": step_seconds, "sync_seconds": sync_seconds,
                            "max_sync_overhead": max_sync_overhead, "chosen": chosen, "from_step": step}
        return self.auto_choice

    def choose_delays(self, fragments: list[int], *, exchange_seconds: float, step_seconds: float,
                      sizes: list[int], most: int | None = None) -> dict:
        """sync_delay auto for `fragments` (those of the exchange that took `exchange_seconds`): see
        `choose_sync_delay` (`most`: the largest τ allowed, H/F − 1 unless given). A fragment not measured yet takes
        the τ that the same exchange, scaled by its size (`sizes`: values each fragment syncs), would need, so that
        on a slow link only the first fragment's first sync waits for its transfer. Returns the decision, as the
        sync's record shows it.

        >>> s = Schedule(inner_steps=20, num_fragments=2, sync_delay=1)
        >>> s.choose_delays([0], exchange_seconds=0.25, step_seconds=0.1, sizes=[100, 300])
        {'fragments': [0], 'exchange_seconds': 0.25, 'step_seconds': 0.1, 'chosen': 3, 'estimated': {'1': 8}}
        >>> s.delay(0), s.delay(1)
        (3, 8)
        """
        most = self.sync_every - 1 if most is None else most
        chosen = choose_sync_delay(exchange_seconds, step_seconds, most=most)
        for fragment in fragments:
            self.delays[fragment] = chosen
        self.measured.update(fragments)
        measured_size = sum(sizes[f] for f in fragments)
        estimated = {}
        for fragment in range(self.num_fragments):
            if fragment not in self.measured and measured_size > 0:
                scaled = exchange_seconds * sizes[fragment] / measured_size
                self.delays[fragment] = estimated[str(fragment)] = choose_sync_delay(scaled, step_seconds, most=most)
        choice = {"fragments": fragments, "exchange_seconds": exchange_seconds, "step_seconds": step_seconds,
                  "chosen": chosen}
        if estimated:
            choice["estimated"] = estimated
        return choice

    def exchange_measured(self, fragments: list[int], seconds: float) -> None:
        """The sync of `fragments` was in flight `seconds` (the backend's start and the exchange): what sync_delay
        auto's next choice for them covers, sent with the next sync's statistics."""
        self.exchanged = (list(fragments), float(seconds))

    # --- what a checkpoint keeps ---

    def state_dict(self) -> dict:
        """What the auto choices and the staggered end decided (empty when nothing was decided at run time).

        >>> s = Schedule(inner_steps=6, num_fragments=3, sync_delay=1)
        >>> s.place_end(13)
        True
        >>> t = Schedule(inner_steps=6, num_fragments=3, sync_delay=1)
        >>> t.load_state_dict(s.state_dict(), staggered=True)
        >>> t.end == s.end
        True
        """
        state: dict = {}
        if self.delays:
            state["sync_delays"] = {"delays": dict(self.delays), "exchanged": list(self.exchanged),
                                    "measured": sorted(self.measured), "stretched_budget": self.budget.stretched}
        if self.end is not None:  # the staggered end as placed, which stays once the last H steps begin
            state["final_window"] = {"launches": {str(k): list(v) for k, v in self.end.launches.items()},
                                     "last_regular": self.end.last_regular}
        if self.auto_choice is not None:  # the schedule inner_steps auto chose goes on after a resume
            # (the sync number keeps its older checkpoint key, origin_round, so checkpoints load across versions)
            state["schedule"] = {"origin_step": self.origin_step, "origin_round": self.origin_sync,
                                 "inner_steps": self.inner_steps, "choice": self.auto_choice}
        return state

    def load_state_dict(self, state: dict, staggered: bool) -> None:
        """A checkpoint's decisions (see `state_dict`); its final window only where the run still ends staggered."""
        if "schedule" in state:
            saved = state["schedule"]
            self.origin_step, self.origin_sync = saved["origin_step"], saved["origin_round"]
            self.inner_steps, self.auto_choice = saved["inner_steps"], saved["choice"]
        if "sync_delays" in state:
            saved = state["sync_delays"]
            self.delays = {int(f): int(d) for f, d in saved["delays"].items()}
            fragments, seconds = saved["exchanged"]
            self.exchanged = (list(fragments), float(seconds))
            self.measured = set(saved.get("measured", self.delays))
            self.budget.stretched = float(saved.get("stretched_budget", 0.0))
        if "final_window" in state and staggered:
            window = state["final_window"]
            self.end = FinalWindow(launches={int(k): tuple(v) for k, v in window["launches"].items()},
                                   last_regular=int(window["last_regular"]))


@dataclass
class FinalWindow:
    """A staggered end: launch step -> (fragment, sync number, τ), and the last regular sync's launch step."""

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

    with t_exchange the longest any replica's last exchange of that fragment took (for an overlapped sync, all its
    time in flight: the backend's start, such as torchft's quorum, and the exchange) and t_step the slowest
    replica's seconds per inner step.

    >>> choose_sync_delay(0.25, 0.1, most=9)      # 2.5 steps of compute cover the transfer: 3
    3
    >>> choose_sync_delay(0.01, 0.1, most=9), choose_sync_delay(5.0, 0.1, most=9)
    (1, 9)
    """
    wanted = math.ceil(exchange_seconds / step_seconds - 1e-9) if step_seconds > 0 else most
    return max(1, min(most, wanted))
