"""What a DiLoCoTrainer pushes to the Hub: the same repository `hf-diloco push` makes (hf_diloco.hub.commit_run), from
Python at the end (`push_to_hub`), at each save during training (`args.push_to_hub`), and the card.

Not Trainer's upload of the whole output folder: `training_args.bin` (a pickle holding the run's paths),
checkpoints (their optimizer and outer state are the run's own), progress files and peft's own README stay local.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from transformers.trainer_utils import HubStrategy, SaveStrategy
from transformers.utils import PushInProgress

from .errors import first_line
from .hub import CARD_FILE, CURVE_FILE, commit_run, model_card, repo_files, trainer_settings, write_training_curve

logger = logging.getLogger(__name__)


def push_trained(trainer, commit_message: str | None, *, blocking: bool, token: str | None, revision: str | None,
                 private: bool | None, allow_unfinished: bool, unused: dict):
    """Save the model and push the model, config and tokenizer files, the sync log, run_config.json and the DiLoCo
    card from the trainer's args (a local model or dataset named by its base name only).

    The repo is `args.hub_model_id` (default: the output folder's name), `token` defaults to `args.hub_token`
    (then HF_TOKEN, then the huggingface_hub login), `private` to `args.hub_private_repo`, `revision` to
    `args.hub_revision`. Trainer's model-card arguments (`tags`, `license`, ...: `unused`) are not used: the card is
    hf_diloco.hub's. Unlike `hf-diloco push`, a run that did not finish (pushed mid-training, or after a stop) is
    pushed by default, since this call is explicit; its card says how the run ended. `allow_unfinished=False`
    refuses it instead (hf_diloco.hub.UnfinishedRun). Every process saves (as Trainer's does); the main process
    pushes and returns huggingface_hub's CommitInfo, or a Future of it when not `blocking`; the others None."""
    args = trainer.args
    trainer.callback_handler.on_push_begin(args, trainer.state, trainer.control)
    trainer._finish_current_push()  # a push during training reads the output folder's weights until it is done
    trainer.save_model(_internal_call=True)
    if not trainer.is_world_process_zero():
        return None
    if unused:
        logger.warning(f"push_to_hub: the DiLoCo card does not use {', '.join(sorted(unused))}.")
    repo_id = trainer.hub_model_id or args.hub_model_id or Path(args.output_dir).absolute().name
    return commit_run(
        args.output_dir, repo_id, token=token if token is not None else args.hub_token,
        private=private if private is not None else args.hub_private_repo,
        commit_message=commit_message or "End of training", allow_unfinished=allow_unfinished,
        settings=trainer_settings(trainer), revision=revision if revision is not None else args.hub_revision,
        blocking=blocking, progress=logger.info)


def push_checkpoint(trainer, checkpoint_folder: str) -> None:
    """The push at a save during training: what `push_trained` pushes, with the checkpoint's model, committed in the
    background as "Training in progress, step N" (or "epoch N"). Its card says that the run was still training at
    that step.

    As Trainer's: the main process alone, from inside `_save_checkpoint`, with no collective (the checkpoint's model
    and tokenizer files are copied into the output folder, not saved again); while a push is still in progress the
    next one is skipped unless `hub_always_push`; `push_in_progress` is what `train()` waits for at its end. Unlike
    Trainer's, whatever `hub_strategy` (checkpoint, all_checkpoints too), no checkpoint folder is uploaded. A push
    that fails is a warning, as Trainer's background upload is: training goes on."""
    args = trainer.args
    if not trainer.is_world_process_zero() or args.hub_strategy == HubStrategy.END:
        return
    if not args.hub_always_push and trainer.push_in_progress is not None and not trainer.push_in_progress.is_done():
        return
    trainer.callback_handler.on_push_begin(args, trainer.state, trainer.control)
    step = trainer.state.global_step
    at = f"step {step}" if args.save_strategy == SaveStrategy.STEPS else f"epoch {int(trainer.state.epoch)}"
    # The sync of this step waits in the records for its evaluation, which Trainer ran before this save: written
    # now, it is in the pushed sync log, curve and card.
    trainer.diloco.records.flush()
    try:
        for name, path in repo_files(Path(checkpoint_folder)).items():
            shutil.copy(path, Path(args.output_dir) / name)
        job = commit_run(
            args.output_dir, trainer.hub_model_id, token=args.hub_token, private=args.hub_private_repo,
            commit_message=f"Training in progress, {at}", allow_unfinished=True, settings=trainer_settings(trainer),
            revision=args.hub_revision, blocking=False, progress=logger.info,
            outcome={"ended": "training", "step": step, "max_steps": trainer.state.max_steps, "checkpoint": None})
    except Exception as error:  # whatever stops a push must not stop the training
        logger.warning(f"the push of {at} to the Hub failed ({first_line(error)}); training goes on.")
        return

    def say_if_failed(done) -> None:
        if not done.cancelled() and done.exception() is not None:
            logger.warning(f"the push of {at} to the Hub failed ({first_line(done.exception())}).")

    job.add_done_callback(say_if_failed)
    if trainer.push_in_progress is None or trainer.push_in_progress.is_done():
        trainer.push_in_progress = PushInProgress([job])
    else:
        trainer.push_in_progress.jobs.append(job)


def write_card(trainer) -> None:
    """The DiLoCo card and its training curve in the output folder (main process only)."""
    if not trainer.is_world_process_zero():
        return
    output_dir = Path(trainer.args.output_dir)
    write_training_curve(output_dir, output_dir / CURVE_FILE)
    (output_dir / CARD_FILE).write_text(model_card(output_dir, trainer.hub_model_id,
                                                   settings=trainer_settings(trainer)))
