"""What a sync does about values that are not finite: a replica whose pseudo-gradient holds a NaN or an infinity sits
the sync out (weight 0: hf_diloco.fragments) and restarts from θ_global (the engine copies it) with its inner optimizer
state started afresh where that state is not finite either; a run in which no replica brings a finite
pseudo-gradient for `max_bad_rounds` rounds in a row, or whose syncs are refused that long (what arrived broke a bound:
hf_diloco.fragments.SyncResult.refuse), stops with one sentence instead of training on garbage."""

from __future__ import annotations

import logging

import torch

from .errors import RunError
from .fragments import SyncResult
from .outer import is_finite

logger = logging.getLogger(__name__)


class Health:
    """Counts the consecutive syncs with no healthy participant, and restarts a replica that was not finite."""

    def __init__(self, max_bad_rounds: int, num_fragments: int):
        self.max_bad_rounds, self.num_fragments = max_bad_rounds, num_fragments
        self.bad_syncs = 0  # consecutive syncs in which no replica had a finite pseudo-gradient

    def decided(self, result: SyncResult, step: int) -> None:
        """After a sync that applied its outer step or was refused (one a vote rolled back counts neither way):
        `max_bad_rounds` consecutive rounds (F syncs each) with no healthy participant, or refused, stop the run
        with one sentence."""
        if not (result.committed or result.refused):
            return
        if result.refused:
            logger.warning("DiLoCo: the sync at step %d was refused (%s); θ_global keeps its value and every replica "
                           "its own progress for the next sync.", step, "; ".join(result.refused))
        self.bad_syncs = 0 if result.participants and not result.refused else self.bad_syncs + 1
        fragments = self.num_fragments
        if self.bad_syncs >= self.max_bad_rounds * fragments:
            counted = f"{self.bad_syncs} consecutive rounds" if fragments == 1 else \
                f"{self.bad_syncs} consecutive syncs ({self.bad_syncs // fragments} rounds)"
            if result.refused:
                raise RunError(f"{counted} brought nothing that could be applied (last at step {step}: "
                               f"{result.refused[0]}); a replica sends values it should not: stop it, or resume "
                               f"without it from the last checkpoint.")
            raise RunError(
                f"no replica had a finite pseudo-gradient for {counted} (last at step {step}); the run is diverging: "
                f"lower learning_rate or outer_lr, or resume from an earlier checkpoint."
            )

    @staticmethod
    @torch.no_grad()
    def restart(optimizer: torch.optim.Optimizer, replica: int, step: int) -> None:
        """This replica's pseudo-gradient was not finite (it takes θ_global after the sync): if its inner optimizer
        state holds non-finite values too, that state starts afresh (stale NaN moments would poison the next step
        again)."""
        moments = [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
        if not is_finite(moments):
            optimizer.state.clear()
        logger.warning("DiLoCo: replica %d had a non-finite pseudo-gradient at step %d; it sat the sync out and "
                       "restarts from the global parameters.", replica, step)
