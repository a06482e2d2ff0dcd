"""The outer loop inside Trainer: at the end of each inner step, is a round due → run it on the backend → record it.

`OuterLoopCallback` is the whole of DiLoCo's life inside `Trainer`'s loop; each job it needs is somewhere else:

    schedule      which fragment syncs when, the inner_steps auto choice      hf_diloco.schedule
    backend       who takes part, with what weight, the vote                   hf_diloco.backends / .torchft_backend
    the round     pseudo-gradient, codec, error feedback, outer step           hf_diloco.outer
    overlap       a fragment's exchange in a background thread for τ steps     `Overlap` below
    reporting     records queued until the round's evaluation, then written    hf_diloco.records.RoundLog
    records       statistics sent with the round, the record, the summary      hf_diloco.records

The same callback serves both backends: on torchft the round is the same call on a process group of the round's
quorum, with the backend's weight, and a vote before anything is applied.
"""

from __future__ import annotations

import logging
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import DefaultFlowCallback, PrinterCallback, ProgressCallback

from .backends import FixedGroup, RoundStart
from .codecs import Codec, ErrorFeedback, make_codec
from .comm import ReplicaComm
from .config import ConfigError, DiLoCoConfig
from .errors import RunError, first_line
from .metrics import RoundWriter, read_sync_rounds, reported_metrics, write_summary
from .outer import (
    Exchange,
    OuterLoop,
    RoundResult,
    assign_fragments,
    exchange,
    is_finite,
    land,
    local_shard,
    outer_round,
    snapshot,
)
from .records import ReplicaStats, RoundLog, RoundStats, round_record, summary
from .schedule import FinalWindow, Schedule, choose_inner_steps, choose_sync_delay

logger = logging.getLogger(__name__)


@dataclass
class InFlight:
    """An overlapped round: its exchange runs in the background from `launched_at` until `lands_at`."""

    future: Future
    launched_at: int
    lands_at: int
    outer_lr: float
    launch_seconds: float  # time the inner loop spent starting it (taking the pseudo-gradient snapshot)
    measured: list[int]  # the fragments whose last exchange this round's statistics carry (sync_delay auto)


class Overlap:
    """Streaming DiLoCo's overlap: one exchange at a time runs in a background thread while the replica trains on,
    and lands τ steps later (or at the last step). Its collectives run on process groups of their own (see
    comm.ReplicaComm), so they never interleave with the training thread's."""

    def __init__(self):
        self.executor: ThreadPoolExecutor | None = None
        self.in_flight: InFlight | None = None

    def launch(self, work, step: int, delay: int, outer_lr: float, launch_seconds: float,
               measured: list[int]) -> None:
        if self.executor is None:
            self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diloco-sync")
        self.in_flight = InFlight(self.executor.submit(work), step, step + delay, outer_lr, launch_seconds, measured)

    def lands(self, step: int, max_steps: int) -> bool:
        """Whether the exchange in flight is due to land at `step`."""
        return self.in_flight is not None and (step >= self.in_flight.lands_at or step >= max_steps)

    def take(self) -> InFlight:
        flight, self.in_flight = self.in_flight, None
        return flight

    def shutdown(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=True)
            self.executor = None


class OuterLoopCallback(TrainerCallback):
    """Runs the outer rounds on their schedule and reports them. Owned by a DiLoCoTrainer.

    With sync_delay τ > 0 a fragment's exchange runs in a background thread and is applied τ steps later; the last
    step waits for it. One exchange is in flight at a time: a due round first lands the one before.
    """

    def __init__(self, trainer):
        self.trainer = trainer
        self.args: DiLoCoConfig = trainer.args
        self.outer: OuterLoop | None = None
        self.comm: ReplicaComm | None = None
        self.backend = None  # FixedGroup or torchft_backend.TorchftRounds, made at the start of training
        self.codec: Codec | None = None if self.args.compression == "none" else make_codec(
            self.args.compression, chunk=self.args.compression_chunk, sparse_k=self.args.sparse_k,
            sparse_chunk=self.args.sparse_chunk, sparse_bits=self.args.sparse_bits)
        self.feedback: ErrorFeedback | None = None
        self.saved_outer_state: dict | None = None
        self.saved_replica_state: dict | None = None
        self.resumed_from: str | None = None  # the checkpoint this run continues, for the next round's record
        self.resume_note: dict = {}
        self.reached_before_resume = 0
        self.startup_bytes: int | None = None
        self.deferred = {"should_save": False, "should_evaluate": False}
        self.log = RoundLog(plain_console=self.args.disable_tqdm)
        self.stop_requested = False
        self.stopped_at: int | None = None  # the step at which a stop request (from any replica) ended training
        self.previous_agreement = float("nan")  # cos(Δ_i, Δ) of the last round, sent with the next sync
        self.overlap = Overlap()
        self.sync_delays: dict[int, int] = {}  # τ of each fragment chosen by sync_delay auto (else sync_delay)
        self.measured_fragments: set[int] = set()  # fragments whose τ came from their own measured exchange
        self.exchanged: tuple[list[int], float] = ([], 0.0)  # the fragments of the last exchange, and its seconds
        self.bad_rounds = 0  # consecutive rounds in which no replica had a finite pseudo-gradient
        self.completed_rounds = 0  # rounds completed by this process since it started (for save_every_rounds)
        self.schedule = Schedule(self.args.inner_steps, self.args.num_fragments)
        self.previous_blocked = 0.0  # seconds the last round kept this replica waiting, sent with the next sync
        self.fragment_syncs = 0  # fragment syncs completed since this process started (inner_steps auto measures 2F)
        self.auto_choice: dict | None = None  # the inner_steps auto decision, once made
        self.last_round_tokens = 0  # tokens of the round launched last (torchft carries them over a rollback)
        self.round_started = time.perf_counter()
        self._reset_round()

    @property
    def on_torchft(self) -> bool:
        return self.args.outer_backend == "torchft"

    @property
    def sync_every(self) -> int:
        return self.schedule.sync_every

    @property
    def total_rounds(self) -> int | None:
        return self.log.total_rounds

    @property
    def history(self) -> list[dict]:
        return self.log.history

    def request_stop(self) -> None:
        """Stop at the end of the current round, with a checkpoint. Safe to call from a signal handler.

        The request rides along with the round's sync, so every replica stops after the same step.
        """
        self.stop_requested = True

    def _reset_round(self) -> None:
        self.round_loss = torch.zeros(())
        self.round_steps = 0
        self.round_tokens = 0
        self.round_compute = 0.0
        self._step_started: float | None = None
        self.round_started = time.perf_counter()

    # --- inner loop bookkeeping (local only) ---

    def observe_micro_batch(self, loss: torch.Tensor, inputs: dict) -> None:
        if self.round_loss.device != loss.device:
            self.round_loss = self.round_loss.to(loss.device)
        self.round_loss += loss.detach().float()
        input_ids = inputs.get("input_ids") if hasattr(inputs, "get") else None
        if input_ids is not None:
            self.round_tokens += input_ids.numel()

    def on_step_begin(self, args, state, control, **kwargs):
        self.log.flush()
        self._step_started = time.perf_counter()

    # --- start of training ---

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        replica = self.trainer.accelerator.unwrap_model(model if model is not None else self.trainer.model)
        named = [(name, p) for name, p in replica.named_parameters() if p.requires_grad]
        params = [p for _, p in named]
        resumed = self.saved_outer_state is not None
        if not self.on_torchft and not resumed:
            # The replicas must start from identical parameters: checked by digest before the first inner step,
            # and rank 0's broadcast only where they differ. Reported with the first round (`startup_bytes`).
            # (torchft: the same check rides in the first round's membership table, TorchftRounds._start_identical.)
            self.startup_bytes = self.trainer.comm.start_identical([local_shard(p) for p in params]).bytes_sent
        try:
            fragments = assign_fragments([name for name, _ in named], args.num_fragments, args.fragment_pattern)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        self.outer = OuterLoop(
            params,
            lr=args.outer_lr,
            momentum=args.outer_momentum,
            nesterov=args.outer_nesterov,
            optimizer=args.outer_optimizer,
            offload=args.offload_outer_state,
            bucket_numel=max(1, int(args.sync_bucket_mb * 2**20 / 4)),
            fragments=fragments,
        )
        if self.on_torchft:
            from .torchft_backend import TorchftRounds

            self.backend = TorchftRounds(self, args)
        else:
            self.backend = FixedGroup(self.trainer.comm, self.schedule)
        self.comm = self.backend.comm
        # FSDP2's row cuts tell each member which values it syncs; a tensor-parallel member syncs what it holds.
        self.comm.bucket_shapes = None if args.tensor_parallel else self.outer.bucket_shapes()
        self.comm.repeated_spans = self.outer.repeated_spans(self.comm.member % args.tp_size) if args.tensor_parallel \
            else None
        if args.error_feedback:
            self.feedback = ErrorFeedback(args.error_feedback_decay,
                                          "cpu" if args.offload_outer_state else self.comm.device)
        if resumed:
            self.outer.load_state_dict(self.saved_outer_state)
            self.outer.copy_global_to_replica()
            self._load_schedule()
            self._load_replica_state()
            self.saved_outer_state = None
        self._stagger_end(state.global_step, state.max_steps, warn=True)
        self.log.total_rounds = self.schedule.total_rounds(state.max_steps)
        self.cumulative_bytes = 0
        self.train_started = time.time()
        if self.trainer.is_world_process_zero():
            rounds = read_sync_rounds(args.output_dir)
            reached = max([r["step"] for r in rounds] + [self.reached_before_resume, state.global_step])
            self.log.writer = RoundWriter(args.output_dir)
            self.log.report = self._report
            # torch: rounds past the checkpoint are retrained; torchft: a restarted replica continues its record.
            kept = rounds if self.on_torchft else self.log.writer.truncate_after(state.global_step)
            if resumed:
                # Rounds after the checkpoint are gone with the processes that made them: say how many steps.
                self.resume_note = {"resumed_from": self.resumed_from,
                                    "steps_lost": max(0, reached - state.global_step)}
            self.cumulative_bytes = kept[-1]["cumulative_bytes_per_replica"] if kept else 0
            logger.info(
                "DiLoCo: %d replica(s), H=%d, syncing %d trainable parameters per round, outer %s lr %g momentum %g%s, "
                "compression %s%s, %d fragment(s), sync delay %d, backend %s",
                self.args.num_replicas if self.on_torchft else self.comm.num_replicas, args.inner_steps,
                self.outer.numel, args.outer_optimizer, args.outer_lr, args.outer_momentum,
                " (Nesterov)" if args.outer_nesterov else "",
                args.compression, " + error feedback" if args.error_feedback else "", args.num_fragments,
                args.sync_delay, args.outer_backend,
            )
        self._reset_round()
        if self.on_torchft:
            # Before the first inner step: join the quorum; a late (or restarted) replica heals from a live peer here.
            self._round(state, joining=True)
            joined = self.backend.last_start
            if self.trainer.is_world_process_zero():
                print(f"[diloco] replica {args.replica_id} joined at round {self.backend.global_round} (step "
                      f"{state.global_step}){', healed from a live peer' if joined.healed else ''}; "
                      f"{len(joined.members)} replica(s) in the quorum", flush=True)
            self.log.flush()
            self._reset_round()

    # --- end of each inner step: maybe sync ---

    def on_step_end(self, args, state, control, **kwargs):
        if self._step_started is not None:
            self.round_compute += time.perf_counter() - self._step_started
            self._step_started = None
        self.round_steps += 1
        step = state.global_step
        lands = self.overlap.lands(step, state.max_steps)
        at_boundary = False
        over = self.on_torchft and self.backend.run_over()  # torchft: healed from a replica that finished the run
        if not over and (lands or self.backend.due(step, state.max_steps)):
            stop = self._sync(state)
            at_boundary = self.overlap.in_flight is None
            if at_boundary:
                self.completed_rounds += 1
                every = args.save_every_rounds
                if every and (self.completed_rounds % every == 0 or step >= state.max_steps):
                    control.should_save = True
            if stop and step < state.max_steps:
                self.stopped_at = step
                if self.trainer.is_world_process_zero():
                    logger.warning("DiLoCo: stop requested; saving a checkpoint at step %d and stopping.", step)
                control.should_save = True
                control.should_training_stop = True
        if self.on_torchft and self.backend.run_over() and not control.should_training_stop:
            # The run ended by its round count (or this replica healed from one that finished it): the final model
            # is θ_global, whatever this replica trained since its last round.
            self.outer.copy_global_to_replica()
            if step < state.max_steps and args.eval_strategy != "no":
                control.should_evaluate = True
            control.should_training_stop = True
        self._align_to_round(control, at_boundary)
        return control

    def _sync(self, state) -> bool:
        """The sync work of this step: land an overlapped round that is due, then run or start the round due now.
        Returns whether any replica asked to stop (known from the rounds that completed)."""
        step, stop = state.global_step, False
        if self.overlap.lands(step, state.max_steps):
            stop |= self._land(state)
        # A stop learned from the round that landed ends training here: no new round is launched to be left in
        # flight (in a staggered end one lands as the next is launched).
        if self.backend.due(step, state.max_steps) and not (stop and step < state.max_steps):
            stop |= self._round(state)
        if step >= state.max_steps and self.schedule.end is not None:
            # The staggered end: every fragment's last sync has landed; the final model is θ_global.
            self.outer.copy_global_to_replica()
        return stop

    def _round(self, state, joining: bool = False) -> bool:
        """Run the round due now: here, blocking; or with sync_delay > 0 in the background, the backend's start
        (torchft: the quorum, which waits for the slowest replica) included, so the replica trains on meanwhile."""
        step, max_steps = state.global_step, state.max_steps
        launched = time.perf_counter()
        local = self._local_round()  # this replica's numbers, read here, before the inner loop moves on
        self.last_round_tokens = self.round_tokens
        outer_lr = self.outer.lr()
        stats = self._round_stats()
        measured = self.exchanged[0]  # the fragments whose exchange time these statistics carry
        self.comm.arrive(step)
        if self.args.sync_delay > 0 and step < max_steps and not joining:
            fragments = self.backend.expected_fragments(step, max_steps)
            buckets = [b for f in fragments for b in self.outer.fragment_buckets[f]]
            deltas = snapshot(self.outer, self.comm, buckets)
            delay = self.schedule.final_delay(step) or max(self._delay(f) for f in fragments)
            self.overlap.launch(lambda: self._background_round(step, max_steps, local, fragments, deltas, stats),
                                step, delay, outer_lr, time.perf_counter() - launched, measured)
            self._reset_round()
            return False
        start = self._guarded(lambda: self.backend.start(step, max_steps, local, joining=joining))
        self.backend.last_start = start
        if start.empty:  # nobody brings progress (every participant is joining): only the vote
            result = RoundResult(weights=[0.0] * max(1, len(start.members)), committed=self.comm.vote())
            self._reset_round()
            self._finish(state, start, result)
            return start.stop_requested
        buckets = [b for f in start.fragments for b in self.outer.fragment_buckets[f]]
        deltas = None if start.stash is None else [start.stash[b] for b in buckets]
        exchanged = time.perf_counter()
        with self.comm.naming_the_absent(step):
            if deltas is None:  # a blocking round takes θ_global as it is (α applies to overlapped rounds only)
                result = outer_round(self.outer, self.comm, buckets, codec=self.codec, feedback=self.feedback,
                                     stats=stats, weight=start.weight, alpha=0.0)
            else:
                result = land(self.outer, exchange(self.comm, buckets, deltas, codec=self.codec,
                                                   feedback=self.feedback, stats=stats, weight=start.weight))
        done = time.perf_counter()
        self._reset_round()
        self.exchanged = (start.fragments, done - exchanged)
        return start.stop_requested | self._complete(state, result, start, step, outer_lr, done - exchanged,
                                                     done - launched, measured)

    def _local_round(self) -> dict:
        """This replica's numbers for the backend's start (torchft: its row of the membership table)."""
        local = {"steps": self.round_steps, "tokens": self.round_tokens, "loss_sum": float(self.round_loss.item()),
                 "compute_seconds": self.round_compute, "stop_requested": self.stop_requested}
        if self.on_torchft:  # a replica whose parameters are not finite comes with weight 0
            local["finite"] = is_finite(self.outer.params)
        return local

    def _background_round(self, step, max_steps, local, fragments, deltas, stats):
        """An overlapped round, in the background thread: the backend's start, then the exchange of the Δ_i taken
        at launch. A replica whose round turns out to sync other fragments than it expected (torchft: it healed
        from a peer further along) takes part with weight 0, sending zeros of the agreed sizes."""
        start = self._guarded(lambda: self.backend.start(step, max_steps, local, overlapped=True))
        started = time.perf_counter()
        buckets = [b for f in start.fragments for b in self.outer.fragment_buckets[f]]
        weight = start.weight
        if start.fragments != fragments or start.weight == 0:
            deltas = [torch.zeros(self.outer.bucket_numel(self.outer.buckets[b]), device=self.comm.device)
                      for b in buckets]
            weight = 0.0
        if start.empty:
            landed = Exchange(buckets, [], RoundResult(weights=[0.0] * max(1, len(start.members)),
                                                       committed=self.comm.vote()))
        else:
            landed = exchange(self.comm, buckets, deltas, codec=self.codec, feedback=self.feedback, stats=stats,
                              weight=weight)
        return start, landed, time.perf_counter() - started

    def _guarded(self, run):
        """torchft: a quorum that never formed becomes one sentence."""
        try:
            return run()
        except (RuntimeError, TimeoutError) as error:
            if not self.on_torchft:
                raise
            raise RunError(f"the torchft round failed ({first_line(error)}): no round formed within sync_timeout="
                           f"{self.args.sync_timeout:g} s; fewer than min_replicas={self.args.min_replicas} replicas "
                           f"are live, the others have finished the run, or the Lighthouse "
                           f"({self.args.lighthouse or 'TORCHFT_LIGHTHOUSE'}) cannot be reached.") from None

    def _land(self, state) -> bool:
        """Wait for the overlapped round (the time it makes the inner loop wait is blocked time) and apply it, if
        it committed."""
        flight = self.overlap.take()
        waited = time.perf_counter()
        with self.comm.naming_the_absent(flight.launched_at):
            start, landed, exchange_seconds = flight.future.result()
        if start.empty:
            self._finish(state, start, landed.result)
            return start.stop_requested
        result = land(self.outer, landed, self.args.fragment_alpha, healthy=landed.result.committed and
                      self._healthy(landed.result))
        blocked = flight.launch_seconds + time.perf_counter() - waited
        self.exchanged = (start.fragments, exchange_seconds)
        return start.stop_requested | self._complete(state, result, start, flight.launched_at, flight.outer_lr,
                                                     exchange_seconds, blocked, flight.measured)

    def _round_stats(self):
        """This replica's statistics for the round, made once its pseudo-gradient norm is known."""
        mine = ReplicaStats(loss_sum=self.round_loss.item(), steps=self.round_steps, tokens=self.round_tokens,
                            compute_seconds=self.round_compute, stop_requested=float(self.stop_requested),
                            previous_agreement=self.previous_agreement,
                            previous_blocked_seconds=self.previous_blocked,
                            previous_exchange_seconds=self.exchanged[1])

        def stats(local_norm_sq: float) -> torch.Tensor:
            mine.pseudo_grad_norm_sq = local_norm_sq
            return mine.tensor()

        return stats

    def _healthy(self, result: RoundResult) -> bool:
        return result.weights is None or result.weights[self.comm.replica_index] > 0

    def _complete(self, state, result: RoundResult, start: RoundStart, launched_at, outer_lr, sync_seconds,
                  blocked, measured: list[int] = ()) -> bool:
        # This replica's own parameters were not finite (it sat the round out with weight 0): it takes θ_global.
        if not start.finite or (result.committed and start.weight > 0 and not self._healthy(result)):
            self._reset_replica(state.global_step)
        if result.committed:
            self._count_bad_rounds(result, state.global_step)
        # Agreement cos(Δ_i, Δ) needs the average, which only exists after the exchange, and the time this round
        # kept the replica waiting is known after it: both are sent with the NEXT round's statistics, so they cost
        # no collective of their own.
        if self.comm.sharded:  # each member measured its own shards: the replica's norms are their sums
            result.local_norm_sq, result.average_norm_sq, result.dot = self.comm.replica_total(
                [result.local_norm_sq, result.average_norm_sq, result.dot])
        self.previous_agreement = result.agreement
        self.previous_blocked = blocked
        result.cost.bytes_sent += start.extra_bytes
        self.cumulative_bytes += result.cost.bytes_sent
        stats = RoundStats(result.stats) if result.stats is not None else None
        record = {} if stats is None else round_record(
            stats=stats, result=result, step=state.global_step, round_number=self.schedule.round_at(launched_at),
            fragments=start.fragments, cumulative_bytes=self.cumulative_bytes, sync_seconds=sync_seconds,
            blocked=blocked, outer_lr=outer_lr, inner_lr=self.trainer._get_learning_rate(),
            num_replicas=self.comm.num_replicas, group_size=self.comm.group_size, sharded=self.comm.sharded,
            ddp_payload=sum(n * p.element_size() for n, p in zip(self.outer.full_numels, self.outer.params,
                                                                  strict=True)),
            compression=self.args.compression + ("+ef" if self.feedback is not None else ""),
            synced_parameters=sum(self.outer.full_numels[i] for f in start.fragments
                                  for b in self.outer.fragment_buckets[f] for i in self.outer.buckets[b]))
        if launched_at != state.global_step:
            record["launch_step"] = launched_at
        self.fragment_syncs += 1
        if self.args.auto_sync_delay and stats is not None and measured and state.global_step < state.max_steps:
            record["sync_delay_auto"] = self._choose_sync_delay(stats, list(measured))
        if self.args.auto_inner_steps and self.auto_choice is None and stats is not None and \
                self.fragment_syncs >= 2 * self.args.num_fragments and state.global_step < state.max_steps:
            record["inner_steps_auto"] = self._choose_inner_steps(stats, launched_at, state.max_steps)
        if "sync_delay_auto" in record or "inner_steps_auto" in record:
            self._stagger_end(state.global_step, state.max_steps)
        self._finish(state, start, result, record)
        return stats is not None and bool(stats.stop_requested.sum() > 0)

    def _finish(self, state, start: RoundStart, result: RoundResult, record: dict | None = None) -> None:
        """The backend's word on the round (torchft: commit bookkeeping, membership in the record), then the record
        is queued. A round with nothing exchanged (every participant joining) has no record."""
        record = self.backend.finish(start, result, record or {})
        if start.empty or not record:
            return
        record.update(self.resume_note)
        self.resume_note = {}
        if self.startup_bytes is not None:  # the first round: what starting from identical parameters cost
            record["startup_bytes"] = self.startup_bytes
            self.startup_bytes = None
        self.log.queue(record)

    def _delay(self, fragment: int) -> int:
        """τ of `fragment`'s next sync: sync_delay, or what sync_delay auto chose for it."""
        return self.sync_delays.get(fragment, self.args.sync_delay)

    def _stagger_end(self, step: int, max_steps: int, warn: bool = False) -> None:
        """final_sync staggered: place the final window for the fragments' current τ and H
        (schedule.Schedule.stagger_end), after the exchange in flight lands. Placed anew when an auto choice changes
        τ or H, until the window begins: from then on it stays, so every fragment's last sync happens once, at the
        step every replica agreed on. Where τ grew past what is left of the run, the window's syncs get shorter τ
        (they wait for the rest of their exchange); only a run too short for the first placement ends blocking."""
        if not self.args.staggered_end:
            return
        flight = self.overlap.in_flight
        busy_until = max(step, flight.lands_at if flight is not None else step)
        delays = [self._delay(f) for f in range(self.args.num_fragments)]
        if not self.schedule.stagger_end(max_steps, delays, busy_until=busy_until):
            if warn and self.trainer.is_world_process_zero():
                logger.warning("DiLoCo: the run is too short for a staggered end (final_sync); every fragment "
                               "syncs at the last step.")
        self.log.total_rounds = self.schedule.total_rounds(max_steps)

    def _choose_inner_steps(self, stats: RoundStats, launched_at: int, max_steps: int) -> dict:
        """inner_steps auto, from what the first rounds measured, the same on every replica (every number comes
        from the round's statistics, which every replica received alike). See schedule.choose_inner_steps; the
        new schedule starts at the step this round was launched at."""
        per_step = stats.compute_seconds / stats.steps.clamp(min=1)
        step_seconds = float(per_step.max())
        sync_seconds = float(stats.previous_blocked_seconds.max())
        overhead = self.args.max_sync_overhead
        chosen = choose_inner_steps(step_seconds, sync_seconds, num_fragments=self.args.num_fragments,
                                    sync_delay=self.args.sync_delay, max_sync_overhead=overhead)
        self.schedule.restart_at(launched_at, chosen)
        self.args.inner_steps = chosen
        self.log.total_rounds = self.schedule.total_rounds(max_steps)
        self.auto_choice = {"step_seconds": step_seconds, "sync_seconds": sync_seconds,
                            "max_sync_overhead": overhead, "chosen": chosen, "from_step": launched_at}
        if self.trainer.is_world_process_zero():
            logger.warning(
                "DiLoCo inner_steps auto: an inner step takes %.4f s and a fragment's sync kept the replicas waiting "
                "%.4f s, so H = %d keeps waiting under %.0f%% of compute (%d fragment(s)); H = %d from step %d on.",
                step_seconds, sync_seconds, chosen, 100 * overhead, self.args.num_fragments, chosen, launched_at)
        return self.auto_choice

    def _choose_sync_delay(self, stats: RoundStats, fragments: list[int]) -> dict:
        """sync_delay auto for `fragments` (those of the exchange before this round), from this round's statistics,
        which every replica received alike: see schedule.choose_sync_delay. The fragments' next syncs use it.
        A fragment not measured yet takes the τ that the same exchange, scaled by its size, would need, so that on
        a slow link only the first fragment's first sync waits for its transfer."""
        exchange = float(stats.previous_exchange_seconds.max())
        step_seconds = float((stats.compute_seconds / stats.steps.clamp(min=1)).max())
        most = self.schedule.sync_every - 1
        chosen = choose_sync_delay(exchange, step_seconds, most=most)
        for fragment in fragments:
            self.sync_delays[fragment] = chosen
        self.measured_fragments.update(fragments)
        measured_size = sum(self._fragment_size(f) for f in fragments)
        estimated = {}
        for fragment in range(self.args.num_fragments):
            if fragment not in self.measured_fragments and measured_size > 0:
                scaled = exchange * self._fragment_size(fragment) / measured_size
                self.sync_delays[fragment] = estimated[str(fragment)] = choose_sync_delay(scaled, step_seconds,
                                                                                          most=most)
        choice = {"fragments": fragments, "exchange_seconds": exchange, "step_seconds": step_seconds,
                  "chosen": chosen}
        if estimated:
            choice["estimated"] = estimated
        return choice

    def _fragment_size(self, fragment: int) -> int:
        """Values the fragment syncs (full parameter sizes, the same on every process)."""
        return sum(self.outer.full_numels[i] for b in self.outer.fragment_buckets[fragment]
                   for i in self.outer.buckets[b])

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
        replica = self.args.replica_id if self.on_torchft else self.comm.replica_index
        logger.warning("DiLoCo: replica %d had a non-finite pseudo-gradient at step %d; it sat the round out and "
                       "restarts from the global parameters.", replica, step)

    def _count_bad_rounds(self, result: RoundResult, step: int) -> None:
        """`max_bad_rounds` consecutive rounds with no healthy participant stop the run with one sentence."""
        self.bad_rounds = 0 if result.participants else self.bad_rounds + 1
        if self.bad_rounds >= self.args.max_bad_rounds:
            raise RunError(
                f"no replica had a finite pseudo-gradient for {self.bad_rounds} consecutive rounds (last at step "
                f"{step}); the run is diverging: lower learning_rate or outer_lr, or resume from an earlier "
                f"checkpoint."
            )

    # --- per-replica state in checkpoints ---

    def replica_state(self) -> dict:
        """What only this replica knows: its error-feedback residuals and, when replicas may differ after a
        round (several fragments, or α > 0), its own trainable parameters."""
        state: dict = {}
        if self.sync_delays:  # each fragment's τ that sync_delay auto chose, with what it was chosen from
            state["sync_delays"] = {"delays": dict(self.sync_delays), "exchanged": list(self.exchanged),
                                    "measured": sorted(self.measured_fragments)}
        if self.schedule.end is not None:  # the staggered end as placed, which stays once the last H steps begin
            state["final_window"] = {"launches": {str(k): list(v) for k, v in self.schedule.end.launches.items()},
                                     "last_regular": self.schedule.end.last_regular}
        if self.auto_choice is not None:  # the schedule inner_steps auto chose goes on after a resume
            state["schedule"] = {"origin_step": self.schedule.origin_step, "origin_round": self.schedule.origin_round,
                                 "inner_steps": self.args.inner_steps, "choice": self.auto_choice}
        if self.feedback is not None:
            state["error_feedback"] = self.feedback.state_dict()
        if self.outer is not None and (self.args.num_fragments > 1 or self.args.fragment_alpha > 0):
            state["params"] = [p.detach().cpu().clone() for p in self.outer.params]
        return state

    def _load_schedule(self) -> None:
        """After a resume: the schedule inner_steps auto had chosen, if it had (the checkpoint holds it)."""
        schedule = (self.saved_replica_state or {}).get("schedule")
        if schedule is None:
            return
        self.schedule.origin_step, self.schedule.origin_round = schedule["origin_step"], schedule["origin_round"]
        self.args.inner_steps = self.schedule.inner_steps = schedule["inner_steps"]
        self.auto_choice = schedule["choice"]

    @torch.no_grad()
    def _load_replica_state(self) -> None:
        state, self.saved_replica_state = self.saved_replica_state or {}, None
        if "sync_delays" in state:
            self.sync_delays = {int(f): int(d) for f, d in state["sync_delays"]["delays"].items()}
            fragments, seconds = state["sync_delays"]["exchanged"]
            self.exchanged = (list(fragments), float(seconds))
            self.measured_fragments = set(state["sync_delays"].get("measured", self.sync_delays))
        if "final_window" in state and self.args.staggered_end:
            window = state["final_window"]
            self.schedule.end = FinalWindow(launches={int(k): tuple(v) for k, v in window["launches"].items()},
                                            last_regular=int(window["last_regular"]))
        if self.feedback is not None and "error_feedback" in state:
            self.feedback.load_state_dict(state["error_feedback"])
        for param, saved in zip(self.outer.params, state.get("params", []), strict=False):
            param.copy_(saved)

    def _align_to_round(self, control, at_boundary: bool) -> None:
        """Postpone saves and evaluations that fall inside a round to the round's end."""
        for flag in self.deferred:
            if at_boundary:
                if self.deferred[flag]:
                    setattr(control, flag, True)
                    self.deferred[flag] = False
            elif getattr(control, flag):
                setattr(control, flag, False)
                if not self.deferred[flag] and self.trainer.is_world_process_zero() and not self.history:
                    logger.warning(
                        "DiLoCo: a %s falls inside a round; it is postponed to the end of the round (set "
                        "save_steps/eval_steps to multiples of inner_steps=%d to avoid this).",
                        "save" if flag == "should_save" else "evaluation", self.args.inner_steps,
                    )
                self.deferred[flag] = True

    # --- reporting ---

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.log.evaluated(state.global_step, (metrics or {}).get("eval_loss"))

    def _report(self, record: dict) -> None:
        """A written round to every tracker Trainer reports to (`report_to`: TensorBoard, trackio, W&B, MLflow, ...),
        as diloco/<name> at the round's step, through the same `on_log` that carries Trainer's own metrics. The
        console printers are left out: the round's line is printed already. (Integrations that prefix Trainer's
        training metrics with train/, as TensorBoard's and W&B's do, show train/diloco/<name>.)"""
        trainer = self.trainer
        at_round = replace(trainer.state, global_step=record["step"])
        logs = reported_metrics(record)
        for callback in trainer.callback_handler.callbacks:
            if not isinstance(callback, (DefaultFlowCallback, PrinterCallback, ProgressCallback, OuterLoopCallback)):
                callback.on_log(self.args, at_round, trainer.control, logs=dict(logs), model=trainer.model,
                                processing_class=trainer.processing_class, optimizer=trainer.optimizer,
                                lr_scheduler=trainer.lr_scheduler)

    def on_train_end(self, args, state, control, **kwargs):
        self.overlap.shutdown()
        self.log.flush()
        # The last round's agreement has no next sync to ride with; each replica hands it over through the store.
        last_agreement = self.comm.replica_values("last_agreement", self.previous_agreement, args.sync_timeout)
        if self.on_torchft and self.backend.run_over() and args.end_linger_seconds > 0:
            served = self.backend.linger(state.global_step, state.max_steps)
            if served:
                print(f"[diloco] replica {args.replica_id} handed the final model to replica(s) "
                      f"{', '.join(map(str, served))}, which missed the last round", flush=True)
        if self.backend is not None:
            self.backend.shutdown()
        if self.log.writer is None:
            return
        totals = summary(self.history, steps=state.global_step, train_started=self.train_started,
                         initial_eval_loss=self.log.initial_eval_loss, settings={
                             "num_replicas": self.args.num_replicas if self.on_torchft else self.comm.num_replicas,
                             "replica_group_size": self.args.replica_group_size,
                             "inner_steps": self.args.inner_steps,
                             "synced_parameters": self.outer.numel if self.outer else 0,
                             "compression": self.args.compression + ("+ef" if self.args.error_feedback else ""),
                             "num_fragments": self.args.num_fragments, "sync_delay": self.args.sync_delay,
                             "auto_sync_delay": self.args.auto_sync_delay})
        if last_agreement is not None and self.history and all(math.isfinite(x) for x in last_agreement):
            totals["last_round_agreement"] = {"round": self.history[-1]["round"], "replica_agreement": last_agreement}
        write_summary(args.output_dir, totals)
