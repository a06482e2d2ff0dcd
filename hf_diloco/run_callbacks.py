"""Trainer callbacks of a run: what the app watches, and the graceful stop.

- `SteadyClock`: steady tokens/s for run_metrics.json.
- `RunRecorder` (main process only, no collective): `progress.json` with the current step and phase, rewritten at
  most twice a second while training, and `trainer_log.jsonl` with every dict Trainer logs. The app reads both, so
  a baseline `Trainer` run (no sync rounds) is watchable and progress moves between syncs.
- `StopOnRequest`: a stop file in the output folder (what the app's Stop writes) or `request()` (what SIGUSR1,
  SIGTERM and SIGINT call, through hf_diloco.trainer.graceful_stop_signals) stops the run after the current round
  (DiLoCo: the request rides the round's sync, so every replica stops after the same step) or after the current
  step (plain Trainer), with a checkpoint. Only a stop that happened leaves `stopped.json`, so a run's status never
  claims a stop that did not take place.

`hf_diloco.train.train` adds `SteadyClock` and `RunRecorder` to every run, DiLoCo or baseline, and a
`StopOnRequest` to the `trainer: ddp` baseline's plain Trainer; every `DiLoCoTrainer` adds its own `StopOnRequest`
(hf_diloco.trainer), so a trainer used from Python stops the same way.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from transformers import TrainerCallback

from .errors import DamagedFile
from .files import append_jsonl, read_json, write_json
from .runs import PROGRESS_FILE, STOP_FILE, STOPPED_FILE, TRAINER_LOG_FILE


class SteadyClock(TrainerCallback):
    """Wall time of the inner steps after the first tenth (start-up, first batches and warm caches excluded)."""

    def __init__(self):
        self.start: tuple[int, float] | None = None
        self.end: tuple[int, float] | None = None

    def on_step_end(self, args, state, control, **kwargs):
        now = (state.global_step, time.perf_counter())
        if self.start is None and state.global_step >= max(1, state.max_steps // 10):
            self.start = now
        self.end = now

    def metrics(self, tokens_per_step: int) -> dict:
        """This process's steady tokens/s (its own tokens only)."""
        if self.start is None or self.end is None or self.end[0] <= self.start[0]:
            return {}
        steps, seconds = self.end[0] - self.start[0], self.end[1] - self.start[1]
        return {"steady_steps": steps, "steady_seconds": seconds, "steady_tokens_per_second": steps * tokens_per_step
                / seconds}


class RunRecorder(TrainerCallback):
    """Writes the run's step and Trainer's logs where the app can read them; main process only, no collective.

    `extra` goes into progress.json as is (e.g. the bytes a DDP step sends, for comparing runs).
    """

    def __init__(self, output_dir: str, extra: dict | None = None, min_interval: float = 0.5):
        self.folder = Path(output_dir)
        self.extra = extra or {}
        self.min_interval = min_interval
        self.last_write = 0.0

    def phase(self, phase: str, state=None, force: bool = True) -> None:
        """Record `phase` ("loading model and data", "waiting for replicas", "training", "finished")."""
        now = time.time()
        if not force and now - self.last_write < self.min_interval:
            return
        self.last_write = now
        if state is not None:
            step, total = state.global_step, state.max_steps
        else:  # before training: the step reached so far stays (a restarted run measures what it lost from it)
            try:
                previous = read_json(self.folder / PROGRESS_FILE, {})
            except DamagedFile:  # rewritten below in any case
                previous = {}
            step, total = previous.get("step", 0), previous.get("max_steps")
        write_json(self.folder / PROGRESS_FILE, {"phase": phase, "step": step, "max_steps": total, "time": now,
                                                 **self.extra}, indent=None)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if not state.is_world_process_zero:
            return
        if model is not None:
            from .comm import ring_all_reduce_bytes

            gradients = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
            self.extra["ddp_bytes_per_step"] = ring_all_reduce_bytes(gradients, args.world_size)
        self.extra["world_size"] = args.world_size
        self.phase("waiting for replicas" if args.world_size > 1 else "training", state)

    def on_step_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.phase("training", state, force=state.global_step == 1)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            append_jsonl(self.folder / TRAINER_LOG_FILE, {"step": state.global_step, "time": time.time(), **logs})

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.phase("finished", state)


class StopOnRequest(TrainerCallback):
    """Stops training when `<output_dir>/stop.request` appears or `request()` is called (e.g. from a SIGUSR1, SIGTERM
    or SIGINT handler).

    DiLoCo (every `DiLoCoTrainer` adds its own and attaches it to its outer loop): the request is handed to the
    outer loop, which sends it with the round's sync; all replicas stop after the same step and save a checkpoint.
    Plain `Trainer`: the replicas' flags are combined with a one-float all-reduce per step (the DDP baseline
    all-reduces its gradients every step anyway), then the step's checkpoint is saved and training ends. A request
    made before training starts is honoured at the first step. When the stop has happened, the main process writes
    `stopped.json` (step, checkpoint and time); at the end of training it removes the request file in any case.
    """

    def __init__(self, output_dir: str):
        self.folder = Path(output_dir)
        self.requested = False
        self.stopped_at: int | None = None
        self.saved: str | None = None
        self.outer_loop_request = None
        self.outer_loop_stopped_at = None

    def attach(self, request_stop, stopped_at=None) -> None:
        """Hand requests to a DiLoCo outer loop (`trainer.diloco.request_stop`) instead of stopping per step;
        `stopped_at()` tells the step at which the outer loop stopped on a request (from any replica), or None."""
        self.outer_loop_request = request_stop
        self.outer_loop_stopped_at = stopped_at

    def request(self) -> None:
        """Ask for a stop; safe to call from a signal handler."""
        self.requested = True
        if self.outer_loop_request is not None:
            self.outer_loop_request()

    def _check(self) -> None:
        if not self.requested and (self.folder / STOP_FILE).exists():
            self.request()

    def on_train_begin(self, args, state, control, **kwargs):
        self._check()

    def on_step_end(self, args, state, control, **kwargs):
        self._check()
        if self.outer_loop_request is not None:
            return control  # the outer loop stops at the round boundary (see on_train_end)
        if self._anyone_requested(args) and state.global_step < state.max_steps:
            control.should_save = True
            control.should_training_stop = True
            self.stopped_at = state.global_step
        return control

    def _anyone_requested(self, args) -> bool:
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return self.requested
        flag = torch.tensor([float(self.requested)], device=args.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)

    def on_save(self, args, state, control, **kwargs):
        self.saved = f"checkpoint-{state.global_step}"

    def on_train_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        if self.outer_loop_request is not None:  # the outer loop stopped at a round boundary, on any replica's request
            self.stopped_at = self.outer_loop_stopped_at() if self.outer_loop_stopped_at else (
                state.global_step if self.requested and state.global_step < state.max_steps else None)
        if self.stopped_at is not None:
            checkpoint = self.saved if self.saved == f"checkpoint-{self.stopped_at}" else None
            write_json(self.folder / STOPPED_FILE, {"step": self.stopped_at, "checkpoint": checkpoint,
                                                    "time": time.time()}, indent=None)
        try:
            os.remove(self.folder / STOP_FILE)
        except FileNotFoundError:
            pass
