"""DiLoCoTrainer: the DiLoCo outer loop wired into `transformers.Trainer`.

Each process is one replica. Trainer runs the inner loop untouched (its optimizer, scheduler, gradient
accumulation, clipping, mixed precision); this module adds what DiLoCo needs around it.

Design choices:
- No DDP. Accelerate would wrap the model in DistributedDataParallel and all-reduce gradients every step; the
  trainer prepares the model the way Accelerate prepares a model for evaluation (mixed precision and compilation
  only). The data loader is still sharded by Accelerate, so each replica reads its own disjoint batches.
- No hidden per-step collective. Trainer averages the logged loss over processes with an all-gather; here each
  replica logs its own loss, and the mean over replicas is reported once per round with the sync. Token-count
  gathers are switched off in DiLoCoConfig.
- The outer step runs in `on_step_end`, after the inner optimizer and scheduler stepped and before Trainer logs,
  evaluates or saves, so evaluations and checkpoints see θ_global. Every H steps, plus once at the last step (a
  partial last round is synced too, so the final model is always the global one).
- Saves and evaluations that fall inside a round are postponed to the end of that round (see DiLoCoConfig).
- Checkpoints hold, besides Trainer's files, each replica's own inner optimizer and scheduler state
  (`replica-<rank>/`) and the outer state (`diloco_outer.pt`: θ_global in fp32 and the outer optimizer).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback

from .codecs import Codec, ErrorFeedback, make_codec
from .comm import ReplicaComm, ring_all_reduce_bytes
from .config import ConfigError, DiLoCoConfig
from .data import ReplicaSliceSampler
from .elastic import ElasticRounds
from .errors import RunError, first_line
from .metrics import RoundWriter, format_round, read_sync_rounds, write_summary
from .outer import OuterLoop, RoundResult, apply, assign_fragments, exchange, is_finite, outer_round, snapshot
from .runs import PROGRESS_FILE

logger = logging.getLogger(__name__)

OUTER_STATE_FILE = "diloco_outer.pt"
REPLICA_DIR = "replica-{rank}"
REPLICA_STATE_FILE = "diloco_replica.pt"
TEMPORARY_PREFIX = "tmp-checkpoint-"  # a checkpoint being written; renamed to checkpoint-<step> when complete
PART_COMPLETE_FILE = "complete"  # in replica-<rank>/: this process's part of the checkpoint is written
# Per-replica statistics that ride along with each sync (see comm.ReplicaComm.sum_replicas). Slot 0 is the
# replica's health flag, filled in by outer.outer_round.
ROUND_STATS = ("healthy", "loss_sum", "steps", "tokens", "compute_seconds", "pseudo_grad_norm_sq", "stop_requested",
               "previous_agreement", "previous_blocked_seconds")


@contextlib.contextmanager
def _replica_local_loss_logging():
    """Make Trainer log this replica's own training loss instead of all-gathering it from every process.

    Trainer's logging calls the module-level `nested_gather`; swapping it for the identity while Trainer logs
    removes a collective per logging step. Nothing else in Trainer uses that name.
    """
    import transformers.trainer as trainer_module

    original = trainer_module.nested_gather
    trainer_module.nested_gather = lambda tensors, parallel_mode, name=None: tensors
    try:
        yield
    finally:
        trainer_module.nested_gather = original


class DiLoCoTrainer(Trainer):
    """`Trainer` that trains each process as a DiLoCo replica and averages replicas every `inner_steps` steps.

    Takes exactly what `Trainer` takes; `args` must be a `DiLoCoConfig`.

    Example (a runnable version is in the README's "Python" section)::

        trainer = DiLoCoTrainer(model=model, args=DiLoCoConfig(output_dir="out", inner_steps=50),
                                train_dataset=train, eval_dataset=held_out)
        trainer.train()
    """

    def __init__(self, model=None, args: DiLoCoConfig | None = None, *pargs, **kwargs):
        if args is None:
            args = DiLoCoConfig(output_dir="trainer_output")
        if not isinstance(args, DiLoCoConfig):
            raise TypeError(f"DiLoCoTrainer needs a DiLoCoConfig as args, got {type(args).__name__}.")
        super().__init__(model, args, *pargs, **kwargs)
        # Creates the replica/slice process groups (and the background sync's own, with sync_delay > 0).
        self.comm = ReplicaComm(args.replica_group_size, background=args.sync_delay > 0,
                                timeout_seconds=args.sync_timeout)
        self.diloco = ElasticOuterCallback(self) if args.outer_backend == "torchft" else OuterLoopCallback(self)
        self.add_callback(self.diloco)

    # --- no DDP: a replica trains alone between syncs ---------------------------------------------------------

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        prepare_model = self.accelerator.prepare_model

        def prepare_replica(model, device_placement=None, evaluation_mode=False):
            # evaluation_mode=True: device placement, mixed precision and compilation, but no DDP wrapper over
            # all processes, so no gradient all-reduce across replicas and no buffer broadcast on every step.
            model = prepare_model(model, device_placement=device_placement, evaluation_mode=True)
            if self.comm.replica_group is not None and not evaluation_mode:
                # A replica of several processes: DDP inside the replica only.
                device_ids = [torch.cuda.current_device()] if self.args.device.type == "cuda" else None
                model = torch.nn.parallel.DistributedDataParallel(
                    model, device_ids=device_ids, process_group=self.comm.replica_group, broadcast_buffers=False
                )
            return model

        self.accelerator.prepare_model = prepare_replica

    @property
    def data_shard(self) -> tuple[int, int]:
        """(this replica's shard, number of shards): the process's place in the launch, or with torchft (one
        launch per replica) the configured replica_id of num_replicas."""
        if self.args.outer_backend == "torchft":
            return self.args.replica_id, self.args.num_replicas
        return self.args.process_index, self.args.world_size

    def _get_train_sampler(self, train_dataset=None):
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        index, count = self.data_shard
        if self.args.data_sharding == "non_iid" and count > 1:
            return ReplicaSliceSampler(
                len(dataset), index, count, self.args.seed,
                shuffle=self.args.train_sampling_strategy != "sequential",
            )
        return super()._get_train_sampler(train_dataset)

    def get_train_dataloader(self):
        if self.args.data_sharding == "non_iid" and not hasattr(self.train_dataset, "__len__"):
            raise ConfigError(
                "data_sharding non_iid cuts the corpus into one contiguous slice per replica, which a streamed "
                "dataset does not have; set streaming: false or data_sharding: iid."
            )
        if self.args.outer_backend == "torchft":
            loader = self._one_shard_of_several()
        else:
            loader = super().get_train_dataloader()
        # A ReplicaSliceSampler already picks this replica's examples; Accelerate's batch sharding on top would
        # keep only every M-th of its batches, so that wrapper is made a pass-through.
        shard = getattr(loader, "batch_sampler", None)
        inner = getattr(getattr(shard, "batch_sampler", None), "sampler", None)
        if isinstance(inner, ReplicaSliceSampler):
            shard.num_processes, shard.process_index = 1, 0
        return loader

    def _one_shard_of_several(self):
        """torchft: one launch per replica, so Accelerate sees one process; shard the batches as it would for
        num_replicas processes (replica r takes batches r, r + M, ...), exactly as the torch backend does."""
        import accelerate.accelerator as accelerator_module

        prepare = accelerator_module.prepare_data_loader
        index, count = self.data_shard

        def sharded(*args, **kwargs):
            return prepare(*args, **{**kwargs, "num_processes": count, "process_index": index})

        accelerator_module.prepare_data_loader = sharded
        try:
            return super().get_train_dataloader()
        finally:
            accelerator_module.prepare_data_loader = prepare

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.diloco.observe_micro_batch(loss, inputs)
        return loss

    def _maybe_log_save_evaluate(self, *args, **kwargs):
        with _replica_local_loss_logging():
            return super()._maybe_log_save_evaluate(*args, **kwargs)

    def store_flos(self) -> None:
        # Trainer sums the floating point operations of all processes with an all-gather at every log. Replicas
        # run the same number of steps on batches of the same shape, so this replica's count times the number
        # of replicas is the total, with no collective.
        self.state.total_flos += self.current_flos * self.args.world_size
        self.current_flos = 0

    def train(self, *args, **kwargs):
        """Trainer.train, after recording the run's settings in `<output_dir>/run_config.json` (main process) unless
        `hf-diloco train` already wrote a fuller one: `hf-diloco push` and the app describe any run folder, however
        it was trained."""
        if self.is_world_process_zero():
            from .hub import RUN_CONFIG_FILE, trainer_settings

            path = Path(self.args.output_dir) / RUN_CONFIG_FILE
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(trainer_settings(self), indent=2, default=str) + "\n")
        return super().train(*args, **kwargs)

    def create_model_card(self, *args, **kwargs) -> None:
        """The DiLoCo card of hf_diloco.hub (settings table, metrics, curve), as `hf-diloco push` writes it.

        The settings come from this trainer's own args, so a trainer used from Python gets the full card.
        """
        if not self.is_world_process_zero():
            return
        from .hub import CARD_FILE, CURVE_FILE, model_card, trainer_settings, write_training_curve

        output_dir = Path(self.args.output_dir)
        write_training_curve(output_dir, output_dir / CURVE_FILE)
        card = model_card(output_dir, self.hub_model_id, settings=trainer_settings(self))
        (output_dir / CARD_FILE).write_text(card)

    # --- checkpoints: every replica's inner state plus the outer state ----------------------------------------

    def _save_checkpoint(self, model, trial) -> None:
        """Trainer's checkpoint, made atomic: every process writes its part under `tmp-checkpoint-<step>`, and the
        folder is renamed to `checkpoint-<step>` only once every process has said (through the rendezvous store)
        that its part is complete. A process killed at any instant leaves a `tmp-` folder, never a
        `checkpoint-<step>` that lacks a replica's optimizer or the outer state."""
        import transformers.trainer as trainer_module

        step = self.state.global_step
        run_dir = Path(self._get_output_dir(trial=trial))
        final, temporary = run_dir / f"checkpoint-{step}", run_dir / f"{TEMPORARY_PREFIX}{step}"
        original = trainer_module.PREFIX_CHECKPOINT_DIR
        trainer_module.PREFIX_CHECKPOINT_DIR = TEMPORARY_PREFIX.rstrip("-")
        try:
            super()._save_checkpoint(model, trial)
        finally:
            trainer_module.PREFIX_CHECKPOINT_DIR = original
        (self._replica_dir(str(temporary)) / PART_COMPLETE_FILE).touch()
        self.comm.wait_for_parts(f"checkpoint-{step}", self.args.sync_timeout)
        # One process renames per filesystem, as Trainer saves: the main process, or each machine's with
        # save_on_each_node (machines without a shared filesystem).
        if self.args.should_save:
            if final.exists():  # a checkpoint of the same step from an earlier attempt of this run
                remove_checkpoint(final)
            temporary.rename(final)
            if self.args.save_total_limit:
                keep_newest_checkpoints(run_dir, self.args.save_total_limit, self.state.best_model_checkpoint)

    def _replica_dir(self, checkpoint: str) -> Path:
        return Path(checkpoint) / REPLICA_DIR.format(rank=self.args.process_index)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        replica_dir = self._replica_dir(output_dir)
        replica_dir.mkdir(parents=True, exist_ok=True)
        torch.save(self.optimizer.state_dict(), replica_dir / "optimizer.pt")
        torch.save(self.lr_scheduler.state_dict(), replica_dir / "scheduler.pt")
        replica_state = self.diloco.replica_state()
        if replica_state:
            torch.save(replica_state, replica_dir / REPLICA_STATE_FILE)
        if self.args.should_save and self.diloco.outer is not None:
            torch.save(self.diloco.outer.state_dict(), Path(output_dir) / OUTER_STATE_FILE)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        replica_dir = self._replica_dir(checkpoint)
        if (replica_dir / "optimizer.pt").exists():
            # Loaded to CPU; the optimizer moves its state next to the parameters.
            state = torch.load(replica_dir / "optimizer.pt", map_location="cpu", weights_only=True)
            self.optimizer.load_state_dict(state)
            self.lr_scheduler.load_state_dict(torch.load(replica_dir / "scheduler.pt", weights_only=True))
        else:
            # A checkpoint written by plain Trainer (or by a run with fewer replicas): take what it has.
            super()._load_optimizer_and_scheduler(checkpoint)
        self.diloco.resumed_from = str(checkpoint)
        progress = Path(self.args.output_dir) / PROGRESS_FILE  # the step the interrupted run had reached
        with contextlib.suppress(OSError, ValueError, KeyError):
            self.diloco.reached_before_resume = int(json.loads(progress.read_text())["step"])
        replica_file = replica_dir / REPLICA_STATE_FILE
        self.diloco.saved_replica_state = torch.load(replica_file, weights_only=True) if replica_file.exists() else None
        outer_file = Path(checkpoint) / OUTER_STATE_FILE
        self.diloco.saved_outer_state = torch.load(outer_file, weights_only=True) if outer_file.exists() else None


def remove_checkpoint(folder: Path) -> None:
    """Delete a checkpoint so that no instant shows it incomplete: it is first renamed out of the `checkpoint-*`
    names (one atomic rename, into the temporary names a resume clears away), then its files are removed."""
    trash = folder.with_name(f"{TEMPORARY_PREFIX}removed-{folder.name}")
    folder.rename(trash)
    shutil.rmtree(trash, ignore_errors=True)


def keep_newest_checkpoints(run_dir: Path, limit: int, best: str | None = None) -> None:
    """`save_total_limit`: remove all but the newest `limit` complete checkpoints by step (and the best one)."""
    steps = sorted(int(p.name.split("-")[1]) for p in run_dir.glob("checkpoint-*") if p.name.split("-")[1].isdigit())
    for step in steps[:-limit] if limit > 0 else []:
        folder = run_dir / f"checkpoint-{step}"
        if not (best and Path(best).name == folder.name):
            remove_checkpoint(folder)


@dataclass
class InFlight:
    """An overlapped round: its exchange runs in the background from `launched_at` until `lands_at`."""

    future: Future
    launched_at: int
    lands_at: int
    fragments: list[int]
    outer_lr: float
    launch_seconds: float  # time the inner loop spent starting it (taking the pseudo-gradient snapshot)


class OuterLoopCallback(TrainerCallback):
    """Runs the outer rounds on their schedule and reports them. Owned by a DiLoCoTrainer.

    Schedule: with F fragments, fragment f syncs at the steps s with s mod H = (f + 1)·H/F mod H (F = 1: every H
    steps), and every fragment syncs at the last step so the final model is the global one. With sync_delay τ > 0
    a fragment's exchange runs in a background thread and is applied τ steps later; the last step waits for it.
    """

    def __init__(self, trainer: DiLoCoTrainer):
        self.trainer = trainer
        self.args: DiLoCoConfig = trainer.args
        self.outer: OuterLoop | None = None
        self.comm: ReplicaComm | None = None
        self.writer: RoundWriter | None = None
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
        self.pending_records: list[dict] = []  # rounds completed at this step, written once its eval is known
        self.history: list[dict] = []
        self.initial_eval_loss: float | None = None
        self.stop_requested = False
        self.stopped_at: int | None = None  # the step at which a stop request (from any replica) ended training
        self.previous_agreement = float("nan")  # cos(Δ_i, Δ) of the last round, sent with the next sync
        self.in_flight: InFlight | None = None
        self.bad_rounds = 0  # consecutive rounds in which no replica had a finite pseudo-gradient
        self.completed_rounds = 0  # rounds completed by this process since it started (for save_every_rounds)
        # The sync schedule: from step `origin_step` (round `origin_round`), a fragment syncs every `sync_every`
        # steps. Fixed for a run, except once with inner_steps auto (see `_choose_inner_steps`).
        self.origin_step, self.origin_round, self.sync_every = 0, 0, 1
        self.previous_blocked = 0.0  # seconds the last round kept this replica waiting, sent with the next sync
        self.fragment_syncs = 0  # fragment syncs completed since this process started (inner_steps auto measures 2F)
        self.auto_choice: dict | None = None  # the inner_steps auto decision, once made
        self.background: ThreadPoolExecutor | None = None
        self._reset_round()

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

    # --- inner loop bookkeeping (local only) ---

    def observe_micro_batch(self, loss: torch.Tensor, inputs: dict) -> None:
        if self.round_loss.device != loss.device:
            self.round_loss = self.round_loss.to(loss.device)
        self.round_loss += loss.detach().float()
        input_ids = inputs.get("input_ids") if hasattr(inputs, "get") else None
        if input_ids is not None:
            self.round_tokens += input_ids.numel()

    def on_step_begin(self, args, state, control, **kwargs):
        self._flush_pending()
        self._step_started = time.perf_counter()

    # --- start of training ---

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        replica = self.trainer.accelerator.unwrap_model(model if model is not None else self.trainer.model)
        named = [(name, p) for name, p in replica.named_parameters() if p.requires_grad]
        params = [p for _, p in named]
        self.comm = self.trainer.comm
        resumed = self.saved_outer_state is not None
        if not resumed:
            # The replicas must start from identical parameters: checked by digest before the first inner step,
            # and rank 0's broadcast only where they differ. Reported with the first round (`startup_bytes`).
            self.startup_bytes = self.comm.start_identical(params).bytes_sent
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
        if args.error_feedback:
            self.feedback = ErrorFeedback(args.error_feedback_decay,
                                          "cpu" if args.offload_outer_state else self.comm.device)
        self.sync_every = args.inner_steps // args.num_fragments
        if resumed:
            self.outer.load_state_dict(self.saved_outer_state)
            self.outer.copy_global_to_replica()
            self._load_schedule()
            self._load_replica_state()
            self.saved_outer_state = None
        self.total_rounds = self._total_rounds(state.max_steps)
        self.cumulative_bytes = 0
        self.train_started = time.time()
        if self.trainer.is_world_process_zero():
            rounds = read_sync_rounds(args.output_dir)
            reached = max([r["step"] for r in rounds] + [self.reached_before_resume, state.global_step])
            self.writer = RoundWriter(args.output_dir)
            # torch: rounds past the checkpoint are retrained; torchft: a restarted replica continues its record.
            kept = self.writer.truncate_after(state.global_step) if args.outer_backend == "torch" else rounds
            if resumed:
                # Rounds after the checkpoint are gone with the processes that made them: say how many steps.
                self.resume_note = {"resumed_from": self.resumed_from,
                                    "steps_lost": max(0, reached - state.global_step)}
            self.cumulative_bytes = kept[-1]["cumulative_bytes_per_replica"] if kept else 0
            logger.info(
                "DiLoCo: %d replica(s), H=%d, syncing %d trainable parameters per round, outer %s lr %g momentum %g%s, "
                "compression %s%s, %d fragment(s), sync delay %d",
                self.comm.num_replicas, args.inner_steps, self.outer.numel, args.outer_optimizer, args.outer_lr,
                args.outer_momentum, " (Nesterov)" if args.outer_nesterov else "", args.compression,
                " + error feedback" if args.error_feedback else "", args.num_fragments, args.sync_delay,
            )
        self._reset_round()

    # --- end of each inner step: maybe sync ---

    def due_fragments(self, step: int, max_steps: int) -> list[int]:
        """Fragments whose round ends at `step`: every fragment at the last step."""
        if step >= max_steps:
            return list(range(self.args.num_fragments))
        since = step - self.origin_step
        if since <= 0 or since % self.sync_every:
            return []
        return [(self.round_at(step) - 1) % self.args.num_fragments]

    def round_at(self, step: int) -> int:
        """The number of the round (one fragment's sync) launched at `step`, counted from 1."""
        return self.origin_round + math.ceil((step - self.origin_step) / self.sync_every)

    def _total_rounds(self, max_steps: int) -> int | None:
        return self.round_at(max_steps) if max_steps > 0 else None

    def on_step_end(self, args, state, control, **kwargs):
        if self._step_started is not None:
            self.round_compute += time.perf_counter() - self._step_started
            self._step_started = None
        self.round_steps += 1
        step = state.global_step
        lands = self.in_flight is not None and (step >= self.in_flight.lands_at or step >= state.max_steps)
        at_boundary = False
        if lands or self.due_fragments(step, state.max_steps):
            stop = self._sync(state)
            at_boundary = self.in_flight is None
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
        self._align_to_round(control, at_boundary)
        return control

    def _sync(self, state) -> bool:
        """The sync work of this step: apply an overlapped round that is due, then run or start the rounds of the
        fragments due now. Returns whether any replica asked to stop (known from the rounds that completed).
        """
        step, stop = state.global_step, False
        if self.in_flight is not None and (step >= self.in_flight.lands_at or step >= state.max_steps):
            stop |= self._land(state)
        due = self.due_fragments(step, state.max_steps)
        if not due:
            return stop
        buckets = [b for f in due for b in self.outer.fragment_buckets[f]]
        stats = self._round_stats()
        self.comm.arrive(step)
        launched = time.perf_counter()
        if self.args.sync_delay > 0 and step < state.max_steps:
            deltas = snapshot(self.outer, self.comm, buckets)
            if self.background is None:
                self.background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diloco-sync")
            future = self.background.submit(self._timed_exchange, buckets, deltas, stats)
            self.in_flight = InFlight(future, step, step + self.args.sync_delay, due, self.outer.lr(),
                                      time.perf_counter() - launched)
            self._reset_round()
            return stop
        outer_lr = self.outer.lr()
        with self._timeout_names_the_absent(step):
            result = outer_round(self.outer, self.comm, buckets, codec=self.codec, feedback=self.feedback,
                                 stats=stats, alpha=0.0)  # a blocking round takes θ_global as it is
        seconds = time.perf_counter() - launched
        self._reset_round()
        return stop | self._complete(state, result, due, step, outer_lr, seconds, seconds)

    @contextlib.contextmanager
    def _timeout_names_the_absent(self, step: int):
        """A collective that failed (sync_timeout expired, or a peer's connection closed) becomes one sentence
        naming the replicas that never reached this sync and the last sync step each was seen at."""
        try:
            yield
        except RuntimeError as error:
            if not self.comm.active:
                raise
            absent = self.comm.absent(step)
            if not absent:
                raise RunError(f"the sync at step {step} failed: {first_line(error)}.") from None
            names = ", ".join(
                f"replica {replica} (last seen at the sync of step {seen})" if seen is not None
                else f"replica {replica} (never reached a sync)" for replica, seen in sorted(absent.items())
            )
            raise RunError(
                f"the sync at step {step} gave up after waiting for {names} (sync_timeout={self.args.sync_timeout:g} "
                f"s, or its connection closed); check that process, or raise sync_timeout for slow links."
            ) from None

    def _timed_exchange(self, buckets, deltas, stats):
        started = time.perf_counter()
        landed = exchange(self.comm, buckets, deltas, codec=self.codec, feedback=self.feedback, stats=stats)
        return landed, time.perf_counter() - started

    def _land(self, state) -> bool:
        """Wait for the overlapped round (the time it makes the inner loop wait is blocked time) and apply it."""
        flight, self.in_flight = self.in_flight, None
        waited = time.perf_counter()
        with self._timeout_names_the_absent(flight.launched_at):
            landed, exchange_seconds = flight.future.result()
        apply(self.outer, landed, self.args.fragment_alpha, healthy=self._healthy(landed.result))
        blocked = flight.launch_seconds + time.perf_counter() - waited
        return self._complete(state, landed.result, flight.fragments, flight.launched_at, flight.outer_lr,
                              exchange_seconds, blocked)

    def _round_stats(self):
        """This replica's statistics for the round, made once its pseudo-gradient norm is known."""
        values = [1.0, self.round_loss.item(), self.round_steps, self.round_tokens, self.round_compute, 0.0,
                  float(self.stop_requested), self.previous_agreement, self.previous_blocked]
        slot = ROUND_STATS.index("pseudo_grad_norm_sq")

        def stats(local_norm_sq: float) -> torch.Tensor:
            values[slot] = local_norm_sq
            return torch.tensor(values, dtype=torch.float64)

        return stats

    def _healthy(self, result: RoundResult) -> bool:
        return result.healthy is None or result.healthy[self.comm.replica_index]

    def _complete(self, state, result: RoundResult, fragments, launched_at, outer_lr, sync_seconds, blocked) -> bool:
        if not self._healthy(result):
            self._reset_replica(state.global_step)
        self._count_bad_rounds(result, state.global_step)
        # Agreement cos(Δ_i, Δ) needs the average, which only exists after the exchange, and the time this round
        # kept the replica waiting is known after it: both are sent with the NEXT round's statistics, so they cost
        # no collective of their own.
        self.previous_agreement = result.agreement
        self.previous_blocked = blocked
        record = self._round_record(state, result, fragments, launched_at, outer_lr, sync_seconds, blocked)
        self.fragment_syncs += 1
        if self.args.auto_inner_steps and self.auto_choice is None and self.fragment_syncs >= 2 * \
                self.args.num_fragments and state.global_step < state.max_steps:
            record["inner_steps_auto"] = self._choose_inner_steps(result, launched_at, state.max_steps)
        self.pending_records.append(record)
        return bool(result.stats[..., ROUND_STATS.index("stop_requested")].sum() > 0)

    def _choose_inner_steps(self, result: RoundResult, launched_at: int, max_steps: int) -> dict:
        """inner_steps auto: the smallest H whose syncs keep the replicas waiting at most max_sync_overhead of their
        compute time, from what the first rounds measured, the same on every replica (every number comes from the
        round's statistics, which every replica received alike):

            t_step  = the slowest replica's compute seconds per inner step in this round
            t_sync  = the longest a replica waited for one fragment's sync, in the round before (the next round's
                      statistics carry it; overlap with sync_delay makes it small)
            H       = F * t_sync / (max_sync_overhead * t_step), rounded up to a multiple of F, and at least
                      F * (sync_delay + 1), so an overlapped sync still lands before the next is due

        The new schedule starts at the step this round was launched at.
        """
        stat = {name: result.stats[..., i] for i, name in enumerate(ROUND_STATS)}
        fragments, delay, overhead = self.args.num_fragments, self.args.sync_delay, self.args.max_sync_overhead
        per_step = stat["compute_seconds"] / stat["steps"].clamp(min=1)
        step_seconds = float(per_step.max())
        sync_seconds = float(stat["previous_blocked_seconds"].max())
        wanted = fragments * sync_seconds / (overhead * step_seconds) if step_seconds > 0 else fragments
        chosen = max(fragments * (delay + 1), fragments * math.ceil(wanted / fragments))
        self.origin_round, self.origin_step = self.round_at(launched_at), launched_at
        self.sync_every = chosen // fragments
        self.args.inner_steps = chosen
        self.total_rounds = self._total_rounds(max_steps)
        self.auto_choice = {"step_seconds": step_seconds, "sync_seconds": sync_seconds,
                            "max_sync_overhead": overhead, "chosen": chosen, "from_step": launched_at}
        if self.trainer.is_world_process_zero():
            logger.warning(
                "DiLoCo inner_steps auto: an inner step takes %.4f s and a fragment's sync kept the replicas waiting "
                "%.4f s, so H = %d keeps waiting under %.0f%% of compute (%d fragment(s)); H = %d from step %d on.",
                step_seconds, sync_seconds, chosen, 100 * overhead, fragments, chosen, launched_at)
        return self.auto_choice

    @torch.no_grad()
    def _reset_replica(self, step: int, replica: int | None = None) -> None:
        """This replica's pseudo-gradient was not finite: it takes θ_global for every parameter and, if its inner
        optimizer state holds non-finite values too, starts that state afresh (stale NaN moments would poison the
        next step again)."""
        self.outer.copy_global_to_replica()
        optimizer = self.trainer.optimizer
        moments = [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
        if not is_finite(moments):
            optimizer.state.clear()
        logger.warning("DiLoCo: replica %d had a non-finite pseudo-gradient at step %d; it sat the round out and "
                       "restarts from the global parameters.", self.comm.replica_index if replica is None else replica,
                       step)

    def _count_bad_rounds(self, result: RoundResult | None, step: int, healthy: int | None = None) -> None:
        """`max_bad_rounds` consecutive rounds with no healthy participant stop the run with one sentence."""
        healthy = result.participants if result is not None else healthy
        self.bad_rounds = 0 if healthy else self.bad_rounds + 1
        if self.bad_rounds >= self.args.max_bad_rounds:
            raise RunError(
                f"no replica had a finite pseudo-gradient for {self.bad_rounds} consecutive rounds (last at step "
                f"{step}); the run is diverging: lower learning_rate or outer_lr, or resume from an earlier "
                f"checkpoint."
            )

    def _round_record(self, state, result: RoundResult, fragments, launched_at, outer_lr, sync_seconds,
                      blocked) -> dict:
        # result.stats: [member, replica, value]. A replica's loss is over all its members' micro-batches, its
        # tokens are its members' sum, its compute time its slowest member's; members share one pseudo-gradient.
        stat = {name: result.stats[..., i] for i, name in enumerate(ROUND_STATS)}
        cost = result.cost
        steps = stat["steps"].sum(0)
        replica_losses = (stat["loss_sum"].sum(0) / steps.clamp(min=1)).tolist()
        replica_compute = stat["compute_seconds"].amax(0).tolist()
        compute = max(replica_compute)
        tokens = int(stat["tokens"].sum())
        self.cumulative_bytes += cost.bytes_sent
        processes = self.comm.num_replicas * self.comm.group_size
        ddp_payload = sum(p.numel() * p.element_size() for p in self.outer.params)
        round_steps = int(stat["steps"][0, 0])
        record = {
            "round": self.round_at(launched_at),
            "step": state.global_step,
            "time": time.time(),
            "loss": sum(replica_losses) / len(replica_losses),
            "replica_losses": replica_losses,
            "pseudo_grad_norm": math.sqrt(result.average_norm_sq),
            "replica_pseudo_grad_norms": stat["pseudo_grad_norm_sq"][0].clamp(min=0).sqrt().tolist(),
            "bytes_per_replica": cost.bytes_sent,
            "cumulative_bytes_per_replica": self.cumulative_bytes,
            "intra_replica_bytes": cost.intra_replica_bytes,
            "ddp_bytes_per_replica": round_steps * ring_all_reduce_bytes(ddp_payload, processes),
            "compression": self.args.compression + ("+ef" if self.feedback is not None else ""),
            "compression_ratio": result.fp32_bytes_sent / cost.bytes_sent if cost.bytes_sent else None,
            "fragments": fragments,
            "sync_seconds": sync_seconds,
            "blocked_seconds": blocked,
            "compute_seconds": compute,
            "replica_compute_seconds": replica_compute,
            "tokens": tokens,
            "tokens_per_second": tokens / (compute + blocked) if compute + blocked > 0 else 0.0,
            "outer_lr": outer_lr,
            "inner_lr": self.trainer._get_learning_rate(),
            "inner_steps": round_steps,
            "num_replicas": self.comm.num_replicas,
            "replica_group_size": self.comm.group_size,
            "synced_parameters": sum(self.outer.bucket_numel(self.outer.buckets[b])
                                     for f in fragments for b in self.outer.fragment_buckets[f]),
            "collectives": cost.collectives,
        }
        if launched_at != state.global_step:
            record["launch_step"] = launched_at
        record.update(self.resume_note)
        self.resume_note = {}
        if self.startup_bytes is not None:  # the first round: what starting from identical parameters cost
            record["startup_bytes"] = self.startup_bytes
            self.startup_bytes = None
        if result.participants < self.comm.num_replicas:
            record["non_finite_replicas"] = [r for r, ok in enumerate(result.healthy) if not ok]
            record["participants"] = result.participants
            if not result.participants:
                record["outer_step_skipped"] = True
        previous = stat["previous_agreement"][0].tolist()
        if all(math.isfinite(x) for x in previous):
            record["agreement_round"] = record["round"] - 1
            record["replica_agreement"] = previous  # cos(Δ_i, Δ) of round `agreement_round`, one per replica
        return record

    # --- per-replica state in checkpoints ---

    def replica_state(self) -> dict:
        """What only this replica knows: its error-feedback residuals and, when replicas may differ after a
        round (several fragments, or α > 0), its own trainable parameters."""
        state: dict = {}
        if self.auto_choice is not None:  # the schedule inner_steps auto chose goes on after a resume
            state["schedule"] = {"origin_step": self.origin_step, "origin_round": self.origin_round,
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
        self.origin_step, self.origin_round = schedule["origin_step"], schedule["origin_round"]
        self.args.inner_steps = schedule["inner_steps"]
        self.sync_every = self.args.inner_steps // self.args.num_fragments
        self.auto_choice = schedule["choice"]

    @torch.no_grad()
    def _load_replica_state(self) -> None:
        state, self.saved_replica_state = self.saved_replica_state or {}, None
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
        eval_loss = (metrics or {}).get("eval_loss")
        if self.pending_records and self.pending_records[-1]["step"] == state.global_step:
            self.pending_records[-1]["eval_loss"] = eval_loss
            self._flush_pending()
        elif state.global_step == 0:  # eval_on_start: the model before any training
            self.initial_eval_loss = eval_loss

    def _flush_pending(self) -> None:
        records, self.pending_records = self.pending_records, []
        for record in records:
            self.history.append(record)
            if self.writer is None:
                continue
            self.writer.write(record)
            line = format_round(record, self.total_rounds)
            if self.args.disable_tqdm:
                print(line, flush=True)
            else:
                from tqdm.auto import tqdm

                tqdm.write(line)

    def on_train_end(self, args, state, control, **kwargs):
        if self.background is not None:
            self.background.shutdown(wait=True)
            self.background = None
        self._flush_pending()
        # The last round's agreement has no next sync to ride with; each replica hands it over through the store.
        last_agreement = self.comm.replica_values("last_agreement", self.previous_agreement, args.sync_timeout)
        if self.writer is None:
            return
        self.writer.close()
        summary = self.summary(state)
        if last_agreement is not None and self.history and all(math.isfinite(x) for x in last_agreement):
            summary["last_round_agreement"] = {"round": self.history[-1]["round"], "replica_agreement": last_agreement}
        write_summary(args.output_dir, summary)

    def summary(self, state) -> dict:
        rounds = self.history
        wall = sum(r["compute_seconds"] + r["blocked_seconds"] for r in rounds)
        tokens = sum(r["tokens"] for r in rounds)
        evals = [r["eval_loss"] for r in rounds if r.get("eval_loss") is not None]
        return {
            "rounds": len(rounds),
            "steps": state.global_step,
            "num_replicas": self.comm.num_replicas if self.comm else 1,
            "replica_group_size": self.args.replica_group_size,
            "inner_steps": self.args.inner_steps,
            "synced_parameters": self.outer.numel if self.outer else 0,
            "eval_loss_initial": self.initial_eval_loss,
            "eval_loss_final": evals[-1] if evals else None,
            "train_loss_final": rounds[-1]["loss"] if rounds else None,
            "tokens": tokens,
            "tokens_per_second": tokens / wall if wall > 0 else 0.0,
            "train_seconds": time.time() - self.train_started,
            "sync_seconds": sum(r["sync_seconds"] for r in rounds),
            "blocked_seconds": sum(r["blocked_seconds"] for r in rounds),
            "compression": self.args.compression + ("+ef" if self.args.error_feedback else ""),
            "num_fragments": self.args.num_fragments,
            "sync_delay": self.args.sync_delay,
            "bytes_per_replica": sum(r["bytes_per_replica"] for r in rounds),
            "startup_bytes": sum(r.get("startup_bytes", 0) for r in rounds),
            "ddp_bytes_per_replica": sum(r["ddp_bytes_per_replica"] for r in rounds),
        }


class ElasticOuterCallback(OuterLoopCallback):
    """The outer loop on torchft (`outer_backend: torchft`): rounds over whichever replicas are live; see
    hf_diloco.elastic. The inner loop, checkpoints and reporting are the base class's."""

    def __init__(self, trainer: DiLoCoTrainer):
        super().__init__(trainer)
        self.rounds: ElasticRounds | None = None
        self.carried_tokens = 0  # tokens of local progress that a rolled-back round did not merge yet
        self.round_started = time.perf_counter()

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        super().on_train_begin(args, state, control, model=model, **kwargs)
        self.rounds = ElasticRounds(self, args)
        self.total_rounds = math.ceil(state.max_steps / args.inner_steps) if state.max_steps > 0 else None
        # Before the first inner step: join the quorum; a late (or restarted) replica heals from a live peer here.
        joined = self._guarded(lambda: self.rounds.round(joining=True))
        healed = any(m.get("healed") for m in joined["members"] if m["replica"] == args.replica_id)
        print(f"[diloco] replica {args.replica_id} joined at round {self.rounds.global_round} (step "
              f"{state.global_step}){', healed from a live peer' if healed else ''}; {joined['participants']} "
              f"replica(s) in the quorum", flush=True)
        self.round_started = time.perf_counter()

    def due_fragments(self, step: int, max_steps: int) -> list[int]:
        if step >= max_steps:
            return [0]
        if self.args.round_seconds > 0:
            return [0] if time.perf_counter() - self.round_started >= self.args.round_seconds else []
        return [0] if self.round_steps >= self.args.inner_steps else []

    def on_step_end(self, args, state, control, **kwargs):
        control = super().on_step_end(args, state, control, **kwargs)
        if self.total_rounds is not None and self.rounds.global_round >= self.total_rounds:
            if state.global_step < state.max_steps and args.eval_strategy != "no":
                control.should_evaluate = True  # the run ended by its round count: evaluate the final model
            control.should_training_stop = True
        return control

    def _guarded(self, run):
        try:
            return run()
        except (RuntimeError, TimeoutError) as error:
            raise RunError(f"the torchft round failed ({first_line(error)}): no round formed within sync_timeout="
                           f"{self.args.sync_timeout:g} s; fewer than min_replicas={self.args.min_replicas} replicas "
                           f"are live, the others have finished the run, or the Lighthouse "
                           f"({self.args.lighthouse or 'TORCHFT_LIGHTHOUSE'}) cannot be reached.") from None

    def _sync(self, state) -> bool:
        fields = self._guarded(self.rounds.round)
        members = [m for m in fields["members"] if m["participated"]]
        losses = [m["loss_sum"] / m["steps"] for m in members if m["steps"]]
        compute = self.round_compute
        blocked = fields["quorum_seconds"] + fields["sync_seconds"]
        self.cumulative_bytes += fields["bytes"]
        record = {
            "round": fields["global_round"],
            "step": state.global_step,
            "time": time.time(),
            "loss": sum(losses) / len(losses) if losses else float("nan"),
            "replica_losses": losses,
            "pseudo_grad_norm": fields["pseudo_grad_norm"],
            "bytes_per_replica": fields["bytes"],
            "cumulative_bytes_per_replica": self.cumulative_bytes,
            "ddp_bytes_per_replica": self.round_steps * ring_all_reduce_bytes(
                sum(p.numel() * p.element_size() for p in self.outer.params), max(1, fields["participants"])),
            "compression": "none",
            "sync_seconds": fields["sync_seconds"],
            "quorum_seconds": fields["quorum_seconds"],
            "blocked_seconds": blocked,
            "compute_seconds": compute,
            "tokens": sum(m["tokens"] for m in members),
            "tokens_per_second": self.round_tokens / (compute + blocked) if compute + blocked > 0 else 0.0,
            "outer_lr": self.outer.lr(),
            "inner_lr": self.trainer._get_learning_rate(),
            "inner_steps": self.round_steps,
            "num_replicas": fields["participants"],
            "participants": fields["participants"],
            "members": fields["members"],
            "committed": fields["committed"],
            "outer_backend": "torchft",
            "replica": self.args.replica_id,
            "collectives": fields["collectives"],
        }
        non_finite = [m["replica"] for m in members if m.get("non_finite")]
        if non_finite:
            record["non_finite_replicas"] = non_finite
        if not fields["finite"]:
            self._reset_replica(state.global_step, self.args.replica_id)
        self._count_bad_rounds(None, state.global_step, healthy=len(members) - len(non_finite))
        if not fields["committed"]:
            record["outer_step_skipped"] = True
            logger.warning("DiLoCo/torchft: the round at step %d did not commit (%s); this replica keeps its local "
                           "progress for the next round.", state.global_step, fields["error"] or "a peer failed")
        self.pending_records.append(record)
        self._reset_round()
        self.round_started = time.perf_counter()
        return self.stop_requested or fields["stop_requested"]  # any participant's request stops them all

    def on_train_end(self, args, state, control, **kwargs):
        self._flush_pending()
        if self.rounds is not None:
            self.rounds.shutdown()
        if self.writer is None:
            return
        self.writer.close()
        write_summary(args.output_dir, self.summary(state))
