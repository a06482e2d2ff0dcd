"""Trainer callbacks the CLI adds to every run, DiLoCo or baseline."""

from __future__ import annotations

import time

from transformers import TrainerCallback


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
