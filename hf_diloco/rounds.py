"""The round engine: every sync of every backend is `launch`, then `land`.

    launch(step)   the backend says who takes part (torch: every replica; torchft: the quorum, its weights, a heal);
                   the due fragments' pseudo-gradients go into their exchange (hf_diloco.outer.exchange)
    land(flight)   wait for the exchange, then the outer step and the copy back (hf_diloco.outer.land), or nothing
                   when the backend's vote rolled the sync back; then the sync's numbers go to the records

A blocking sync lands at the step it was launched, its buckets averaged and applied one at a time. An overlapped
sync (sync_delay τ > 0) takes its Δ_i at launch, runs the backend's start and the exchange in a background thread
while the replica trains on, and lands τ steps later (or at the last step): one exchange is in flight at a time. A
sync in which nobody brings progress (every participant joins) lands a vote alone. Before the first inner step
each replica runs a joining sync: the backend makes the replicas start from identical parameters (torch: a digest
check and a broadcast where they differ; torchft: the quorum, where a late replica heals).

Who decides what:
    schedule   which fragment is due at which step, with what τ; auto H and τ         hf_diloco.schedule.Schedule
    backend    who takes part, with what weight, the vote, healing                   hf_diloco.backends
    outer      the arithmetic of Algorithm 1, one bucket at a time                    hf_diloco.outer
    records    the sync's record, trackers and the summary                           hf_diloco.records.Records
The Trainer callback (hf_diloco.callback) only asks `sync` at the end of each inner step and keeps Trainer's saves,
evaluations and stop on sync boundaries.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .backends import RoundStart, make_backend
from .codecs import Codec, ErrorFeedback, make_codec
from .config import ConfigError, DiLoCoConfig
from .contributions import CHECK_FIELDS, ContributionChecks, Limits, judge, leave_one_out
from .errors import RunError
from .outer import (
    Exchange,
    OuterState,
    RoundResult,
    assign_fragments,
    exchange,
    is_finite,
    land,
    norm,
    pseudo_gradients,
    snapshot,
)
from .records import Records, ReplicaStats, SyncStats, arrival_clock, sync_record
from .schedule import Schedule

logger = logging.getLogger(__name__)

FLIGHT_MARGIN = 1.25  # time-budget rounds, sync_delay auto: τ and the budget cover this times the time in flight


class Progress:
    """This replica's inner steps since its last launch: what its next sync reports (local, no collective)."""

    def __init__(self):
        self.reset()

    def budget_spent(self, budget: float) -> bool:
        """A time-budget sync is due: the inner step whose end falls nearest `budget` seconds after the last launch
        has been taken (its wall seconds per step so far tell when the next one would end). Ending at the nearest
        step rather than the first past the budget brings every replica to the sync within half a step of the
        budget, whatever its speed, so the faster ones wait less for the slowest.

        >>> progress = Progress()
        >>> progress.started = progress.origin = time.perf_counter() - 0.85
        >>> progress.steps = 2                                                  # 0.425 s a step so far
        >>> progress.budget_spent(1.0), progress.budget_spent(1.1)            # a third step would end at 1.275 s
        (True, False)
        """
        now = time.perf_counter()
        per_step = (now - self.started) / self.steps if self.steps else 0.0
        return now - self.origin + per_step / 2 >= budget

    def align(self, moment: float) -> None:
        """Count the budget from `moment` (a perf_counter time) if later than the launch: the instant an overlapped
        sync's participants all took part (torchft: its quorum formed), the same on every replica, so a replica
        that launched early does not keep a head start on the others' budgets at every later sync."""
        self.origin = max(self.origin, moment)

    def reset(self) -> None:
        self.loss = torch.zeros(())
        self.lr_sum = 0.0  # Σ η over the steps (the contribution checks' `size` rule)
        self.steps = 0
        self.tokens = 0
        self.compute_seconds = 0.0
        self.step_started: float | None = None
        self.started = self.origin = time.perf_counter()  # origin: where the time budget counts from

    def micro_batch(self, loss: torch.Tensor, inputs: dict) -> None:
        if self.loss.device != loss.device:
            self.loss = self.loss.to(loss.device)
        self.loss += loss.detach().float()
        input_ids = inputs.get("input_ids") if hasattr(inputs, "get") else None
        if input_ids is not None:
            self.tokens += input_ids.numel()

    def step_began(self) -> None:
        self.step_started = time.perf_counter()

    def step_ended(self, lr: float = 0.0) -> None:
        self.lr_sum += lr
        if self.step_started is not None:
            self.compute_seconds += time.perf_counter() - self.step_started
            self.step_started = None
        self.steps += 1


@dataclass
class Fragment:
    """One streaming fragment (the whole model when num_fragments is 1): the buckets of θ_global it owns (its
    base), its error-feedback residuals (kept under those buckets' keys) and `size`, the values it syncs."""

    index: int
    buckets: list[int]
    size: int


@dataclass
class Flight:
    """A launched sync, until it lands: blocking (`start` and `exchange` made at launch) or overlapped (`future`
    runs the backend's start and the exchange in the background)."""

    launched_at: int
    lands_at: int
    outer_lr: float
    measured: list[int]  # the fragments whose last exchange time this sync's statistics carry (sync_delay auto)
    began: float
    launch_seconds: float = 0.0  # time the inner loop spent launching an overlapped sync (its snapshot)
    future: Future | None = None
    start: RoundStart | None = None
    exchange: Exchange | None = None
    exchange_began: float = 0.0
    exchanged: float = 0.0  # an overlapped sync: when its exchange finished in the background


class RoundEngine:
    """One replica's side of the outer rounds: θ_global and the outer optimizer (`outer`), the fragments, the codec
    and its residuals, the sync in flight, and what the next sync's statistics carry.

    `trainer` is the DiLoCoTrainer (its comm, its inner optimizer, its learning rate); `continue_at_step` is the
    Trainer glue's one way to move the step (a replica that joins late continues at the others' step).
    """

    def __init__(self, args: DiLoCoConfig, trainer, records: Records, continue_at_step: Callable[[int], None]):
        self.args = args
        self.trainer = trainer
        self.records = records
        self.continue_at_step = continue_at_step
        # boundary_wanted(before, now, sync): the callback's rule for where saves and evaluations fall (time-budget
        # rounds on the fixed group make such a sync blocking, so every replica lands it at the same step)
        self.boundary_wanted: Callable[[int, int, int], bool] | None = None
        self.schedule = Schedule(args.inner_steps, args.num_fragments, sync_delay=args.sync_delay,
                                 budget=args.round_seconds / args.num_fragments if args.round_seconds > 0 else 0.0)
        self.codec: Codec | None = None if args.compression == "none" else make_codec(
            args.compression, chunk=args.compression_chunk, sparse_k=args.sparse_k, sparse_chunk=args.sparse_chunk,
            sparse_bits=args.sparse_bits)
        self.feedback: ErrorFeedback | None = None
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
        self.bad_syncs = 0  # consecutive syncs in which no replica had a finite pseudo-gradient
        self.syncs_landed = 0  # syncs landed since this process started (inner_steps auto waits for 2F)
        self.last_sync_tokens = 0  # tokens of the sync launched last (torchft carries them over a rollback)
        self.max_steps = 0
        self.own_pace = (0.0, 0.0)  # time-budget τ auto: this replica's decayed (compute seconds, steps)
        self.base_loss = float("nan")  # contribution_loss_check: the held-out batch's loss where the round started
        self.loss_batch: dict | None = None
        # per fragment: the inner steps and Σ η its Δ_i covers, before this sync's (a fragment's base moves when its
        # sync commits; a rolled-back torchft sync's steps count on), and with the sync launched last
        self.covered: dict[int, tuple[float, float]] = {}
        self.launch_basis: dict[int, tuple[float, float]] = {}
        self.checks = ContributionChecks(
            args.contribution_checks, Limits(adam_ratio=args.contribution_adam_ratio,
                                             norm_ratio=args.contribution_norm_ratio,
                                             min_agreement=args.contribution_min_agreement,
                                             agreement_gap=args.contribution_agreement_gap,
                                             loss_margin=args.contribution_loss_margin),
            faulty_after=args.contribution_faulty_after)

    # --- the start of training ---

    def begin(self, named: list[tuple[str, torch.nn.Parameter]], step: int, max_steps: int,
              outer_state: dict | None, replica_state: dict) -> None:
        """θ_global from the replica's trainable parameters (or the checkpoint's outer state), the fragments, the
        backend, and what a resumed replica kept (its residuals, its parameters, the schedule's decisions)."""
        args = self.args
        self.max_steps = max_steps
        try:
            assigned = assign_fragments([name for name, _ in named], args.num_fragments, args.fragment_pattern)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        self.outer = OuterState(
            [p for _, p in named], lr=args.outer_lr, momentum=args.outer_momentum, nesterov=args.outer_nesterov,
            optimizer=args.outer_optimizer, offload=args.offload_outer_state,
            momentum_delay=args.outer_momentum_delay, delayed_scale=args.outer_delayed_scale,
            bucket_numel=max(1, int(args.sync_bucket_mb * 2**20 / 4)), fragments=assigned)
        self.fragments = [Fragment(f, buckets, sum(self.outer.full_numels[i] for b in buckets
                                                   for i in self.outer.buckets[b]))
                          for f, buckets in enumerate(self.outer.fragment_buckets)]
        if args.error_feedback:
            self.feedback = ErrorFeedback(args.error_feedback_decay, "cpu" if args.offload_outer_state
                                          else self.trainer.comm.device)
        self.backend = make_backend(args, self.trainer.comm, self.outer, self.feedback, self.schedule, max_steps,
                                    resumed=outer_state is not None, continue_at_step=self.continue_at_step,
                                    step=step, boundary_wanted=self.boundary_wanted)
        self.comm = self.backend.comm
        # FSDP2's row cuts tell each member which values it syncs; a tensor-parallel member syncs what it holds.
        self.comm.bucket_shapes = None if args.tensor_parallel else self.outer.bucket_shapes()
        self.comm.repeated_spans = self.outer.repeated_spans(self.comm.member % args.tp_size) \
            if args.tensor_parallel else None
        if outer_state is not None:
            self.outer.load_state_dict(outer_state)
            self.outer.copy_global_to_replica()
            self._load_replica_state(replica_state)
        self._stagger_end(step, max_steps, warn=True)

    def join(self, step: int) -> RoundStart:
        """The joining sync, before the first inner step: identical parameters everywhere (torchft: the quorum,
        where a late or restarted replica heals from a live peer)."""
        flight = self.launch(step, self.max_steps, joining=True)
        # A late replica's heal may have moved Trainer's step (continue_at_step): the sync lands at the new one.
        self.land(flight, self.trainer.state.global_step, self.max_steps)
        self.progress.reset()
        if self.args.contribution_loss_check and self.comm.num_replicas > 1:
            self.base_loss = self._held_out_loss()
        self.backend.joined(flight.start, step)
        return flight.start

    # --- the end of each inner step ---

    def sync(self, step: int, max_steps: int) -> bool | None:
        """The syncs of this step: land the one in flight if it is due, then launch the one due now (a blocking
        one lands at once). Returns None when nothing landed or launched, else whether any replica asked to stop
        (known from the syncs that landed)."""
        if self.backend.run_over():  # torchft: healed from a replica that finished the run
            return None
        landing = self.in_flight is not None and (step >= self.in_flight.lands_at or step >= max_steps)
        stop = bool(landing) and self.land(self.in_flight, step, max_steps)
        # A time-budget sync that landed may have moved this replica's step (to the agreed one plus the largest τ,
        # at most max_steps): what follows is decided at the step it continues at.
        step = self.trainer.state.global_step if landing else step
        due = self.backend.due(step, max_steps, self.progress)
        if due and self.in_flight is not None:  # a time-budget sync came due first: the one in flight lands now
            landing, stop = True, stop | self.land(self.in_flight, step, max_steps)
            step = self.trainer.state.global_step
            due = self.backend.due(step, max_steps, self.progress)
        if not landing and not due:
            return None
        # A stop learned from the sync that landed ends training here: no new sync is launched to be left in
        # flight (in a staggered end one lands as the next is launched).
        if due and not (stop and step < max_steps):
            flight = self.launch(step, max_steps)
            if flight.future is None:
                stop |= self.land(flight, step, max_steps)
        if step >= max_steps and self.schedule.end is not None:
            # The staggered end: every fragment's last sync has landed; the final model is θ_global.
            self.outer.copy_global_to_replica()
        return stop

    def launch(self, step: int, max_steps: int, joining: bool = False) -> Flight:
        """Start the sync due at `step`: blocking (the backend's start, then the exchange, which for a sync
        without a vote runs as `land` applies it), or with sync_delay > 0 in the background (the backend's start
        included: torchft's quorum waits for the slowest replica while this one trains on)."""
        began = time.perf_counter()
        local = self._local_numbers()  # this replica's numbers, read here, before the inner loop moves on
        self.last_sync_tokens = self.progress.tokens
        stats = self._stats()
        flight = Flight(launched_at=step, lands_at=step, outer_lr=self.outer.lr(),
                        measured=self.schedule.exchanged[0], began=began)
        if not joining:
            self.comm.arrive(step)
        fragments = [] if joining else self.backend.expected_fragments(step, max_steps, local)
        checking = self._checking(joining)
        self.launch_basis = {f: (steps + self.progress.steps, lr + self.progress.lr_sum) for f, (steps, lr) in
                             ((f, self.covered.get(f, (0, 0.0))) for f in range(len(self.fragments)))}
        if self.args.sync_delay > 0 and step < max_steps and not joining and self.backend.may_overlap():
            deltas = snapshot(self.outer, self.comm, self._buckets(fragments))
            if checking:
                local["checks"] = self.checks.row(norm(self.comm, self._buckets(fragments), deltas),
                                                  *self._since_base(fragments))
            if self.executor is None:
                self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diloco-sync")
            flight.future = self.executor.submit(self._launch_in_background, step, max_steps, local, fragments,
                                                 deltas, stats)
            flight.lands_at = step + self.schedule.launch_delay(step, fragments)
            flight.launch_seconds = time.perf_counter() - began
            self.in_flight = flight
            self.progress.reset()
            return flight
        if checking:
            buckets = self._buckets(fragments)
            local["checks"] = self.checks.row(norm(self.comm, buckets, pseudo_gradients(self.outer, self.comm,
                                                                                         buckets)),
                                              *self._since_base(fragments), self._loss_gain())
        flight.start = start = self.backend.start(step, max_steps, local, fragments, joining=joining)
        with self.comm.naming_the_absent(step):
            self._judge(start, local)
        flight.exchange_began = time.perf_counter()
        if start.empty:  # nobody brings progress (every participant is joining): only the vote
            flight.exchange = self._vote_only(start)
            return flight
        buckets = self._buckets(start.fragments)
        with self.comm.naming_the_absent(step):
            if start.stash is not None:  # healed: Δ_i taken against the base it left
                flight.exchange = exchange(self.comm, buckets, [start.stash[b] for b in buckets], codec=self.codec,
                                           feedback=self.feedback, stats=stats, weight=start.weight,
                                           decoded=checking)
            else:
                # Where the network runs: without a vote each bucket is averaged as `land` applies it (one bucket
                # held at a time); a sync that votes (torchft) averages every bucket here, then votes.
                finite = self.comm.replica_all(is_finite(self.outer.params[i] for b in buckets
                                                         for i in self.outer.buckets[b]))
                flight.exchange = exchange(self.comm, buckets, pseudo_gradients(self.outer, self.comm, buckets),
                                           codec=self.codec, feedback=self.feedback, stats=stats,
                                           weight=start.weight, finite=finite, decoded=checking,
                                           lazy=not self.comm.votes)
        return flight

    def _vote_only(self, start: RoundStart) -> Exchange:
        """The exchange of a sync that carries nothing (every participant joins): the vote alone."""
        return Exchange([], [], RoundResult(weights=[0.0] * max(1, len(start.members)), committed=self.comm.vote()),
                        weight=0.0)

    def _checking(self, joining: bool) -> bool:
        """Whether this sync's contributions are checked: not the joining one, and only with peers to compare."""
        return self.checks.active and not joining and self.comm.num_replicas > 1

    def _since_base(self, fragments: list[int]) -> tuple[float, float]:
        """The inner steps Δ_i of `fragments` covers and the sum of their learning rates (the fragment whose base
        is oldest): since each fragment last synced, whatever syncs of other fragments came between."""
        return max((self.launch_basis[f] for f in fragments), default=(0, 0.0))

    def _loss_gain(self) -> float:
        """contribution_loss_check: the loss this replica's round removed from the held-out batch (its loss at
        θ_global when the round started, less its loss at the replica's parameters now); NaN without the check."""
        return self.base_loss - self._held_out_loss() if self.args.contribution_loss_check else float("nan")

    @torch.no_grad()
    def _held_out_loss(self) -> float:
        """The model's loss now on the check's held-out batch: the evaluation set's first contribution_loss_batch
        examples, the same on every replica (every member of a sharded replica runs the forward pass)."""
        trainer = self.trainer
        if self.loss_batch is None:
            if trainer.eval_dataset is None or len(trainer.eval_dataset) == 0:
                raise ConfigError("contribution_loss_check scores each round on held-out examples, and this run has "
                                  "no evaluation set: set eval_fraction above 0 or pass one.")
            examples = [trainer.eval_dataset[i] for i in range(min(self.args.contribution_loss_batch,
                                                                   len(trainer.eval_dataset)))]
            self.loss_batch = trainer._prepare_inputs(trainer.data_collator(examples))
        model = trainer.model
        training = model.training
        model.eval()
        try:
            return float(model(**self.loss_batch).loss)
        finally:
            model.train(training)

    def _judge(self, start: RoundStart, local: dict) -> None:
        """The contribution checks (hf_diloco.contributions): every replica's row (torchft: in the membership table
        its start exchanged; torch: one small all-reduce over the sync's groups, its bytes counted with the sync's),
        the same verdict on every replica, and weight 0 for this one if it is found out (mode exclude)."""
        if "checks" not in local or start.empty or start.joining:
            return
        if start.members:
            rows = {int(m["replica"]): [m[f] for f in CHECK_FIELDS] for m in start.members}
        else:
            table, sent = self.comm.replica_rows(local["checks"])
            start.extra_bytes += sent
            rows = {r: table[r].tolist() for r in range(table.shape[0])}
        parameters = sum(self.fragments[f].size for f in start.fragments)
        start.excluded = judge(rows, parameters, self._adam(), self.checks.limits)
        if self.checks.mode == "exclude" and self.backend.replica in start.excluded:
            start.weight = 0.0

    def _adam(self) -> bool:
        """Whether the inner optimizer is AdamW-like (the `size` check bounds its steps by the learning rate)."""
        optimizer = self.trainer.optimizer
        while hasattr(optimizer, "optimizer"):  # accelerate's wrapper
            optimizer = optimizer.optimizer
        return "adam" in type(optimizer).__name__.lower()

    def _launch_in_background(self, step, max_steps, local, fragments, deltas, stats):
        """An overlapped sync, in the background thread: the backend's start, then the exchange of the Δ_i taken
        at launch. A replica whose sync turns out to carry other fragments than it expected (torchft: it healed
        from a peer further along), or that sits it out for a reason of its own, takes part with weight 0, sending
        zeros of the agreed sizes. One left out by the checks keeps its Δ_i, unsent: its agreement with the others is
        measured still, and decides when it is taken back."""
        start = self.backend.start(step, max_steps, local, fragments, overlapped=True)
        sitting_out = start.weight == 0
        self._judge(start, local)
        began = time.perf_counter()
        buckets = self._buckets(start.fragments)
        weight = start.weight
        if start.fragments != fragments or sitting_out:
            deltas = [torch.zeros(self.outer.bucket_numel(self.outer.buckets[b]), device=self.comm.device)
                      for b in buckets]
            weight = 0.0
        if start.empty:
            landed = self._vote_only(start)
        else:
            landed = exchange(self.comm, buckets, deltas, codec=self.codec, feedback=self.feedback, stats=stats,
                              weight=weight, decoded="checks" in local)
        return start, landed, began, began, time.perf_counter()

    def land(self, flight: Flight, step: int, max_steps: int) -> bool:
        """Finish `flight` at `step`, whatever its kind: wait for its exchange if it ran in the background (the time
        the inner loop waits is blocked time), apply it through `outer.land` if it committed (α, the weight it was
        sent with and the vote are the same call for a blocking, an overlapped and a voted sync), and hand its
        record on. Returns whether a participant asked to stop."""
        overlapped = flight.future is not None
        waited = time.perf_counter()
        if overlapped:
            self.in_flight = None
            with self.comm.naming_the_absent(flight.launched_at):
                flight.start, flight.exchange, flight.exchange_began, all_there, flight.exchanged = \
                    flight.future.result()
            if self.args.round_seconds > 0:
                self.progress.align(all_there)
        start = flight.start
        if start.empty:
            if not overlapped:
                self.progress.reset()
            self._finish(step, start, flight.exchange.result)
            return start.stop_requested
        with self.comm.naming_the_absent(flight.launched_at):  # a blocking sync is averaged as it is applied
            result = land(self.outer, flight.exchange, self.args.fragment_alpha)
        done = time.perf_counter()
        if not overlapped:  # the next budget counts from here (an overlapped sync's, from its launch)
            self.progress.reset()
        if overlapped:
            # What τ auto must cover is the whole time in flight: the backend's start (torchft: the quorum; time
            # budgets: the agreement), then the exchange.
            blocked, in_flight = flight.launch_seconds + done - waited, flight.exchanged - flight.began
            exchange_seconds = flight.exchanged - flight.exchange_began
        else:
            blocked, in_flight = done - flight.began, done - flight.exchange_began
            exchange_seconds = in_flight
        self.schedule.exchanged = (start.fragments, in_flight)
        return start.stop_requested | self._complete(step, max_steps, flight, start, result, exchange_seconds,
                                                     blocked)

    # --- after a sync landed ---

    def _complete(self, step: int, max_steps: int, flight: Flight, start: RoundStart, result: RoundResult,
                  sync_seconds: float, blocked: float) -> bool:
        # This replica's own parameters were not finite (it sat the sync out with weight 0): it takes θ_global.
        if not start.finite or (result.committed and start.weight > 0 and not self._healthy(result)):
            self._reset_replica(step)
        if result.committed:
            self._count_bad_syncs(result, step)
        # Agreement cos(Δ_i, Δ) needs the average, which only exists after the exchange, and the time this sync
        # kept the replica waiting is known after it: both are sent with the NEXT sync's statistics, so they cost
        # no collective of their own.
        result.sum_over_members(self.comm)  # each member measured its own shards (or decoded its own slice)
        if self.checks.active and result.committed and result.weights is not None and not start.joining:
            weight = result.weights[self.comm.replica_index]
            norm_sq, dot = result.own_terms(weight, decoded=True)  # with a codec: what the average holds of it
            self.checks.landed(leave_one_out(result.total_weight, weight, dot=dot, norm_sq=norm_sq,
                                             average_norm_sq=result.average_norm_sq),
                               left_out=self.backend.replica in start.excluded)
        if result.committed and self.backend.replica in start.excluded and self.checks.mode == "exclude":
            self.outer.copy_global_to_replica()  # left out: it starts from θ_global, as a replica that diverged
        if result.committed and self.args.contribution_loss_check:
            self.base_loss = self._held_out_loss()  # the replica holds θ_global now (F = 1, α = 0, τ = 0)
        # cos(Δ_i, Δ) of its own Δ_i, whatever weight it sent with (a replica left out has one too)
        own_norm_sq, own_dot = result.own_terms(result.weights[self.comm.replica_index]) \
            if result.weights is not None else (result.local_norm_sq, result.dot)
        scale = math.sqrt(own_norm_sq * result.average_norm_sq)
        self.previous_agreement = own_dot / scale if scale > 0 else float("nan")
        self.previous_blocked = blocked
        result.cost.bytes_sent += start.extra_bytes
        result.fp32_bytes_sent += start.extra_bytes  # an fp32 sync sends the same tables: the codec's ratio is its own
        cumulative = self.records.add_bytes(result.cost.bytes_sent)
        stats = SyncStats(result.stats) if result.stats is not None else None
        outer = self.outer
        number = self.schedule.sync_at(flight.launched_at)
        record = {} if stats is None else sync_record(
            stats=stats, result=result, step=step, sync_number=number, round_number=self.schedule.round_of(number),
            fragments=start.fragments, cumulative_bytes=cumulative, sync_seconds=sync_seconds, blocked=blocked,
            outer_lr=flight.outer_lr, inner_lr=self.trainer._get_learning_rate(),
            num_replicas=self.comm.num_replicas, group_size=self.comm.group_size, sharded=self.comm.sharded,
            ddp_payload=sum(n * p.element_size() for n, p in zip(outer.full_numels, outer.params, strict=True)),
            compression=self.args.compression + ("+ef" if self.feedback is not None else ""),
            synced_parameters=sum(self.fragments[f].size for f in start.fragments))
        if flight.launched_at != step:
            record["launch_step"] = flight.launched_at
        self.syncs_landed += 1
        if stats is not None:
            # This replica's seconds per step over its recent syncs (each older sync counts half as much as the
            # next; time-budget τ auto): a sync that waited at its landing holds a step or two, too few to time a
            # step by.
            mine = self.comm.replica_index
            self.own_pace = (0.5 * self.own_pace[0] + float(stats.compute_seconds[:, mine].max()),
                             0.5 * self.own_pace[1] + float(stats.steps[:, mine].max()))
        if self.args.auto_sync_delay and stats is not None and flight.measured and step < max_steps:
            record["sync_delay_auto"] = self._choose_delays(stats, list(flight.measured))
        if self.args.auto_inner_steps and self.schedule.auto_choice is None and stats is not None and \
                self.syncs_landed >= 2 * self.args.num_fragments and step < max_steps:
            record["inner_steps_auto"] = self._choose_inner_steps(stats, flight.launched_at, max_steps)
        if "sync_delay_auto" in record or "inner_steps_auto" in record:
            self._stagger_end(step, max_steps)
        self._finish(step, start, result, record)
        return stats is not None and bool(stats.stop_requested.sum() > 0)

    def _finish(self, step: int, start: RoundStart, result: RoundResult, record: dict | None = None) -> None:
        """The backend's word on the sync (torchft: commit bookkeeping, membership in the record, whether this
        replica starts again from θ_global), then the record is queued. A sync with nothing exchanged (every
        participant joining) has no record."""
        record, restart = self.backend.finish(start, result, record or {}, tokens=self.last_sync_tokens, step=step)
        if restart or start.joining or (result.committed and self.backend.replica in start.excluded):
            self.covered = {}  # the replica starts from θ_global
        else:  # every fragment's Δ_i covers this sync's steps too; a fragment that synced keeps α of its own
            synced = set(start.fragments) if result.committed else set()
            alpha = self.args.fragment_alpha
            self.covered = {f: (steps * alpha, lr * alpha) if f in synced else (steps, lr)
                            for f, (steps, lr) in self.launch_basis.items()}
        if restart:
            self.outer.copy_global_to_replica()
        if record and not start.empty:
            for line in self.checks.record(start.excluded, record):
                if self.comm.member == 0:
                    print(line, flush=True)
        if start.startup_bytes is not None:  # what starting from identical parameters cost: in the first record
            self.records.carry(startup_bytes=start.startup_bytes)
        if start.empty or not record:
            return
        self.records.queue(record)

    def _stagger_end(self, step: int, max_steps: int, warn: bool = False) -> None:
        """final_sync staggered: place the final window (schedule.Schedule.stagger_end) for the fragments' current
        τ and H, after the exchange in flight lands. Placed anew when an auto choice changes τ or H, until the
        window begins: from then on it stays, so every fragment's last sync happens once, at the step every replica
        agreed on. Only a run too short for the first placement ends blocking."""
        if self.args.staggered_end:
            busy_until = max(step, self.in_flight.lands_at if self.in_flight is not None else step)
            if not self.schedule.place_end(max_steps, busy_until=busy_until) and warn and \
                    self.trainer.is_world_process_zero():
                logger.warning("DiLoCo: the run is too short for a staggered end (final_sync); every fragment "
                               "syncs at the last step.")
        # With time-budget rounds how many syncs the run makes depends on the replicas' speeds: not shown.
        self.records.total_syncs = None if self.args.round_seconds > 0 else self.schedule.total_syncs(max_steps)

    def _choose_delays(self, stats: SyncStats, measured: list[int]) -> dict:
        """sync_delay auto from what the last exchange of the `measured` fragments took. With rounds of H steps
        every replica lands at the same step, so τ covers the exchange in the slowest replica's steps; with
        time-budget rounds each replica lands in its own steps, so τ is chosen from its own seconds per step, at
        most the steps it takes in the next budget less one (its sync lands before that budget is spent). That
        budget stretches while a measured fragment's time in flight would not fit in it (Schedule.stretch_budget)."""
        exchange_seconds = float(stats.previous_exchange_seconds.max())
        sizes = [f.size for f in self.fragments]
        if self.args.round_seconds <= 0:
            return self.schedule.choose_delays(measured, exchange_seconds=exchange_seconds,
                                               step_seconds=_step_seconds(stats), sizes=sizes)
        own_step = self.own_pace[0] / self.own_pace[1] if self.own_pace[1] > 0 else 0.0
        # A time-budget sync's τ covers its time in flight with a margin: a sync that lands even slightly before
        # its exchange is done waits for it, while one that lands a few steps late costs nothing.
        exchange_seconds *= FLIGHT_MARGIN
        budget = self.schedule.stretch_budget(measured, exchange_seconds, _step_seconds(stats))
        # At most the steps the budget holds less one, from the budget rather than the steps this sync took: a
        # sync that waited at its landing took few steps, and τ chosen from them would stay too short.
        most = max(1, int(budget / own_step) - 1) if own_step > 0 else 1
        choice = self.schedule.choose_delays(measured, exchange_seconds=exchange_seconds, step_seconds=own_step,
                                             sizes=sizes, most=most)
        choice["budget_seconds"] = budget
        return choice

    def _choose_inner_steps(self, stats: SyncStats, launched_at: int, max_steps: int) -> dict:
        """inner_steps auto from what the first syncs measured, the same on every replica; the new schedule
        starts at the step this sync was launched at."""
        overhead = self.args.max_sync_overhead
        choice = self.schedule.choose_inner_steps_at(
            launched_at, step_seconds=_step_seconds(stats),
            sync_seconds=float(stats.previous_blocked_seconds.max()), max_sync_overhead=overhead)
        self.records.total_syncs = self.schedule.total_syncs(max_steps)
        if self.trainer.is_world_process_zero():
            logger.warning(
                "DiLoCo inner_steps auto: an inner step takes %.4f s and a fragment's sync kept the replicas waiting "
                "%.4f s, so H = %d keeps waiting under %.0f%% of compute (%d fragment(s)); H = %d from step %d on.",
                choice["step_seconds"], choice["sync_seconds"], choice["chosen"], 100 * overhead,
                self.args.num_fragments, choice["chosen"], launched_at)
        return choice

    @torch.no_grad()
    def _reset_replica(self, step: int) -> None:
        """This replica's pseudo-gradient was not finite: it takes θ_global for every parameter and, if its inner
        optimizer state holds non-finite values too, starts that state afresh (stale NaN moments would poison the
        next step again)."""
        self.outer.copy_global_to_replica()
        optimizer = self.trainer.optimizer
        moments = [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
        if not is_finite(moments):
            optimizer.state.clear()
        logger.warning("DiLoCo: replica %d had a non-finite pseudo-gradient at step %d; it sat the sync out and "
                       "restarts from the global parameters.", self.backend.replica, step)

    def _count_bad_syncs(self, result: RoundResult, step: int) -> None:
        """`max_bad_rounds` consecutive rounds (F syncs each) with no healthy participant stop the run with one
        sentence."""
        self.bad_syncs = 0 if result.participants else self.bad_syncs + 1
        fragments = self.args.num_fragments
        if self.bad_syncs >= self.args.max_bad_rounds * fragments:
            counted = f"{self.bad_syncs} consecutive rounds" if fragments == 1 else \
                f"{self.bad_syncs} consecutive syncs ({self.bad_syncs // fragments} rounds)"
            raise RunError(
                f"no replica had a finite pseudo-gradient for {counted} (last at step {step}); the run is diverging: "
                f"lower learning_rate or outer_lr, or resume from an earlier checkpoint."
            )

    def _healthy(self, result: RoundResult) -> bool:
        return result.weights is None or result.weights[self.comm.replica_index] > 0

    def _buckets(self, fragments: list[int]) -> list[int]:
        return [b for f in fragments for b in self.fragments[f].buckets]

    def _local_numbers(self) -> dict:
        """This replica's numbers for the backend's start (torchft: its row of the membership table)."""
        progress = self.progress
        return {"steps": progress.steps, "tokens": progress.tokens, "loss_sum": float(progress.loss.item()),
                "compute_seconds": progress.compute_seconds, "stop_requested": self.stop_requested,
                "finite": is_finite(self.outer.params)}

    def _stats(self):
        """This replica's statistics for the sync, made once its pseudo-gradient norm is known."""
        progress = self.progress
        mine = ReplicaStats(loss_sum=progress.loss.item(), steps=progress.steps, tokens=progress.tokens,
                            compute_seconds=progress.compute_seconds, stop_requested=float(self.stop_requested),
                            previous_agreement=self.previous_agreement,
                            previous_blocked_seconds=self.previous_blocked,
                            previous_exchange_seconds=self.schedule.exchanged[1], arrived=arrival_clock())

        def stats(local_norm_sq: float) -> torch.Tensor:
            mine.pseudo_grad_norm_sq = local_norm_sq
            return mine.tensor()

        return stats

    # --- the end of training ---

    def run_over(self) -> bool:
        return self.backend is not None and self.backend.run_over()

    def end(self, step: int) -> list[float] | None:
        """Training ended: the background thread stops, the last sync's agreement is handed over (it has no next
        sync to ride with: through the rendezvous store), a torchft replica stays for late peers, the backend
        shuts down. Returns every replica's last agreement, where known."""
        if self.executor is not None:
            self.executor.shutdown(wait=True)
            self.executor = None
        last_agreement = self.comm.replica_values("last_agreement", self.previous_agreement,
                                                  self.args.sync_timeout)
        if self.backend.run_over() and self.args.end_linger_seconds > 0:
            self.backend.linger(step, self.max_steps)
        self.backend.shutdown()
        if last_agreement is None or not all(math.isfinite(x) for x in last_agreement):
            return None
        return last_agreement

    # --- what a checkpoint keeps of this replica ---

    def replica_state(self) -> dict:
        """What only this replica knows: the schedule's decisions, its error-feedback residuals and, when replicas
        may differ after a sync (several fragments, or α > 0), its own trainable parameters."""
        state = self.schedule.state_dict()
        if self.backend is not None and self.backend.state_dict():  # a time-budget run's sync count
            state["backend"] = self.backend.state_dict()
        if self.feedback is not None:
            state["error_feedback"] = self.feedback.state_dict()
        if self.outer is not None and (self.args.num_fragments > 1 or self.args.fragment_alpha > 0):
            state["params"] = [p.detach().cpu().clone() for p in self.outer.params]
        return state

    @torch.no_grad()
    def _load_replica_state(self, state: dict) -> None:
        self.schedule.load_state_dict(state, staggered=self.args.staggered_end)
        self.backend.load_state_dict(state.get("backend", {}))
        if self.feedback is not None and "error_feedback" in state:
            self.feedback.load_state_dict(state["error_feedback"])
        for param, saved in zip(self.outer.params, state.get("params", []), strict=False):
            param.copy_(saved)


def _step_seconds(stats: SyncStats) -> float:
    """The slowest replica's seconds per inner step in a sync."""
    return float((stats.compute_seconds / stats.steps.clamp(min=1)).max())
