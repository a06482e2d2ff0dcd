"""The Trainer glue of the outer loop: at the end of each inner step the round engine syncs what is due, and its
answer (hf_diloco.engine.SyncOutcome) is applied here to Trainer: the step a replica continues at, saves,
evaluations and the stop kept on sync boundaries (a step where a sync landed and none is in flight: with one
fragment, a round's end), the end of the run. Everything else is hf_diloco.engine.SyncEngine's, which never sees
the Trainer: this module hands it the parameters, the inner optimizer, the communicator and the held-out loss."""

from __future__ import annotations

import logging

import torch
from transformers import TrainerCallback

from .checks import AUTO, rounds_note
from .compat import dispatch_log
from .config import ConfigError
from .engine import SyncEngine, SyncOutcome
from .metrics import reported_metrics
from .records import Records
from .schedule import Boundaries

logger = logging.getLogger(__name__)


class DiLoCoCallback(TrainerCallback):
    """Owned by a DiLoCoTrainer: runs its SyncEngine inside Trainer's loop. A resumed trainer hands it the
    checkpoint's outer state (`saved_outer_state`, `saved_replica_state`) before training begins."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.args = trainer.args
        self.records = Records(plain_console=self.args.disable_tqdm, num_fragments=self.args.num_fragments)
        self.engine = SyncEngine(self.args, self.records, announce=trainer.is_world_process_zero())
        self.saved_outer_state: dict | None = None
        self.saved_replica_state: dict | None = None
        self.resumed_from: str | None = None  # the checkpoint this run continues, for the next sync's record
        self.reached_before_resume = 0
        self.deferred = {"should_save": False, "should_evaluate": False}
        self.saved_at_round = 0  # whole rounds landed by this process at its last save_every_rounds save
        # Time-budget rounds: replicas take different numbers of steps between syncs, so Trainer's step-based saves
        # and evaluations are decided here, at each sync, from the step every replica continues at.
        self.timed = self.args.round_seconds > 0
        # On the fixed group the replicas agree on where saves and evaluations fall at each sync's start (that sync
        # then lands everywhere at the same step, even with sync_delay > 0); a torchft replica saves on its own.
        self.agreed_windows = self.timed and self.args.outer_backend == "torch"
        self.boundaries: Boundaries | None = None  # built when training begins (Trainer's resolved intervals)
        self.boundary_step = 0  # the agreed step of the last sync boundary (time-budget rounds)
        self.stopped_at: int | None = None  # the step at which a stop request (from any replica) ended training

    @property
    def outer(self):
        return self.engine.outer

    @property
    def history(self) -> list[dict]:
        return self.records.history

    def request_stop(self) -> None:
        """Stop at the next sync boundary (with one fragment, the end of the current round), with a checkpoint. Safe
        to call from a signal handler.

        The request rides along with the next sync, so every replica stops after the same step."""
        self.engine.request_stop()

    def resume(self, checkpoint: str, reached: int, replica_state: dict | None, outer_state: dict | None) -> None:
        """Training continues from `checkpoint` (the interrupted run had reached step `reached`): its outer state
        and this replica's state are taken when training begins."""
        self.resumed_from, self.reached_before_resume = checkpoint, reached
        self.saved_replica_state, self.saved_outer_state = replica_state, outer_state

    def observe_micro_batch(self, loss, inputs: dict) -> None:
        self.engine.progress.micro_batch(loss, inputs)

    def replica_state(self) -> dict:
        return self.engine.state_dict()

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        replica = self.trainer.accelerator.unwrap_model(model if model is not None else self.trainer.model)
        named = [(name, p) for name, p in replica.named_parameters() if p.requires_grad]
        outer_state, self.saved_outer_state = self.saved_outer_state, None
        replica_state, self.saved_replica_state = self.saved_replica_state or {}, None
        self.boundary_step = state.global_step
        self.boundaries = Boundaries(
            eval_steps=state.eval_steps if args.eval_strategy == "steps" else 0,
            save_steps=state.save_steps if args.save_strategy == "steps" else 0, eval_delay=args.eval_delay or 0,
            save_every_syncs=args.save_every_rounds * args.num_fragments, max_steps=state.max_steps)
        engine = self.engine
        engine.begin(named, state.global_step, state.max_steps, outer_state, replica_state, comm=self.trainer.comm,
                     inner_optimizer=self.trainer.optimizer,
                     held_out_loss=HeldOutLoss(self.trainer) if args.contribution_loss_check else None,
                     boundaries=self.boundaries if self.agreed_windows else None)
        if self.trainer.is_world_process_zero():
            note = rounds_note(AUTO if args.auto_inner_steps else args.inner_steps, state.max_steps,
                               round_seconds=args.round_seconds)
            if note:  # (the same words as the dry run's and the app's, from Python and the CLI alike)
                logger.warning("DiLoCo: %s", note)
            self.records.open(args.output_dir, state.global_step, continues_record=engine.backend.continues_record,
                              resumed_from=self.resumed_from if outer_state is not None else None,
                              reached_before_resume=self.reached_before_resume, report=self._report)
            logger.info(
                "DiLoCo: %d replica(s), H=%d, syncing %d trainable parameters per round, outer %s lr %g momentum %g%s, "
                "compression %s%s, %d fragment(s), sync delay %d, backend %s", engine.backend.num_replicas,
                args.inner_steps, engine.outer.numel, args.outer_optimizer, args.outer_lr, args.outer_momentum,
                " (Nesterov)" if args.outer_nesterov else "", args.compression,
                " + error feedback" if args.error_feedback else "", args.num_fragments, args.sync_delay,
                args.outer_backend)
        engine.progress.reset()
        self._continue_at(engine.join(state.global_step))
        self.records.flush()

    def on_step_begin(self, args, state, control, **kwargs):
        self.records.flush()
        self.engine.progress.step_began()

    def on_step_end(self, args, state, control, **kwargs):
        self.engine.progress.step_ended(_learning_rate(kwargs.get("optimizer")))
        self._step_end(state, control)

    def sync(self, step: int, max_steps: int) -> SyncOutcome:
        """The syncs of this step (see SyncEngine.sync), their step move applied to Trainer."""
        return self._continue_at(self.engine.sync(step, max_steps))

    def _continue_at(self, outcome: SyncOutcome) -> SyncOutcome:
        """A sync moved this replica (a time budget's furthest step, a healing peer's): Trainer continues there."""
        if outcome.continue_at is not None and outcome.continue_at != self.trainer.state.global_step:
            self.trainer.continue_at_step(outcome.continue_at)
        return outcome

    def _step_end(self, state, control) -> None:
        max_steps = state.max_steps
        outcome = self.sync(state.global_step, max_steps)
        stop, at_boundary = outcome.stop, outcome.at_boundary
        step = state.global_step  # a time-budget sync moves every replica to the furthest one's step
        if self.timed:
            self._decide_at_syncs(state, control, outcome)
        if at_boundary and not self.agreed_windows:
            # Whole rounds landed since this process started: F syncs make a round.
            landed = outcome.syncs_landed // self.args.num_fragments
            every = self.args.save_every_rounds
            if every and (landed - self.saved_at_round >= every or step >= max_steps):
                self.saved_at_round = landed
                control.should_save = True
        if stop and step < max_steps:
            self.stopped_at = step
            if self.trainer.is_world_process_zero():
                logger.warning("DiLoCo: stop requested; saving a checkpoint at step %d and stopping.", step)
            control.should_save = control.should_training_stop = True
        if outcome.run_over:
            # The run ended by its sync count (or this replica healed from one that finished it): the engine made
            # the final model θ_global, whatever this replica trained since its last sync. Also when Trainer stops
            # here anyway: a replica whose joining sync healed it into a finished run still takes the one step
            # Trainer always takes, and ends one step past max_steps.
            if not control.should_training_stop:
                if step < max_steps and self.args.eval_strategy != "no":
                    control.should_evaluate = True
                control.should_training_stop = True
        if not self.timed:
            self._align_to_syncs(control, at_boundary)

    def _decide_at_syncs(self, state, control, outcome: SyncOutcome) -> None:
        """Time-budget rounds: Trainer decided saves and evaluations from this replica's own step count; they are
        decided again at each sync, from the step every replica continues at (a multiple of save_steps or
        eval_steps passed since the last sync, every save_every_rounds rounds, or the end: `Boundaries`). On the
        fixed group the window is the one all replicas agreed on when the sync started
        (hf_diloco.backends.FixedGroup)."""
        control.should_save = control.should_evaluate = False
        if not outcome.at_boundary:
            return
        if self.agreed_windows:
            if outcome.window is not None:
                control.should_evaluate, control.should_save = self.boundaries.at(*outcome.window)
            return
        before, now = self.boundary_step, state.global_step
        self.boundary_step = now
        control.should_evaluate, control.should_save = self.boundaries.steps_due(before, now)

    def _align_to_syncs(self, control, at_boundary: bool) -> None:
        """Postpone saves and evaluations that fall between sync boundaries to the next one."""
        for flag in self.deferred:
            if at_boundary:
                if self.deferred[flag]:
                    setattr(control, flag, True)
                    self.deferred[flag] = False
            elif getattr(control, flag):
                setattr(control, flag, False)
                if not self.deferred[flag] and self.trainer.is_world_process_zero() and not self.history:
                    logger.warning(
                        "DiLoCo: a %s falls between syncs; it is postponed to the next sync (set save_steps/"
                        "eval_steps to multiples of inner_steps=%d to avoid this).",
                        "save" if flag == "should_save" else "evaluation", self.args.inner_steps,
                    )
                self.deferred[flag] = True

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        metrics = metrics or {}
        self.records.evaluated(state.global_step, metrics.get("eval_loss"), metrics.get("eval_accuracy"))

    def _report(self, record: dict) -> None:
        """A written sync record to every tracker Trainer reports to (`report_to`: TensorBoard, trackio, W&B,
        MLflow, ...), as diloco/<name> at the sync's step. (Integrations that prefix Trainer's training metrics with
        train/, as TensorBoard's and W&B's do, show train/diloco/<name>.)"""
        dispatch_log(self.trainer, reported_metrics(record), record["step"], skip=(DiLoCoCallback,))

    def on_train_end(self, args, state, control, **kwargs):
        engine = self.engine
        self.records.flush()
        last_agreement = engine.end(state.global_step)
        settings = {"num_replicas": engine.backend.num_replicas, "replica_group_size": args.replica_group_size,
                    "inner_steps": engine.schedule.inner_steps, "synced_parameters": engine.outer.numel,
                    "compression": args.compression + ("+ef" if args.error_feedback else ""),
                    "num_fragments": args.num_fragments, "sync_delay": args.sync_delay,
                    "auto_sync_delay": args.auto_sync_delay}
        self.records.close(args.output_dir, state.global_step, settings, last_agreement)


class HeldOutLoss:
    """contribution_loss_check's measure: the model's loss now on the evaluation set's first contribution_loss_batch
    examples, the same batch on every replica (every member of a sharded replica runs the forward pass)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.batch: dict | None = None

    @torch.no_grad()
    def __call__(self) -> float:
        trainer = self.trainer
        if self.batch is None:
            if trainer.eval_dataset is None or len(trainer.eval_dataset) == 0:
                raise ConfigError("contribution_loss_check scores each round on held-out examples, and this run has "
                                  "no evaluation set: set eval_fraction above 0 or pass one.")
            count = min(trainer.args.contribution_loss_batch, len(trainer.eval_dataset))
            self.batch = trainer._prepare_inputs(trainer.data_collator([trainer.eval_dataset[i]
                                                                        for i in range(count)]))
        model = trainer.model
        training = model.training
        model.eval()
        try:
            return float(model(**self.batch).loss)
        finally:
            model.train(training)


def _learning_rate(optimizer) -> float:
    """The inner optimizer's learning rate now (its first parameter group's), 0 when there is none."""
    groups = getattr(optimizer, "param_groups", None)
    return float(groups[0].get("lr", 0.0)) if groups else 0.0
