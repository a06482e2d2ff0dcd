"""The sync engine: every sync of every backend is `launch`, then `land`.

    launch(step)   the backend says who takes part (torch: every replica; torchft: the quorum, its weights, a heal);
                   an overlapped sync's fragments take their Δ_i, sent in the background (hf_diloco.fragments.exchange)
    land(flight)   a blocking sync runs Algorithm 1 through its fragments' verbs, Δ_i, the average (the network),
                   the outer step and the copy back one bucket at a time (hf_diloco.fragments.outer_round); an
                   overlapped one waits for its exchange, then its fragments step and copy back
                   (hf_diloco.fragments.land), or nothing when the backend's vote rolled the sync back; then the
                   sync's numbers go to the records

A blocking sync lands at the step it was launched. An overlapped sync (sync_delay τ > 0) takes its Δ_i at launch,
runs the backend's start and the exchange in a background thread while the replica trains on, and lands τ steps
later (or at the last step): one exchange is in flight at a time. A sync in which nobody brings progress (every
participant joins) lands a vote alone. Before the first inner step
each replica runs a joining sync: the backend makes the replicas start from identical parameters (torch: a digest
check and a broadcast where they differ; torchft: the quorum, where a late replica heals).

Who decides what (the engine only sequences them):
    fragments  each fragment's θ_global and θ_i, residuals, sync in flight, last sync, what its Δ_i covers, and
               the verbs of a sync (Δ_i, outer step, copy back)                      hf_diloco.fragments.Fragment
    schedule   which fragment is due at which step, with what τ                      hf_diloco.schedule.Schedule
    tuner      auto H, auto τ, where the staggered end falls                         hf_diloco.tuner.Tuner
    backend    who takes part, with what weight, the vote, healing                   hf_diloco.backends
    gate       contribution checks between launch and land: who is left out         hf_diloco.gate.Gate
    sync       Algorithm 1 over the fragments a sync carries (outer_round; exchange and land)
                                                                                     hf_diloco.fragments
    outer      θ_global, the outer optimizer and its checkpoint                      hf_diloco.outer.OuterState
    health     a replica that is not finite restarts from θ_global; a run of them ends  hf_diloco.health.Health
    records    the sync's record, trackers and the summary                           hf_diloco.records.Records
The engine is handed the replica's parameters, its inner optimizer, its communicator and (contribution_loss_check)
a held-out loss, never the Trainer: `join` and `sync` answer with a `SyncOutcome` (whether a sync landed, a stop,
the step every replica continues at, the window where saves and evaluations fall, the run's end), which the
Trainer callback (hf_diloco.diloco_callback) applies to Trainer's state and control.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from .backends import FixedGroup, SyncStart, Verdict
from .codecs import Codec, ErrorFeedback, make_codec
from .config import ConfigError, DiLoCoConfig
from .errors import first_line
from .fragments import (
    Exchange,
    Fragment,
    StatsFn,
    SyncResult,
    exchange,
    land,
    load_residuals,
    outer_round,
    outer_state_and_fragments,
    residuals_state,
    since_base,
    sync_device,
)
from .gate import Gate
from .health import Health
from .outer import OuterState, is_finite
from .records import Records, ReplicaStats, SyncStats, arrival_clock, quorum_record, sync_record
from .schedule import Boundaries, Schedule, TimeBudget
from .torchft_backend import TorchftQuorum
from .tuner import Tuner

logger = logging.getLogger(__name__)


class Progress:
    """This replica's inner steps since its last launch: what its next sync reports (local, no collective)."""

    def __init__(self):
        self.reset()

    def budget_spent(self, budget: TimeBudget) -> bool:
        """A time-budget sync is due (TimeBudget.spent): this replica's seconds since the budget began and its wall
        seconds per step so far tell when its next step would end.

        >>> progress = Progress()
        >>> progress.started = progress.origin = time.perf_counter() - 0.85
        >>> progress.steps = 2                                                  # 0.425 s a step so far
        >>> progress.budget_spent(TimeBudget(1.0)), progress.budget_spent(TimeBudget(1.1))  # a third ends at 1.275 s
        (True, False)
        """
        now = time.perf_counter()
        per_step = (now - self.started) / self.steps if self.steps else 0.0
        return budget.spent(now - self.origin, per_step)

    def align(self, moment: float) -> None:
        """Count the budget from `moment` (a perf_counter time) if later than the launch: the instant an overlapped
        sync's participants all took part (torchft: its quorum formed), the same on every replica, so a replica
        that launched early does not keep a head start on the others' budgets at every later sync."""
        self.origin = max(self.origin, moment)

    def absorb(self, earlier: Progress) -> None:
        """Count `earlier`'s steps (those before a launch that was called off) as this progress's own."""
        self.loss = self.loss + earlier.loss.to(self.loss.device)
        self.lr_sum += earlier.lr_sum
        self.steps += earlier.steps
        self.tokens += earlier.tokens
        self.examples += earlier.examples
        self.compute_seconds += earlier.compute_seconds
        self.started, self.origin = earlier.started, earlier.origin

    def reset(self) -> None:
        self.loss = torch.zeros(())
        self.lr_sum = 0.0  # Σ η over the steps (the contribution checks' `size` rule)
        self.steps = 0
        self.tokens = 0
        self.examples = 0  # the rows of its micro-batches (the contribution checks' `steps` rule)
        self.compute_seconds = 0.0
        self.step_started: float | None = None
        self.started = self.origin = time.perf_counter()  # origin: where the time budget counts from

    def micro_batch(self, loss: torch.Tensor, inputs: dict) -> None:
        if self.loss.device != loss.device:
            self.loss = self.loss.to(loss.device)
        self.loss += loss.detach().float()
        # What the merge weighs replicas by: tokens, or for a model without token inputs (an image classifier)
        # the examples it saw.
        units = None if not hasattr(inputs, "get") else next((inputs.get(key) for key in ("input_ids", "pixel_values")
                                                              if inputs.get(key) is not None), None)
        if units is not None:
            self.tokens += units.numel() if units.dim() <= 2 else units.shape[0]
            self.examples += units.shape[0] if units.dim() >= 2 else 1
        else:  # inputs it cannot count (a preference pair's): the `steps` rule leaves its rows alone
            self.examples = math.nan

    def step_began(self) -> None:
        self.step_started = time.perf_counter()

    def numbers(self, stop_requested: bool, finite: bool) -> dict:
        """This replica's numbers for the backend's start (torchft: its row of the membership table)."""
        return {"steps": self.steps, "tokens": self.tokens, "loss_sum": float(self.loss.item()),
                "compute_seconds": self.compute_seconds, "stop_requested": stop_requested, "finite": finite}

    def stats(self, stop_requested: bool, previous: tuple[float, float, float]) -> Callable[[float], torch.Tensor]:
        """This replica's statistics for the sync (they ride with its last collective), made once its
        pseudo-gradient norm is known. `previous`: the last sync's agreement, blocked and exchange seconds, known
        only after it landed, so they ride with this one."""
        agreement, blocked, exchange_seconds = previous
        mine = ReplicaStats(loss_sum=self.loss.item(), steps=self.steps, tokens=self.tokens,
                            compute_seconds=self.compute_seconds, stop_requested=float(stop_requested),
                            previous_agreement=agreement, previous_blocked_seconds=blocked,
                            previous_exchange_seconds=exchange_seconds, arrived=arrival_clock())

        def stats(local_norm_sq: float) -> torch.Tensor:
            mine.pseudo_grad_norm_sq = local_norm_sq
            return mine.tensor()

        return stats

    def step_ended(self, lr: float = 0.0) -> None:
        self.lr_sum += lr
        if self.step_started is not None:
            self.compute_seconds += time.perf_counter() - self.step_started
            self.step_started = None
        self.steps += 1


@dataclass
class Flight:
    """A launched sync, until it lands: blocking (`start` made at launch, the exchange run as it lands) or
    overlapped (`future` runs the backend's start and the exchange in the background)."""

    launched_at: int
    lands_at: int
    outer_lr: float
    measured: list[int]  # the fragments whose last exchange time this sync's statistics carry (sync_delay auto)
    began: float
    launch_seconds: float = 0.0  # time the inner loop spent launching an overlapped sync (its snapshot)
    future: Future | None = None
    start: SyncStart | None = None
    exchange: Exchange | None = None  # an overlapped sync's, once its background thread is done
    stats: StatsFn | None = None  # this replica's statistics, riding the sync's last collective
    checking: bool = False  # the contribution checks judge this sync (then a codec's decoded terms are measured)
    finite: bool = True  # this replica's parameters were finite at launch (else it sends zeros, with weight 0)
    exchange_began: float = 0.0
    exchanged: float = 0.0  # an overlapped sync: when its exchange finished in the background
    launched: dict[int, list[torch.Tensor]] | None = None  # overlap_landing eager: θ_i of its buckets at launch
    progress: Progress | None = None  # an overlapped sync: the replica's progress it was launched with
    in_flight_steps: int = 0  # an overlapped sync: the inner steps this replica took while it was in flight
    # An overlapped sync: set once the backend's start is known in the background thread (`started`), before the
    # exchange, so that the landing step can read whether every replica lands it together
    agreed: threading.Event = field(default_factory=threading.Event)
    started: SyncStart | None = None

    def lands_together(self, timeout: float) -> bool:
        """Whether the backend's start says every replica lands this overlapped sync after exactly τ steps (a
        save or an evaluation falls at it: hf_diloco.backends.FixedGroup), waiting for that start (the last
        replica's arrival) up to `timeout` s; False where the start failed (its error comes with the landing)."""
        self.agreed.wait(timeout)
        return self.started is not None and self.started.lands_together


def outer_settings(args: DiLoCoConfig) -> dict:
    """OuterState's settings from the configuration."""
    return dict(lr=args.outer_lr, momentum=args.outer_momentum, nesterov=args.outer_nesterov,
                optimizer=args.outer_optimizer, offload=args.offload_outer_state,
                momentum_delay=args.outer_momentum_delay, delayed_scale=args.outer_delayed_scale,
                momentum_restart=args.outer_momentum_restart, bucket_numel=max(1, int(args.sync_bucket_mb * 2**20 / 4)))


@dataclass(frozen=True)
class SyncOutcome:
    """What the syncs of one step did, for the Trainer glue to apply (`SyncEngine.sync`, `SyncEngine.join`)."""

    synced: bool = False  # a sync landed or was launched at this step
    stop: bool = False  # a replica asked to stop (known from a sync that landed)
    at_boundary: bool = False  # a sync landed and none is in flight: saves, evaluations and a stop may fall here
    continue_at: int | None = None  # this replica continues at this step (the furthest one's, or a healing peer's)
    window: tuple[int, int, int] | None = None  # time budgets, fixed group: the agreed (before, now, sync) of a
    # sync where a save or an evaluation falls
    run_over: bool = False  # the run's last sync landed: the replica holds the final model
    syncs_landed: int = 0  # syncs this process landed since it started


class SyncEngine:
    """One replica's side of the outer rounds: θ_global and the outer optimizer (`outer`), the fragments, the codec
    and its residuals, the sync in flight, and what the next sync's statistics carry. `announce`: this process
    prints the tuner's choices (the run's main process)."""

    def __init__(self, args: DiLoCoConfig, records: Records, announce: bool = False):
        self.args = args
        self.records = records
        self.schedule = Schedule(args.inner_steps, args.num_fragments, sync_delay=args.sync_delay,
                                 budget=TimeBudget(max(0.0, args.round_seconds) / args.num_fragments))
        self.codec: Codec | None = None if args.compression == "none" else make_codec(
            args.compression, chunk=args.compression_chunk, sparse_k=args.sparse_k, sparse_chunk=args.sparse_chunk,
            sparse_bits=args.sparse_bits)
        self.outer: OuterState | None = None
        self.fragments: list[Fragment] = []
        self.backend = None
        self.comm = None
        self.progress = Progress()
        self.executor: ThreadPoolExecutor | None = None
        self.in_flight: Flight | None = None
        self.stop_requested = False
        self.previous_agreement = float("nan")  # cos(Δ_i, Δ) of the last sync, sent with the next one
        self.previous_blocked = 0.0  # seconds the last sync kept this replica waiting, sent with the next one
        self.health = Health(args.max_bad_rounds, args.num_fragments)
        self.last_sync_tokens = 0  # tokens of the sync launched last (torchft carries them over a rollback)
        self.max_steps = 0
        self.inner_optimizer: torch.optim.Optimizer | None = None
        self.gate = Gate(args)
        self.tuner = Tuner(args, self.schedule, announce=announce)
        self.continue_at: int | None = None  # where this step's syncs moved the replica (a time budget, a heal)

    def request_stop(self) -> None:
        """This replica asks to stop: its next sync tells every replica, and all stop after it."""
        self.stop_requested = True

    # --- the start of training ---

    def begin(self, named: list[tuple[str, torch.nn.Parameter]], step: int, max_steps: int,
              outer_state: dict | None, replica_state: dict, *, comm, inner_optimizer: torch.optim.Optimizer,
              held_out_loss: Callable[[], float] | None = None, boundaries: Boundaries | None = None) -> None:
        """θ_global from the replica's parameters `named` (or the checkpoint's outer state), the fragments, the
        backend over the launch's `comm`, and what a resumed replica kept (its residuals, its parameters, the
        schedule's decisions). `inner_optimizer`: the replica's own (a replica that diverged starts its state
        afresh; the contribution checks read its kind and age); `held_out_loss`: the model's loss on a held-out
        batch now (contribution_loss_check); `boundaries`: where saves and evaluations fall (time-budget rounds on
        the fixed group, whose syncs there land at one step everywhere)."""
        args = self.args
        self.max_steps = max_steps
        self.inner_optimizer = inner_optimizer
        self.gate.attach(inner_optimizer, held_out_loss)
        residuals = "cpu" if args.offload_outer_state else comm.device
        feedback = (lambda: ErrorFeedback(args.error_feedback_decay, residuals)) if args.error_feedback else None
        try:
            self.outer, self.fragments = outer_state_and_fragments(named, args.num_fragments, args.fragment_pattern,
                                                                   feedback, **outer_settings(args))
        except ValueError as error:  # a fragment that would sync nothing, named
            raise ConfigError(str(error)) from None
        if args.outer_backend == "torchft":
            self.backend = TorchftQuorum(args, comm, self.outer, self.fragments, self.schedule, max_steps,
                                         resumed=outer_state is not None)
        else:
            self.backend = FixedGroup(comm, self.outer, self.schedule, outer_state is not None, max_steps=max_steps,
                                      overlap=args.sync_delay > 0, step=step, boundaries=boundaries)
        self.comm = self.backend.comm
        # FSDP2's row cuts tell each member which values it syncs; a tensor-parallel member syncs what it holds.
        self.comm.describe_buckets(None if args.tensor_parallel else self.outer.bucket_shapes(),
                                   self.outer.repeated_spans(self.comm.member % args.tp_size)
                                   if args.tensor_parallel else None)
        if outer_state is not None:
            try:
                self.outer.load_state_dict(outer_state)
            except ValueError as error:  # the checkpoint's outer state, named: another model's, or damaged
                raise ConfigError(f"{first_line(error)}; resume from a checkpoint of this run, or start afresh in "
                                  f"another output_dir.") from None
            self.take_global()
            self.load_state_dict(replica_state)
        self._place_end(step, max_steps, warn=True)

    def join(self, step: int) -> SyncOutcome:
        """The joining sync, before the first inner step: identical parameters everywhere (torchft: a heal, which
        may move a late replica to its peer's step: the outcome's `continue_at`)."""
        self.continue_at = None
        flight = self.launch(step, self.max_steps, joining=True)
        self.continue_at = flight.start.continue_at
        self.land(flight, self._step(step), self.max_steps)
        self.progress.reset()
        if self.comm.num_replicas > 1:
            self.gate.rebase()
        self.backend.joined(flight.start, step)
        return SyncOutcome(synced=True, continue_at=self.continue_at, run_over=self.backend.run_over(),
                           syncs_landed=self.tuner.syncs_landed)

    def take_global(self) -> None:
        """θ_i ← θ_global, every fragment (Fragment.take_global): a resumed replica, one that starts again, the
        run's final model."""
        for fragment in self.fragments:
            fragment.take_global()

    def _step(self, step: int) -> int:
        """This replica's step, as this step's syncs moved it."""
        return step if self.continue_at is None else max(step, self.continue_at)

    # --- the end of each inner step ---

    def sync(self, step: int, max_steps: int) -> SyncOutcome:
        """The syncs of this step: land the one in flight if it is due, then launch the one due now (a blocking
        one lands at once). The outcome says whether any landed or launched, whether a replica asked to stop
        (known from the syncs that landed), where this replica continues, and whether the run is over (then the
        replica holds the final model, θ_global)."""
        self.continue_at = None
        if self.backend.run_over():  # torchft: healed from a replica that finished the run
            self.take_global()
            return SyncOutcome(run_over=True, syncs_landed=self.tuner.syncs_landed)
        landing = self.lands_now(step, max_steps)
        together = landing and self.lands_together(step, max_steps)
        stop = bool(landing) and self.land(self.in_flight, step, max_steps)
        step = self._step(step)  # (a time-budget sync moves it: decide there)
        # Landed together (a save or an evaluation falls here): nothing is launched at this step, so nothing is in
        # flight when Trainer saves or evaluates; the next budget's sync launches at the next step.
        due = self.backend.due(step, max_steps, self.progress) and not self.exchanging(step, max_steps) and \
            not (together and step < max_steps)
        if due and self.in_flight is not None:  # a time-budget sync came due first: the one in flight (done) lands
            landing = True
            stop |= self.land(self.in_flight, step, max_steps)
            step = self._step(step)
            due = self.backend.due(step, max_steps, self.progress)
        if not landing and not due:
            return SyncOutcome(syncs_landed=self.tuner.syncs_landed)
        # A stop learned from a sync that landed ends training here: no new sync is launched to be left in flight.
        if due and not (stop and step < max_steps):
            flight = self.launch(step, max_steps)
            if flight.future is None:
                stop |= self.land(flight, step, max_steps)
        if self.backend.run_over() or (step >= max_steps and self.schedule.end is not None):
            # The run's last sync landed (the staggered end: every fragment's last): the final model is θ_global.
            self.take_global()
        at_boundary = self.in_flight is None  # (an agreed window is handed over at a boundary only)
        return SyncOutcome(synced=True, stop=stop, at_boundary=at_boundary, continue_at=self.continue_at,
                           window=self.backend.take_window() if at_boundary else None,
                           run_over=self.backend.run_over(), syncs_landed=self.tuner.syncs_landed)

    def lands_now(self, step: int, max_steps: int) -> bool:
        """Whether the sync in flight lands at `step`: τ steps after its launch, or at the last step. Under time
        budgets one whose exchange is still running then (it waits for the slowest participant, who may arrive half
        of its own step late) lands at a later step, once it is done, so the inner loop trains on instead of
        waiting (each replica then continues at the furthest one's step plus its own since the launch). The members
        of a replica land at the same step."""
        if self.in_flight is None or step < min(self.in_flight.lands_at, max_steps):
            return False
        return self.lands_together(step, max_steps) or not self.exchanging(step, max_steps)

    def lands_together(self, step: int, max_steps: int) -> bool:
        """Whether the overlapped sync in flight lands now whether or not its exchange is done: one whose start
        found a save or an evaluation (SyncStart.lands_together), at τ of this replica's own steps after its launch,
        so that every replica continues at one step."""
        flight = self.in_flight
        return self.backend.agrees_windows and flight is not None and flight.future is not None and \
            flight.lands_at <= step < max_steps and flight.lands_together(self.args.sync_timeout)

    def exchanging(self, step: int, max_steps: int) -> bool:
        """Under time budgets, whether the overlapped sync in flight is still exchanging before the last step: it
        lands once done, and the next sync that comes due meanwhile waits for it to land (an exchange slower than a
        budget, a slow link before sync_delay auto has stretched the budget to it), so the inner loop trains on
        instead of waiting at the landing; a sync's steps are those since the one before launched, however many.
        The members of a replica decide together."""
        flight = self.in_flight
        if flight is None or step >= max_steps or not (self.args.round_seconds > 0 and flight.future is not None):
            return False
        # One landed together lands at τ, not earlier (until its start is known, its exchange is running too).
        early = step < flight.lands_at and flight.agreed.is_set() and flight.lands_together(0.0)
        return self.backend.comm.control.members_any(early or not flight.future.done())

    def launch(self, step: int, max_steps: int, joining: bool = False) -> Flight:
        """Start the sync due at `step`: blocking (the backend's start and the contribution checks' verdict; its
        exchange runs as it lands), or with sync_delay > 0 in the background, the backend's start (its wait)
        included."""
        began = time.perf_counter()
        # The sync's one finiteness check: Δ_i = θ_global − θ_i is finite exactly when θ_i is (θ_global always is);
        # the members of a sharded replica agree, so the replica sits a sync out whole.
        finite = self.comm.control.members_all(is_finite(self.outer.params))
        # this replica's numbers, read here, before the inner loop moves on
        local = self.progress.numbers(self.stop_requested, finite)
        self.last_sync_tokens = self.progress.tokens
        stats = self.progress.stats(self.stop_requested,
                                    (self.previous_agreement, self.previous_blocked, self.schedule.exchanged[1]))
        checking = self.gate.checking(joining, self.comm.num_replicas)
        flight = Flight(launched_at=step, lands_at=step, outer_lr=self.outer.lr(),
                        measured=self.schedule.exchanged[0], began=began, stats=stats, checking=checking,
                        finite=finite)
        if not joining:
            self.comm.rendezvous.arrive(step)
        carried = [] if joining else self.backend.expected_fragments(step, max_steps, local)
        if joining and self.gate.active:  # its base learning rate, for the others' checks (torchft's table)
            local["checks"] = self.gate.presence_row()
        for fragment in self.fragments:
            fragment.launched(step, self.progress, carried=fragment.index in carried)
        if self.args.sync_delay > 0 and step < max_steps and not joining and self.backend.may_overlap():
            fragments, buckets = self._carried(carried), self._buckets(carried)
            device = sync_device(self.outer, self.comm, self.codec)
            deltas = [delta for fragment in fragments for delta in fragment.pseudo_gradients(device)]
            flight.launched = {b: held for fragment in fragments for b, held in fragment.replica_copies().items()} \
                if self.args.overlap_landing == "eager" else None
            if checking:
                local["checks"] = self.gate.row(self.comm, buckets, deltas, since_base(self.fragments, carried))
            if self.executor is None:
                self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diloco-sync")
            flight.future = self.executor.submit(self._in_background, flight, max_steps, local, carried, deltas,
                                                 stats, finite)
            flight.lands_at = step + self.schedule.launch_delay(step, carried)
            flight.launch_seconds = time.perf_counter() - began
            self.in_flight = flight
            flight.progress, self.progress = self.progress, Progress()
            return flight
        if checking:  # (each bucket's Δ_i formed as its norm is taken)
            deltas = (f.pseudo_gradient(b, self.comm.device) for f in self._carried(carried) for b in f.buckets)
            local["checks"] = self.gate.row(self.comm, self._buckets(carried), deltas,
                                            since_base(self.fragments, carried), with_loss=True)
        flight.start = self.backend.start(step, max_steps, local, carried, joining=joining)
        with self.comm.rendezvous.naming_the_absent(step):
            flight.start = self._judge(flight.start, local)
        flight.exchange_began = time.perf_counter()
        return flight

    def _carried(self, indices: list[int]) -> list[Fragment]:
        """The fragments of these indices (those a sync carries), in their order."""
        return [self.fragments[f] for f in indices]

    def _buckets(self, indices: list[int]) -> list[int]:
        """The buckets of the fragments a sync carries, in their order."""
        return [b for f in self._carried(indices) for b in f.buckets]

    def _judge(self, start: SyncStart, local: dict) -> SyncStart:
        """`start` with the gate's verdict on this sync's contributions (hf_diloco.gate)."""
        return self.gate.judge(start, local, self.comm, sum(self.fragments[f].size for f in start.fragments),
                               self.backend.replica)

    def _vote_only(self, start: SyncStart) -> SyncResult:
        """A sync that carries nothing (every participant joins): the vote alone."""
        return SyncResult(weights=[0.0] * max(1, len(start.participants)), committed=self.comm.vote())

    def _blocking(self, flight: Flight, alpha: float) -> SyncResult:
        """A blocking sync, once the backend started it: Algorithm 1 over the buckets of the fragments it carries
        (hf_diloco.fragments.outer_round). A replica healed in this sync sends its Δ_i against the base it left."""
        start = flight.start
        stash = None if start.stash is None else [start.stash[b] for b in self._buckets(start.fragments)]
        return outer_round(self._carried(start.fragments), self.comm, codec=self.codec, stats=flight.stats,
                           weight=start.weight, alpha=alpha, decoded=flight.checking, finite=flight.finite,
                           deltas=stash, device=sync_device(self.outer, self.comm, self.codec))

    def _in_background(self, flight: Flight, max_steps: int, local: dict, carried: list[int],
                       deltas: list[torch.Tensor], stats: StatsFn,
                       finite: bool) -> tuple[SyncStart, Exchange | None, float, float]:
        """An overlapped sync, in the background thread: the backend's start, then the exchange of the Δ_i taken
        at launch. A replica whose sync turns out to carry other fragments than it expected (torchft: it healed
        from a peer further along), or that sits it out for a reason of its own, takes part with weight 0, sending
        zeros of the agreed sizes. One left out by the checks keeps its Δ_i, unsent: its agreement with the others
        is measured still, and decides when it is taken back. Returns (start, exchange, when the exchange began,
        which is when the participants and the verdict on their contributions were known, when it finished), in
        perf_counter times. The start is handed to `flight` as soon as it is known (Flight.lands_together)."""
        try:
            start = flight.started = self.backend.start(flight.launched_at, max_steps, local, carried,
                                                        overlapped=True)
        finally:
            flight.agreed.set()
        if start.called_off:  # the fixed group's agreement found a save, an evaluation, a stop or the end
            return start, None, time.perf_counter(), time.perf_counter()
        sitting_out = start.weight == 0
        start = self._judge(start, local)
        began = time.perf_counter()
        fragments = self._carried(start.fragments)
        weight = start.weight
        if start.fragments != carried or sitting_out:
            deltas = [torch.zeros(f.numel(b), device=self.comm.device) for f in fragments for b in f.buckets]
            weight = 0.0
        if start.empty:
            sent = Exchange([], self._vote_only(start), weight=0.0)
        else:
            sent = exchange(self.comm, fragments, deltas, codec=self.codec, stats=stats, weight=weight,
                            finite=finite, decoded="checks" in local)
        return start, sent, began, time.perf_counter()

    def land(self, flight: Flight, step: int, max_steps: int) -> bool:
        """Finish `flight` at `step`, whatever its kind: run a blocking sync (fragments.outer_round), or wait for a
        background exchange (blocked time) and apply it if it committed (fragments.land); α and the weight it was sent
        with are the same arithmetic for every kind. Then its record is handed on. Returns whether a participant
        asked to stop."""
        overlapped = flight.future is not None
        waited = time.perf_counter()
        if overlapped:
            self.in_flight = None
            with self.comm.rendezvous.naming_the_absent(flight.launched_at):
                flight.start, flight.exchange, flight.exchange_began, flight.exchanged = flight.future.result()
            if flight.start.called_off:
                return self._again(flight, step, max_steps)
            flight.in_flight_steps = self.progress.steps
            if self.args.round_seconds > 0:  # the next budget counts from when the participants were known
                self.progress.align(flight.exchange_began)
        start = flight.start
        # The run's last landing makes the final model global (α 0).
        alpha, launched = (0.0, None) if step >= max_steps else (self.args.fragment_alpha, flight.launched)
        with self.comm.rendezvous.naming_the_absent(flight.launched_at):
            if overlapped:
                result = flight.exchange.result if start.empty else land(flight.exchange, alpha, launched)
            else:
                result = self._vote_only(start) if start.empty else self._blocking(flight, alpha)
        if start.empty:
            if not overlapped:
                self.progress.reset()
            self._finish(step, start, result)
            return start.stop_requested
        done = time.perf_counter()
        if overlapped:  # τ auto must cover the whole time in flight: the backend's start, then the exchange
            blocked = flight.launch_seconds + done - waited
            in_flight = flight.exchanged - flight.began
            exchange_seconds = flight.exchanged - flight.exchange_began
        else:  # the next budget counts from here (an overlapped sync's, from its launch)
            self.progress.reset()
            blocked = done - flight.began
            in_flight = exchange_seconds = done - flight.exchange_began
        self.schedule.exchange_measured(start.fragments, in_flight)
        return start.stop_requested | self._complete(step, max_steps, flight, start, result, exchange_seconds,
                                                     blocked)

    def _again(self, flight: Flight, step: int, max_steps: int) -> bool:
        """An overlapped sync called off before its exchange (hf_diloco.backends.FixedGroup): its steps and those
        since go into the blocking sync every replica launches where it would have landed."""
        self.progress.absorb(flight.progress)
        for fragment in self.fragments:
            fragment.call_off()
        return self.land(self.launch(step, max_steps), step, max_steps)

    # --- after a sync landed ---

    def _complete(self, step: int, max_steps: int, flight: Flight, start: SyncStart, result: SyncResult,
                  sync_seconds: float, blocked: float) -> bool:
        # This replica's own parameters were not finite (it sat the sync out with weight 0): it takes θ_global.
        healthy = result.weights is None or result.weights[self.comm.replica_index] > 0
        diverged = not start.finite or (result.committed and start.weight > 0 and not healthy)
        if diverged:
            self.health.restart(self.inner_optimizer, self.backend.replica, step)
        self.health.decided(result, step)
        # Agreement cos(Δ_i, Δ) needs the average, which only exists after the exchange, and the time this sync
        # kept the replica waiting is known after it: both are sent with the NEXT sync's statistics, so they cost
        # no collective of their own.
        result.sum_over_members(self.comm)  # each member measured its own shards (or decoded its own slice)
        # Left out by the checks: it starts from θ_global, as a replica that diverged.
        left_out = self.gate.landed(result, start, self.comm.replica_index, self.backend.replica)
        self.previous_agreement = result.agreement(self.comm.replica_index)
        self.previous_blocked = blocked
        result.count_extra(start.extra_bytes)
        cumulative = self.records.add_bytes(result.cost.bytes_sent)
        stats = SyncStats(result.stats) if result.stats is not None else None
        verdict = self.backend.finish(start, result, tokens=self.last_sync_tokens, step=step)
        record = {} if stats is None else self._record(stats, result, verdict, flight, step, cumulative, sync_seconds,
                                                       blocked)
        choices = self.tuner.landed(stats, replica=self.comm.replica_index, measured=flight.measured,
                                    launched_at=flight.launched_at, step=step, max_steps=max_steps,
                                    sizes=[f.size for f in self.fragments])
        if choices:  # τ or H changed: the staggered end is placed anew
            record.update(choices)
            self._place_end(step, max_steps)
        self._finish(step, start, result, verdict, record, takes_global=diverged or left_out,
                     rebase=result.committed)
        self.tuner.size_last_budget(self._step(step), max_steps, self.progress.origin)
        return stats is not None and bool(stats.stop_requested.sum() > 0)

    def _record(self, stats: SyncStats, result: SyncResult, verdict: Verdict, flight: Flight, step: int,
                cumulative: int, sync_seconds: float, blocked: float) -> dict:
        """The sync's record, built here only: its numbers (records.sync_record), placed where the backend's
        verdict says (a time budget's step and count, torchft's count) or at the sync's own step and number, with
        torchft's membership and vote (records.quorum_record)."""
        start = flight.start
        number = self.schedule.sync_at(flight.launched_at) if verdict.sync is None else verdict.sync
        record = sync_record(
            stats=stats, result=result, step=step if verdict.step is None else verdict.step, sync_number=number,
            round_number=self.schedule.round_of(number), fragments=start.fragments, cumulative_bytes=cumulative,
            sync_seconds=sync_seconds, blocked=blocked, outer_lr=flight.outer_lr,
            inner_lr=self.inner_optimizer.param_groups[0]["lr"], num_replicas=self.comm.num_replicas,
            group_size=self.comm.group_size, sharded=self.comm.sharded,
            ddp_payload=sum(n * p.itemsize for n, p in zip(self.outer.full_numels, self.outer.params, strict=True)),
            compression=self.args.compression + ("+ef" if self.args.error_feedback else ""),
            synced_parameters=sum(self.fragments[f].size for f in start.fragments))
        if flight.launched_at != step:  # (a mix landing keeps α of the steps taken in flight, eager all of them)
            record.update(launch_step=flight.launched_at, in_flight_steps=flight.in_flight_steps)
        if verdict.launch_step is not None:  # a time budget: the furthest replica's launch
            record["launch_step"] = verdict.launch_step
        if verdict.membership is not None:
            quorum_record(record, **verdict.membership)
        return record

    def _finish(self, step: int, start: SyncStart, result: SyncResult, verdict: Verdict | None = None,
                record: dict | None = None, *, takes_global: bool = False, rebase: bool = False) -> None:
        """After the backend's word on the sync (`verdict`, asked here for a sync with nothing exchanged: torchft's
        commit bookkeeping, whether this replica starts again from θ_global; a time budget: the step every replica
        continues at), the record is queued. `takes_global`: the replica diverged or was left out. A replica that
        starts again takes θ_global here, the one copy of it into the replica outside a landing; then (`rebase`, a
        committed sync) the contribution checks measure the next round's base. A sync with nothing exchanged (every
        participant joining) has no record."""
        if verdict is None:
            verdict = self.backend.finish(start, result, tokens=self.last_sync_tokens, step=step)
        if verdict.continue_at is not None:
            self.continue_at = verdict.continue_at
        # (a joining sync that sent the first replica's parameters to the others: they take θ_global too)
        restart = takes_global or verdict.restart or (start.joining and bool(start.startup_bytes))
        fresh = restart or start.joining or (result.committed and self.backend.replica in start.excluded)
        for fragment in self.fragments:  # fresh: the replica starts from θ_global
            fragment.decided(step, result.committed and fragment.index in start.fragments, self.args.fragment_alpha,
                          fresh)
        if restart:
            self.take_global()
        if rebase:
            self.gate.rebase()
        lines = self.gate.record(start.excluded, record) if record and not start.empty else []
        if lines and self.comm.member == 0:
            print("\n".join(lines), flush=True)
        if start.startup_bytes is not None:  # what starting from identical parameters cost: in the first record
            self.records.carry(startup_bytes=start.startup_bytes)
        if record and not start.empty:
            self.records.queue(record)

    def _place_end(self, step: int, max_steps: int, warn: bool = False) -> None:
        """The staggered end (hf_diloco.tuner), after the exchange in flight lands; the records learn how many
        syncs the run makes."""
        busy_until = max(step, self.in_flight.lands_at if self.in_flight is not None else step)
        self.records.expect_syncs(self.tuner.place_end(max_steps, busy_until, warn=warn))

    # --- the end of training ---

    def end(self, step: int) -> list[float] | None:
        """Training ended: the background thread stops, the last sync's agreement is handed over (it has no next
        sync to ride with: through the rendezvous store), a torchft replica stays for late peers, the backend
        shuts down. Returns every replica's last agreement, where known."""
        if self.executor is not None:
            self.executor.shutdown(wait=True)
            self.executor = None
        last_agreement = self.comm.rendezvous.replica_values("last_agreement", self.previous_agreement,
                                                  self.args.sync_timeout)
        if self.backend.run_over() and self.args.end_linger_seconds > 0:
            self.backend.linger(step, self.max_steps)
        self.backend.shutdown()
        if last_agreement is None or not all(math.isfinite(x) for x in last_agreement):
            return None
        return last_agreement

    # --- what a checkpoint keeps of this replica ---

    def global_is_finite(self) -> bool:
        """Whether θ_global holds no NaN or infinity (a sharded replica's members agree on their shards): what a
        checkpoint may be saved from."""
        return self.comm.control.members_all(is_finite(self.outer.global_params))

    def state_dict(self) -> dict:
        """What only this replica knows, for its part of a checkpoint: the schedule's decisions, the backend's (a
        time-budget run's sync count), its error-feedback residuals and, when replicas may differ after a sync
        (several fragments, α > 0, or eager landings), its own trainable parameters."""
        state = self.schedule.state_dict()
        if self.backend is not None and self.backend.state_dict():
            state["backend"] = self.backend.state_dict()
        residuals = residuals_state(self.fragments)
        if residuals is not None:
            state["error_feedback"] = residuals
        args = self.args
        if self.outer is not None and (args.num_fragments > 1 or args.fragment_alpha > 0
                                       or args.overlap_landing == "eager"):
            state["params"] = [p.detach().cpu().clone() for p in self.outer.params]
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Put back what `state_dict` kept (a resumed replica, once θ_global and the backend exist)."""
        self.schedule.load_state_dict(state, staggered=self.args.staggered_end)
        self.backend.load_state_dict(state.get("backend", {}))
        if "error_feedback" in state and self.args.error_feedback:
            load_residuals(self.fragments, state["error_feedback"])
        for param, saved in zip(self.outer.params, state.get("params", []), strict=False):
            param.copy_(saved)
