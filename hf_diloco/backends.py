"""Who takes part in a sync: the backends.

A sync (hf_diloco.engine: launch, then land; hf_diloco.fragments: pseudo-gradient, codec with error feedback,
outer step, copy back) is the same code whatever the backend. A backend answers who takes part, and supplies the
collectives under the sync (its `comm`):

    torch     `FixedGroup`: the processes of one launch, a fixed set; every replica takes part in every sync,
              and a sync is a barrier (a replica that never arrives ends the run after sync_timeout). With H steps
              a round, every replica has weight 1 and fragments follow the step schedule. With a time budget
              (`round_seconds`), each replica syncs when its budget is spent, after however many steps it took:
              one small all-reduce first agrees on the weights (each replica's tokens, relative to the most), the
              fragments (in turn, every one once a replica reached max_steps) and the step every replica continues
              at (the furthest one's), so that saves, evaluations and the end fall at the same step everywhere.
              With sync_delay > 0 that agreement runs in the overlapped sync's background thread, before its
              exchange, so a replica that spent its budget trains on while the others arrive, and each lands it at
              τ or once its exchange is done. Where it finds a save or an evaluation, the sync overlaps all the
              same and every replica lands it after exactly its τ of its own steps (`SyncStart.lands_together`),
              all continue at the furthest one's step plus the longest τ, and the save falls there, with nothing
              in flight;
              where it finds a stop or the end (or a window so near max_steps that τ would pass it), the sync is
              called off before anything is exchanged and every replica agrees again, blocking, where it would
              have landed (the steps it took stay in its Δ_i), so that these fall at one step everywhere.
    torchft   `hf_diloco.torchft_backend.TorchftQuorum`: a Lighthouse quorum per round, participants only, token and
              staleness weights, a vote (commit or roll back) after the collectives, healing of a replica that is
              behind.

Both extend `Backend`, which holds the rules they share (when a time-budget sync is due, where every replica
continues after a sync, a replica's weight relative to the largest); what each adds is who takes part (the fixed
group's agreement; torchft's quorum, vote and heal). None reads or writes the Trainer's or the callback's state:
each answers with values (`SyncStart` before a sync's collectives, `Verdict` after its vote), and the engine hands
them on.

    due(step, max_steps, progress)     is a sync due now (`progress`: this replica's steps since its last launch)
    expected_fragments(step, max_steps, local)
                                       the fragments the sync due now is expected to carry (an overlapped sync
                                       snapshots them before it starts; `local`: this replica's numbers)
    start(step, max_steps, local, expected, joining, overlapped) -> SyncStart
                                       who takes part, with what weight, which fragments (`local`: this replica's
                                       numbers; torchft agrees on the fragments after the quorum); the joining
                                       sync before the first inner step makes the replicas' parameters
                                       identical. May run in an overlapped sync's background thread.
    finish(start, result, tokens, step) -> Verdict
                                       after the vote: whether this replica starts again from θ_global, the
                                       step every replica continues at, and the sync's number and membership for
                                       its record (which the engine builds)
    may_overlap()                      whether the sync being launched may run in the background (sync_delay > 0)
    take_window()                      the agreed (before, now, sync) where saves and evaluations are decided
    joined(start, step), run_over(), linger(step, max_steps), shutdown(), state_dict() / load_state_dict(state)
                                       (what a checkpoint keeps of the backend)
    replica, num_replicas, continues_record (a restarted replica appends to its record instead of cutting it at
                                       the checkpoint)
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch

from .comm import ReplicaComm
from .errors import RunError
from .schedule import Boundaries, Schedule

# No replica's merge weight is more than this many times the median one's (bounded_shares): replicas of unequal
# speed fit inside it (under time budgets one round of a CPU-quota'd replica has held a tenth of a fast one's
# steps, and a GPU generation apart is about 10x), one that claims a trillion tokens does not. The bound trades
# the two: at 64, a liar among two replicas still takes 64/65 of one merge, among eight 64/71.
WEIGHT_LIMIT = 64


def bounded_shares(claimed: list[float]) -> list[float]:
    """The replicas' merge weights (tokens, or tokens over staleness) as they claimed them, bounded so that one
    replica that lies about its progress cannot outweigh the rest: a negative or NaN claim counts 0, and none
    counts more than WEIGHT_LIMIT times the median positive one (the lower median: with two replicas, the
    smaller). Every replica computes this from the same table, so all agree.

    >>> bounded_shares([4096.0, 2048.0, 1e12, -5.0, 5.0, float("nan")])
    [4096.0, 2048.0, 131072.0, 0.0, 5.0, 0.0]
    """
    claimed = [w if w >= 0 else 0.0 for w in claimed]  # (NaN fails the comparison)
    positive = [w for w in claimed if w > 0]
    limit = WEIGHT_LIMIT * statistics.median_low(positive) if positive else 0.0
    return [min(w, limit) for w in claimed]


@dataclass(frozen=True)
class SyncStart:
    """What a backend decided before a sync's collectives; immutable once made (the gate's verdict makes a new one:
    hf_diloco.gate.Gate.judge)."""

    weight: float = 1.0  # this replica's share in the average, relative to the largest (1: plain mean)
    fragments: list[int] = field(default_factory=list)  # the fragments this sync carries, the same on every replica
    empty: bool = False  # no participant brings any progress (every one joins): nothing to exchange, only the vote
    stash: list[torch.Tensor] | None = None  # Δ_i of every bucket, taken against the base a healed replica left
    healed: bool = False  # this replica took θ_global from a live peer in this sync's quorum
    finite: bool = True  # this replica's own parameters were finite when the sync started
    joining: bool = False  # the sync before this replica's first inner step
    stop_requested: bool = False  # a participant asked to stop (known before the collectives)
    participants: list[dict] = field(default_factory=list)  # one membership row per participant (torchft)
    quorum_seconds: float = 0.0  # time spent forming the quorum (blocked time)
    extra_bytes: int = 0  # bytes of the membership exchange, beside the sync's own
    error: str | None = None  # why the quorum failed, when it did
    startup_bytes: int | None = None  # a joining sync: bytes sent to make every replica's parameters identical
    excluded: dict[int, str] = field(default_factory=dict)  # replicas a contribution check found out, and why
    called_off: bool = False  # the fixed group's agreement found a stop or the end: this overlapped sync exchanges
    # nothing, and every replica launches a blocking one where it would have landed
    lands_together: bool = False  # the fixed group's agreement found a save or an evaluation in this overlapped
    # sync: every replica lands it after exactly its τ of its own steps (waiting for the exchange if it is not done),
    # all continue at one step, and none launches more at that step: the save finds nothing in flight
    continue_at: int | None = None  # a late replica healed from a peer: it continues at the peer's step


@dataclass
class Verdict:
    """A backend's word on a sync after its vote (`finish`), which the engine's record of the sync is built from."""

    restart: bool = False  # this replica starts again from θ_global
    continue_at: int | None = None  # every replica continues at this step (the furthest one's), when it moved
    sync: int | None = None  # the sync's number, where the backend counts them (else its step's: Schedule.sync_at)
    step: int | None = None  # the step its record is placed at (else the step it landed at)
    launch_step: int | None = None  # the step its record names as its launch (else the replica's own)
    membership: dict | None = None  # torchft: who took part and the vote (records.quorum_record's arguments)


@dataclass
class Agreement:
    """What a time-budget sync of the fixed group agreed on before its exchange (`FixedGroup.expected_fragments`)."""

    step: int  # the step every replica continues at after the sync: the furthest replica's
    launched_at: int  # this replica's own step when it launched
    last: bool  # a replica reached max_steps: every fragment syncs and the run ends
    weight: float  # this replica's tokens relative to the most any replica trained
    fragments: list[int]
    bytes_sent: int  # what the agreement's all-reduce cost this process
    window: tuple[int, int, int] | None = None  # (previous agreed step, this one, sync number) where a save or an
    # evaluation falls: every replica lands this sync at the same step (blocking, or overlapped and landed together)
    called_off: bool = False  # an overlapped sync's agreement found a stop or the end: nothing is exchanged
    lands_together: bool = False  # an overlapped sync with a window: each replica lands it after exactly its τ
    landing: int = 0  # then the longest τ: every replica continues at `step` + this


class Backend:
    """What both backends share: the replica's `comm`, θ_global (`outer`), the run's `schedule` and length, and the
    rules that do not depend on who takes part."""

    continues_record = False  # a resumed launch retrains the syncs after its checkpoint: they leave the record

    def __init__(self, comm: ReplicaComm, outer, schedule: Schedule, max_steps: int):
        self.comm = comm
        self.outer = outer
        self.schedule = schedule
        self.max_steps = max_steps
        self.agrees_windows = False  # whether an overlapped sync's start may say it lands together (FixedGroup)
        # The run's count of syncs that moved θ_global, where the backend numbers its syncs (torch with time budgets:
        # checkpointed; torchft: healed from a live peer with θ_global). With rounds of H steps on the torch backend
        # a sync's number is its step's (Schedule.sync_at).
        self.syncs = 0

    def budget_due(self, progress) -> bool:
        """A time-budget sync is due: this replica's budget is spent (engine.Progress.budget_spent). The members of
        a replica agree, so they enter the sync at the same step."""
        return self.comm.control.members_any(progress.budget_spent(self.schedule.budget))

    def continued_step(self, furthest: int, launched_at: int, step: int, over: bool = False) -> int:
        """Where a replica continues after a sync that landed at its `step`: at the furthest participant's step,
        plus the steps it took while the sync was in flight since its launch at `launched_at` (none once the run is
        `over`), never past max_steps. A replica already further keeps its step."""
        return max(step, min(self.max_steps, furthest + (0 if over else step - launched_at)))

    @staticmethod
    def relative_weight(mine: float, largest: float, when_nobody: float) -> float:
        """A replica's weight relative to the largest of the sync (`when_nobody` when no one brought any)."""
        return mine / largest if largest > 0 else when_nobody

    def may_overlap(self) -> bool:
        return True

    def take_window(self) -> tuple[int, int, int] | None:
        """The agreed (previous agreed step, this one, sync number) of the sync that landed last, once, where the
        glue decides saves and evaluations; None where syncs do not agree on one."""
        return None

    def joined(self, start: SyncStart, step: int) -> None:
        pass

    def linger(self, step: int, max_steps: int) -> list[int]:
        return []

    def shutdown(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class FixedGroup(Backend):
    """The `torch` backend: every process of the launch, every sync (see the module docstring for time-budget
    rounds)."""

    def __init__(self, comm: ReplicaComm, outer, schedule: Schedule, resumed: bool, *, max_steps: int = 0,
                 overlap: bool = False, step: int = 0, boundaries: Boundaries | None = None):
        super().__init__(comm, outer, schedule, max_steps)
        self.resumed = resumed
        self.overlap = overlap  # sync_delay > 0: a sync lands τ or more of each replica's own steps after its launch
        # Where saves and evaluations fall (time-budget rounds: such a sync lands at one step everywhere);
        # `previous_step`: the last sync's agreed step
        self.boundaries = boundaries
        self.agrees_windows = boundaries is not None  # its overlapped syncs may land together (SyncStart)
        self.previous_step = step
        self.window: tuple[int, int, int] | None = None  # the window of the sync that landed last, if it had one
        self.over = False  # a time-budget run's last sync landed
        self.agreed: Agreement | None = None
        self.pending: tuple[int, float, bool, bool] | None = None  # an overlapped launch's numbers, agreed in `start`
        self.called_off: Agreement | None = None  # the agreement that called the last sync off, until agreed again

    @property
    def replica(self) -> int:
        """This replica's id, as records and verdicts name it: on a fixed group, its index among the launch's
        replicas (global rank // replica_group_size)."""
        return self.comm.replica_index

    @property
    def num_replicas(self) -> int:
        return self.comm.num_replicas

    def due(self, step: int, max_steps: int, progress=None) -> bool:
        if not self.schedule.budget:  # rounds of H steps (no round_seconds: schedule.budget is falsy)
            return bool(self.schedule.due_fragments(step, max_steps))
        if self.over:  # the last sync landed (a called-off sync's blocking one may have been the last)
            return False
        return step >= max_steps or self.budget_due(progress)

    def expected_fragments(self, step: int, max_steps: int, local: dict | None = None) -> list[int]:
        if not self.schedule.budget:
            return self.schedule.due_fragments(step, max_steps)
        local = local or {}
        mine = (step, local.get("tokens", 0), step >= max_steps, bool(local.get("stop_requested")))
        if self.overlap and step < max_steps and self.called_off is None:
            # Agreed in the background thread (`start`), so this replica trains on while the others arrive; the
            # fragments go in turn (a sync that turns out to be the last is called off there).
            self.pending = mine
            return self.schedule.fragments_of_sync(self.syncs + 1, None, False)
        agreed = self._agree(*mine)
        if agreed.called_off:  # the others call this sync off in their background threads: agree again, here
            agreed = self._agree(*mine)
        return agreed.fragments

    def _agree(self, step: int, tokens: float, at_end: bool, stop: bool) -> Agreement:
        """The agreement's all-reduce: every replica's tokens, step, whether it reached max_steps and whether it
        asks to stop, and the τ it would land an overlapped sync after. With sync_delay > 0 an agreement that finds a
        save or an evaluation keeps its sync overlapped and has every replica land it after exactly its τ of its own
        steps (`lands_together`: all then continue at the furthest one's step plus the longest τ, where the save
        falls), if that is before max_steps; one that finds a stop or the
        end (or a window too near max_steps) calls its sync off (and is kept: the next agreement honours it), unless
        it follows one that did: a stop and the end fall at one step everywhere."""
        # τ this replica lands an overlapped sync after (its own, from its own step time with sync_delay auto)
        tau = self.schedule.launch_delay(step, self.schedule.fragments_of_sync(self.syncs + 1, None, False)) \
            if self.overlap else 0
        table, sent = self.comm.control.replica_table(tokens, [float(step), float(at_end), float(stop), float(tau)])
        before, self.called_off = self.called_off, None
        last = bool(table[:, 2].any()) or (before is not None and before.last)
        stopping = bool(table[:, 3].any())
        shares = bounded_shares(table[:, 0].tolist())  # each replica's tokens since its last sync
        now, most = int(table[:, 1].max()), max(shares)
        window = (self.previous_step, now, self.syncs + 1)
        boundary = self.boundaries is not None and self.boundaries.wanted(*window)
        fragments = self.schedule.fragments_of_sync(self.syncs + 1, None, last)
        overlapped = self.overlap and before is None  # an overlapped launch's agreement, or the end's first
        # Landed together, every replica continues at the furthest one's step plus the longest τ (each lands after
        # its own τ, so none waits for another's)
        landing = int(table[:, 4].max())
        together = overlapped and boundary and not (last or stopping) and now + landing < self.max_steps
        wanted = last or before is not None or stopping or boundary
        agreed = Agreement(step=now, launched_at=step, last=last,
                           weight=self.relative_weight(shares[self.replica], most, when_nobody=1.0),
                           fragments=fragments, bytes_sent=sent + (before.bytes_sent if before is not None else 0),
                           window=window if wanted else None, called_off=wanted and overlapped and not together,
                           lands_together=together, landing=landing if together else 0)
        if agreed.called_off:
            self.called_off = agreed
        else:
            self.agreed, self.previous_step = agreed, now
        return agreed

    def may_overlap(self) -> bool:
        """Whether the sync being launched may run in the background: not where a save or an evaluation falls, nor
        the last one (every replica must land it at the same step)."""
        return self.agreed is None or self.agreed.window is None

    def start(self, step: int, max_steps: int, local: dict, expected: list[int], joining: bool = False,
              overlapped: bool = False) -> SyncStart:
        if not joining:
            if self.pending is not None:  # an overlapped launch: its agreement, in the background thread
                pending, self.pending = self.pending, None
                if self._agree(*pending).called_off:
                    return SyncStart(called_off=True)
            if self.agreed is None:
                return SyncStart(fragments=expected)
            return SyncStart(fragments=expected, weight=self.agreed.weight, extra_bytes=self.agreed.bytes_sent,
                             lands_together=self.agreed.lands_together)
        # The replicas must start from identical parameters: checked by digest before the first inner step, and
        # rank 0's sent only where they differ (comm.ReplicaComm.start_identical), in the same all-reduce as the
        # step each process starts at; θ_global is then taken again.
        cost, (lowest, highest) = self.comm.start_identical(self.outer.params, step, resumed=self.resumed)
        if lowest != highest:
            raise RunError(
                f"the processes of this launch start at different steps ({lowest} and {highest}): they resumed from "
                f"different checkpoints, or some from none, as when each machine has its own output_dir folder; put "
                f"output_dir on a filesystem every machine shares, or set save_on_each_node: true so that each "
                f"machine keeps every checkpoint itself.")
        if self.resumed:  # every replica loaded the same checkpoint (the same step, just agreed) and keeps it
            return SyncStart(empty=True, joining=True)  # (startup_bytes would make it take θ_global: the check's
            # 144 bytes go unrecorded here)
        self.outer.take_replica()
        return SyncStart(empty=True, joining=True, startup_bytes=cost.bytes_sent)

    def finish(self, start: SyncStart, result, tokens: int = 0, step: int = 0) -> Verdict:
        """A time-budget sync: every replica continues at the furthest one's step, plus the steps it took while an
        overlapped sync was in flight (it lands at τ, or once its exchange is done: SyncEngine.lands_now), as on
        torchft (`continued_step`); its record is placed at that step, under the sync's number. Saves and
        evaluations fall only at syncs every replica lands at one step: blocking ones, and overlapped ones landed
        together."""
        agreed, self.agreed = self.agreed, None
        if agreed is None:
            return Verdict()
        self.syncs += 1
        self.over = agreed.last
        self.window = agreed.window
        moved = max(step, agreed.step + agreed.landing) if agreed.lands_together else \
            self.continued_step(agreed.step, agreed.launched_at, step)
        return Verdict(continue_at=moved if moved > step else None, sync=self.syncs, step=moved,
                       launch_step=agreed.step if moved != agreed.step else None)

    def take_window(self) -> tuple[int, int, int] | None:
        window, self.window = self.window, None
        return window

    def run_over(self) -> bool:
        return self.over

    def state_dict(self) -> dict:
        return {"syncs": self.syncs} if self.schedule.budget else {}

    def load_state_dict(self, state: dict) -> None:
        self.syncs = int(state.get("syncs", 0))
