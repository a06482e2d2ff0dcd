"""Where a sync's exchange runs, by kind. Every kind ends in the same landing (hf_diloco.outer.land, called by
hf_diloco.engine.SyncEngine.land); what differs is when and where the network runs:

    blocking     the backend's start, then the exchange: without a vote each bucket is averaged as `land`
                 applies it (one bucket held at a time, the network runs inside `land`); a sync that votes
                 (torchft) averages every bucket here, then votes
    overlapped   Δ_i snapshotted at launch; the backend's start and the whole exchange run in a background thread
                 while the replica trains on; it lands τ steps later
    vote only    a sync in which nobody brings progress (every participant joins): the vote alone
"""

from __future__ import annotations

import time

import torch

from .backends import SyncStart
from .codecs import Codec, ErrorFeedback
from .fragments import Fragment
from .gate import Gate
from .outer import Exchange, OuterState, StatsFn, SyncResult, exchange, is_finite, pseudo_gradients, sync_device


class SyncKinds:
    """The exchanges of one replica's syncs over `outer`'s buckets, grouped by `fragments` (each fragment's
    buckets), with the backend's `comm`, the codec and its residuals; `gate` judges the contributions once the
    backend's start says who takes part."""

    def __init__(self, outer: OuterState, comm, backend, codec: Codec | None, feedback: ErrorFeedback | None,
                 fragments: list[Fragment], gate: Gate):
        self.outer, self.comm, self.backend, self.codec, self.feedback = outer, comm, backend, codec, feedback
        self.fragments, self.gate = fragments, gate

    def buckets(self, fragments: list[int]) -> list[int]:
        """The buckets of the `fragments` a sync carries, in their order."""
        return [b for f in fragments for b in self.fragments[f].buckets]

    def judge(self, start: SyncStart, local: dict) -> SyncStart:
        """`start` with the gate's verdict on this sync's contributions (hf_diloco.gate)."""
        return self.gate.judge(start, local, self.comm, sum(self.fragments[f].size for f in start.fragments),
                               self.backend.replica)

    def vote_only(self, start: SyncStart) -> Exchange:
        """The exchange of a sync that carries nothing (every participant joins): the vote alone."""
        return Exchange([], [], SyncResult(weights=[0.0] * max(1, len(start.participants)), committed=self.comm.vote()),
                        weight=0.0)

    def blocking(self, start: SyncStart, stats: StatsFn, checking: bool) -> Exchange:
        """A blocking sync's exchange, once the backend started it."""
        if start.empty:
            return self.vote_only(start)
        buckets = self.buckets(start.fragments)
        if start.stash is not None:  # healed: Δ_i taken against the base it left
            return exchange(self.comm, buckets, [start.stash[b] for b in buckets], codec=self.codec,
                            feedback=self.feedback, stats=stats, weight=start.weight, decoded=checking)
        outer = self.outer
        finite = self.comm.control.members_all(is_finite(outer.params[i] for b in buckets for i in outer.buckets[b]))
        # Where the network runs: without a vote each bucket is averaged as `land` applies it; with one, here.
        deltas = pseudo_gradients(outer, self.comm, buckets, sync_device(outer, self.comm, self.codec))
        return exchange(self.comm, buckets, deltas, codec=self.codec,
                        feedback=self.feedback, stats=stats, weight=start.weight, finite=finite, decoded=checking,
                        lazy=not self.comm.votes)

    def in_background(self, step: int, max_steps: int, local: dict, fragments: list[int],
                      deltas: list[torch.Tensor], stats: StatsFn) -> tuple[SyncStart, Exchange, float, float]:
        """An overlapped sync, in the background thread: the backend's start, then the exchange of the Δ_i taken
        at launch. A replica whose sync turns out to carry other fragments than it expected (torchft: it healed
        from a peer further along), or that sits it out for a reason of its own, takes part with weight 0, sending
        zeros of the agreed sizes. One left out by the checks keeps its Δ_i, unsent: its agreement with the others
        is measured still, and decides when it is taken back. Returns (start, exchange, when the exchange began,
        which is when the participants and the verdict on their contributions were known, when it finished), in
        perf_counter times."""
        start = self.backend.start(step, max_steps, local, fragments, overlapped=True)
        if start.called_off:  # the fixed group's agreement found a save, an evaluation, a stop or the end
            return start, None, time.perf_counter(), time.perf_counter()
        sitting_out = start.weight == 0
        start = self.judge(start, local)
        began = time.perf_counter()
        buckets = self.buckets(start.fragments)
        weight = start.weight
        if start.fragments != fragments or sitting_out:
            deltas = [torch.zeros(self.outer.bucket_numel(self.outer.buckets[b]), device=self.comm.device)
                      for b in buckets]
            weight = 0.0
        if start.empty:
            landed = self.vote_only(start)
        else:
            landed = exchange(self.comm, buckets, deltas, codec=self.codec, feedback=self.feedback, stats=stats,
                              weight=weight, decoded="checks" in local)
        return start, landed, began, time.perf_counter()
