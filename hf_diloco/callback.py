"""The Trainer glue of the outer loop: at the end of each inner step the round engine syncs what is due; saves,
evaluations and the stop are kept on sync boundaries (a step where a sync landed and none is in flight: with one
fragment, a round's end). Everything else is hf_diloco.engine.SyncEngine's."""

from __future__ import annotations

import logging

from transformers import TrainerCallback

from .compat import dispatch_log
from .engine import SyncEngine
from .metrics import reported_metrics
from .records import Records

logger = logging.getLogger(__name__)


class DiLoCoCallback(TrainerCallback):
    """Owned by a DiLoCoTrainer: runs its SyncEngine inside Trainer's loop. A resumed trainer hands it the
    checkpoint's outer state (`saved_outer_state`, `saved_replica_state`) before training begins."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.args = trainer.args
        self.records = Records(plain_console=self.args.disable_tqdm, num_fragments=self.args.num_fragments)
        self.engine = SyncEngine(self.args, trainer, self.records, continue_at_step=trainer.continue_at_step)
        self.saved_outer_state: dict | None = None
        self.saved_replica_state: dict | None = None
        self.resumed_from: str | None = None  # the checkpoint this run continues, for the next sync's record
        self.reached_before_resume = 0
        self.deferred = {"should_save": False, "should_evaluate": False}
        self.saved_at_round = 0  # whole rounds landed by this process at its last save_every_rounds save
        # Time-budget rounds: replicas take different numbers of steps between syncs, so Trainer's step-based saves
        # and evaluations are decided here, at each sync, from the step every replica continues at.
        self.timed = self.args.round_seconds > 0
        if self.timed and self.args.outer_backend == "torch":
            # The replicas agree on where saves and evaluations fall at each sync's start (that sync then lands
            # everywhere at the same step, even with sync_delay > 0); a torchft replica saves on its own.
            self.engine.boundary_wanted = self._boundary_wanted
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
        return self.engine.replica_state()

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        replica = self.trainer.accelerator.unwrap_model(model if model is not None else self.trainer.model)
        named = [(name, p) for name, p in replica.named_parameters() if p.requires_grad]
        outer_state, self.saved_outer_state = self.saved_outer_state, None
        replica_state, self.saved_replica_state = self.saved_replica_state or {}, None
        self.boundary_step = state.global_step
        engine = self.engine
        engine.begin(named, state.global_step, state.max_steps, outer_state, replica_state)
        if self.trainer.is_world_process_zero():
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
        engine.join(state.global_step)
        self.records.flush()

    def on_step_begin(self, args, state, control, **kwargs):
        self.records.flush()
        self.engine.progress.step_began()

    def on_step_end(self, args, state, control, **kwargs):
        self.engine.progress.step_ended(_learning_rate(kwargs.get("optimizer")))
        self._step_end(state, control)

    def sync(self, step: int, max_steps: int) -> bool | None:
        """The syncs of this step (see SyncEngine.sync): None when nothing synced, else whether to stop."""
        return self.engine.sync(step, max_steps)

    def _step_end(self, state, control) -> None:
        max_steps = state.max_steps
        stop = self.sync(state.global_step, max_steps)
        step = state.global_step  # a time-budget sync moves every replica to the furthest one's step
        at_boundary = stop is not None and self.engine.in_flight is None
        if self.timed:
            self._decide_at_syncs(state, control, at_boundary)
        if at_boundary and self.engine.boundary_wanted is None:
            # Whole rounds landed since this process started: F syncs make a round.
            landed = self.engine.tuner.syncs_landed // self.args.num_fragments
            every = self.args.save_every_rounds
            if every and (landed - self.saved_at_round >= every or step >= max_steps):
                self.saved_at_round = landed
                control.should_save = True
        if stop and step < max_steps:
            self.stopped_at = step
            if self.trainer.is_world_process_zero():
                logger.warning("DiLoCo: stop requested; saving a checkpoint at step %d and stopping.", step)
            control.should_save = control.should_training_stop = True
        if self.engine.run_over():
            # The run ended by its sync count (or this replica healed from one that finished it): the final model
            # is θ_global, whatever this replica trained since its last sync. Also when Trainer stops here anyway:
            # a replica whose joining sync healed it into a finished run still takes the one step Trainer always
            # takes, and ends one step past max_steps.
            self.engine.outer.copy_global_to_replica()
            if not control.should_training_stop:
                if step < max_steps and self.args.eval_strategy != "no":
                    control.should_evaluate = True
                control.should_training_stop = True
        if not self.timed:
            self._align_to_syncs(control, at_boundary)

    def _decide_at_syncs(self, state, control, at_boundary: bool) -> None:
        """Time-budget rounds: Trainer decided saves and evaluations from this replica's own step count; they are
        decided again at each sync, from the step every replica continues at (a multiple of save_steps or
        eval_steps passed since the last sync, every save_every_rounds rounds, or the end). On the fixed group
        the window is the one all replicas agreed on when the sync started (hf_diloco.backends.FixedGroup)."""
        control.should_save = control.should_evaluate = False
        if not at_boundary:
            return
        if self.engine.boundary_wanted is not None:
            window = self.engine.take_window()
            if window is not None:
                before, now, sync = window
                control.should_evaluate, control.should_save = self._due(before, now, state.max_steps)
                every = self.args.save_every_rounds * self.args.num_fragments
                control.should_save |= bool(every) and (sync % every == 0 or now >= state.max_steps)
            return
        before, now = self.boundary_step, state.global_step
        self.boundary_step = now
        control.should_evaluate, control.should_save = self._due(before, now, state.max_steps)

    def _due(self, before: int, now: int, max_steps: int) -> tuple[bool, bool]:
        """(evaluate, save): whether a multiple of eval_steps / save_steps lies in the steps (before, now], or now
        is the end."""
        args, state = self.args, self.trainer.state

        def passed(every) -> bool:
            return bool(every) and (now // every > before // every or now >= max_steps)

        return (args.eval_strategy == "steps" and now >= args.eval_delay and passed(state.eval_steps),
                args.save_strategy == "steps" and passed(state.save_steps))

    def _boundary_wanted(self, before: int, now: int, sync: int) -> bool:
        every = self.args.save_every_rounds * self.args.num_fragments
        return any(self._due(before, now, self.trainer.state.max_steps)) or bool(every and sync % every == 0)

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


def _learning_rate(optimizer) -> float:
    """The inner optimizer's learning rate now (its first parameter group's), 0 when there is none."""
    groups = getattr(optimizer, "param_groups", None)
    return float(groups[0].get("lr", 0.0)) if groups else 0.0
