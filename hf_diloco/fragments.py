"""A streaming fragment and what it owns (Streaming DiLoCo: F fragments sync in turn; with F = 1 the one fragment
is the whole model).

Each fragment of a replica owns, for its share of the trainable parameters:

    buckets      the buckets of θ_global it is cut into (hf_diloco.outer.OuterState); `size`: the values they hold
    base         θ_global of its parameters: OuterState's tensors of its buckets, which only a sync that carries
                 this fragment and lands (commits) moves
    residual     the error-feedback residual of each of its buckets (hf_diloco.codecs.ErrorFeedback), or none
    in_flight    the step the sync carrying it was launched at, until that sync lands (at most one at a time)
    last_synced  the step of the last sync that carried it and landed
    covered      what its Δ_i covers: the inner steps, their Σ η and the examples they trained on since its base
                 moved, before the sync in flight;
    at_launch    the same with the sync launched last

The engine (hf_diloco.engine) tells every fragment when it launches a sync (`launched`) and when that sync is
decided (`decided`, or `call_off`); the schedule (hf_diloco.schedule) says which fragments a sync carries.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .codecs import ErrorFeedback
from .outer import OuterState, assign_fragments


@dataclass
class Fragment:
    index: int
    buckets: list[int]
    size: int
    outer: OuterState = field(repr=False)
    feedback: ErrorFeedback | None = field(default=None, repr=False)
    in_flight: int | None = None
    last_synced: int | None = None
    covered: tuple[float, float, float] = (0, 0.0, 0)
    at_launch: tuple[float, float, float] = (0, 0.0, 0)

    @property
    def base(self) -> list[torch.Tensor]:
        """θ_global of this fragment's parameters (OuterState's own tensors, not copies)."""
        return [self.outer.global_params[i] for b in self.buckets for i in self.outer.buckets[b]]

    @property
    def residual(self) -> dict[str, torch.Tensor]:
        """Its buckets' error-feedback residuals, by bucket key ({} without error feedback, or before its first
        sync through a codec)."""
        held = self.feedback.residuals if self.feedback is not None else {}
        return {str(b): held[str(b)] for b in self.buckets if str(b) in held}

    def launched(self, step: int, progress, carried: bool) -> None:
        """A sync was launched at `step`, after `progress` since the previous launch (engine.Progress: its inner
        steps, their Σ η and examples); `carried`: it is expected to carry this fragment."""
        self.at_launch = (self.covered[0] + progress.steps, self.covered[1] + progress.lr_sum,
                          self.covered[2] + progress.examples)
        self.in_flight = step if carried else None

    def call_off(self) -> None:
        """The sync launched last was called off before it exchanged anything (hf_diloco.backends.FixedGroup): what
        its Δ_i covered goes into the next launch's, as if it had never been launched."""
        self.in_flight = None

    def decided(self, step: int, synced: bool, alpha: float, fresh: bool = False) -> None:
        """The sync launched last was decided at `step`: if it carried this fragment and committed, the base moved
        and α of the replica's own progress stays in its parameters; else its Δ_i covers those steps too. `fresh`:
        the replica took θ_global (it joined, healed, or was left out), so its Δ_i covers nothing yet."""
        self.in_flight = None
        if synced:
            self.last_synced = step
        if fresh:
            self.covered = (0, 0.0, 0)
        elif synced:
            self.covered = tuple(x * alpha for x in self.at_launch)
        else:
            self.covered = self.at_launch


def since_base(fragments: list[Fragment], carried: list[int]) -> tuple[float, float, float]:
    """The inner steps Δ_i of the `carried` fragments covers, the sum of their learning rates and the examples they
    trained on (the fragment whose base is oldest): since each last synced, whatever syncs of other fragments came
    between."""
    return max((fragments[f].at_launch for f in carried), default=(0, 0.0, 0))


def outer_state_and_fragments(named: list[tuple[str, torch.nn.Parameter]], num_fragments: int, pattern: str,
                              feedback: ErrorFeedback | None, **outer_settings) -> tuple[OuterState, list[Fragment]]:
    """θ_global and the outer optimizer (`outer_settings`: OuterState's) over the replica's trainable parameters,
    cut into buckets, and the streaming fragments over those buckets. ValueError, naming the parameters, when a
    fragment would sync nothing."""
    assigned = assign_fragments([name for name, _ in named], num_fragments, pattern)
    outer = OuterState([p for _, p in named], fragments=assigned, **outer_settings)
    fragments = [Fragment(f, buckets, sum(outer.full_numels[i] for b in buckets for i in outer.buckets[b]), outer,
                          feedback) for f, buckets in enumerate(outer.fragment_buckets)]
    return outer, fragments
