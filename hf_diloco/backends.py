"""Who takes part in a round: the backends.

A round (hf_diloco.outer: pseudo-gradient, codec with error feedback, fragments, overlap, outer step) is the same
code whatever the backend. A backend supplies only the membership around it and the collectives under it:

    torch     `FixedGroup`: the processes of one launch, a fixed set; every replica takes part in every round
              with weight 1, fragments follow the step schedule, and a round is a barrier (a replica that never
              arrives ends the run after sync_timeout).
    torchft   `hf_diloco.torchft_backend.TorchftRounds`: a Lighthouse quorum per round, participants only, token and
              staleness weights, a vote (commit or roll back) after the collectives, healing of a replica that is
              behind.

Both answer the same questions for the trainer's callback: is a round `due` at this step, which fragments it is
`expected` to sync (an overlapped round snapshots them before it starts), `start` it (who, with what weight, which
fragments: `local` holds this replica's numbers, read before the inner loop moved on) and `finish` it (what the
record says about membership, what a replica keeps after a rollback). `start` may run in the background thread
of an overlapped round; it then touches only the outer state, never the replica's parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .comm import ReplicaComm
from .schedule import Schedule


@dataclass
class RoundStart:
    """What a backend decided before a round's collectives."""

    weight: float = 1.0  # this replica's share in the average, relative to the largest (1: plain mean)
    fragments: list[int] = field(default_factory=list)  # the fragments this round syncs, the same on every replica
    empty: bool = False  # no participant brings any progress (every one joins): nothing to exchange, only the vote
    stash: list[torch.Tensor] | None = None  # Δ_i of every bucket, taken against the base a healed replica left
    healed: bool = False  # this replica took θ_global from a live peer in this round's quorum
    finite: bool = True  # this replica's own parameters were finite when the round started
    joining: bool = False  # the round before this replica's first inner step
    stop_requested: bool = False  # a participant asked to stop (known before the collectives)
    members: list[dict] = field(default_factory=list)  # one row per participant (torchft)
    quorum_seconds: float = 0.0  # time spent forming the quorum (blocked time)
    extra_bytes: int = 0  # bytes of the membership exchange, beside the round's own
    error: str | None = None  # why the quorum failed, when it did


class FixedGroup:
    """The `torch` backend: every process of the launch, every round."""

    def __init__(self, comm: ReplicaComm, schedule: Schedule):
        self.comm = comm
        self.schedule = schedule

    def due(self, step: int, max_steps: int) -> bool:
        return bool(self.schedule.due_fragments(step, max_steps))

    def expected_fragments(self, step: int, max_steps: int) -> list[int]:
        return self.schedule.due_fragments(step, max_steps)

    def start(self, step: int, max_steps: int, local: dict, joining: bool = False,
              overlapped: bool = False) -> RoundStart:
        return RoundStart(fragments=self.schedule.due_fragments(step, max_steps))

    def finish(self, start: RoundStart, result, record: dict) -> dict:
        return record

    def shutdown(self) -> None:
        pass
