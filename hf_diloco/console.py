"""A calm console for the runs `hf-diloco train` starts (and so `launch`, `slurm`, `demo` and the app's runs).

Unless the run's `verbose` is set:

- one progress bar for the run, drawn by the main process of replica 0 (on torchft, of the launch of replica 0),
  without evaluation bars;
- one line per sync, `[diloco] ...`, from that same process, with the held-out loss when the sync evaluated;
- Trainer's dicts of logs (loss, learning rate, evaluation metrics, the final runtime) go to trainer_log.jsonl and
  the trackers of `report_to`, not the console;
- every other process prints errors only: its warnings are the main process's again;
- once the model is loaded, transformers' and the Hub's own progress bars (a checkpoint's "Writing model shards",
  at every save) are off.

With `verbose: true` every process shows what Trainer shows: its bars, its dicts of logs, its warnings. A
`DiLoCoTrainer` built in one's own script keeps Trainer's console as it is.
"""

from __future__ import annotations

import warnings

from transformers import PrinterCallback, ProgressCallback
from transformers.utils import logging as transformers_logging


class CalmProgress(ProgressCallback):
    """Trainer's training bar, drawn only where `shown`; no evaluation bar, no dicts of logs."""

    def __init__(self, shown: bool):
        super().__init__()
        self.shown = shown

    def on_train_begin(self, args, state, control, **kwargs):
        if self.shown:
            super().on_train_begin(args, state, control, **kwargs)
        self.current_step = 0

    def on_step_end(self, args, state, control, **kwargs):
        if self.training_bar is not None:
            super().on_step_end(args, state, control, **kwargs)

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        pass

    def on_evaluate(self, args, state, control, **kwargs):
        pass

    def on_predict(self, args, state, control, **kwargs):
        pass

    def on_log(self, args, state, control, logs=None, **kwargs):
        pass

    def on_train_end(self, args, state, control, **kwargs):
        if self.training_bar is not None:
            self.training_bar.close()
            self.training_bar = None


def quiet_other_processes(config) -> None:
    """Before the Trainer is built: a process other than the run's main one logs errors only (Trainer applies
    `log_level_replica` to transformers' logging) and ignores Python warnings."""
    if config.process_index != 0:
        config.log_level_replica = "error"
        warnings.filterwarnings("ignore")


def calm(trainer) -> None:
    """Trainer's console made calm (module docstring): its progress and printer callbacks are replaced by one
    `CalmProgress`, drawn on the run's main process, and a DiLoCo trainer's sync lines are printed there only."""
    args = trainer.args
    main = trainer.is_world_process_zero() and (getattr(args, "outer_backend", "torch") != "torchft"
                                                or getattr(args, "replica_id", 0) == 0)
    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    if not args.disable_tqdm:
        trainer.add_callback(CalmProgress(main))
    diloco = getattr(trainer, "diloco", None)
    if diloco is not None and not main:
        diloco.records.quiet()
    transformers_logging.disable_progress_bar()
