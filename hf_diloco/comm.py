"""Cross-replica collectives and their byte accounting.

Design choices:
- This module is the only place where replicas talk. Every collective below says who calls it, when, and what it
  costs. Between two outer syncs nothing here is called, so zero bytes cross replicas.
- A sync round is ONE all-reduce per bucket of the flat fp32 pseudo-gradient. The per-replica round statistics
  (loss, steps, tokens, time, pseudo-gradient norm) ride in a few extra slots of the last bucket: replica r writes
  its statistics into row r of an M x k block and zeros elsewhere, so the summed block holds every replica's row.
  Metrics therefore cost no extra collective and no extra round trip.
- Bytes are counted with the ring all-reduce model, 2 (M - 1) / M x payload per replica, which is what NCCL and
  gloo's ring algorithms send; the WAN benchmark checks it against the network interface counters.
- All ranks must call `all_reduce_round` the same number of times with buffers of the same sizes, in the same
  order (bucket 0, 1, ...), or the collectives deadlock; the trainer guarantees this by syncing at the same global
  steps on every replica.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class SyncCost:
    """What one sync round cost this replica."""

    payload_bytes: int  # bytes of the buffers reduced (what DDP-style accounting calls "message size")
    bytes_sent: int  # bytes this replica put on the wire under the ring all-reduce model
    collectives: int  # number of collective calls made


def ring_all_reduce_bytes(payload_bytes: int, world_size: int) -> int:
    """Bytes one replica sends in a ring all-reduce of `payload_bytes`: reduce-scatter plus all-gather.

    >>> ring_all_reduce_bytes(1000, 2)
    1000
    >>> ring_all_reduce_bytes(1000, 1)
    0
    """
    return (2 * (world_size - 1) * payload_bytes) // world_size


class ReplicaComm:
    """The replicas of a run and the collectives between them.

    With one replica (no process group, or a world of one) every collective is a local no-op costing 0 bytes, so
    the same code path serves a single process and a fleet.
    """

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        self.rank = dist.get_rank(group) if self.distributed else 0
        backend = dist.get_backend(group) if self.distributed else "none"
        # NCCL reduces device tensors; gloo (and no backend at all) works on CPU tensors.
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    @property
    def active(self) -> bool:
        return self.distributed and self.world_size > 1

    def broadcast_parameters(self, tensors: list[torch.Tensor]) -> SyncCost:
        """Make every replica start from rank 0's parameters.

        Called once by every replica before the first inner step; one broadcast per parameter dtype.
        """
        if not self.active:
            return SyncCost(0, 0, 0)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for tensor in tensors:
            by_dtype.setdefault(tensor.dtype, []).append(tensor)
        payload = 0
        for group in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1).to(self.device) for t in group])
            dist.broadcast(flat, src=0, group=self.group)
            offset = 0
            with torch.no_grad():
                for t in group:
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()
            payload += flat.numel() * flat.element_size()
        # A pipelined broadcast sends about one payload from every rank but the last.
        return SyncCost(payload, payload, len(by_dtype))

    def all_reduce_round(self, buckets: list[torch.Tensor], stats: torch.Tensor) -> tuple[torch.Tensor, SyncCost]:
        """Average the pseudo-gradient buckets in place and gather every replica's round statistics.

        Called by every replica at the end of every round, with buckets of identical sizes on every rank. Makes one
        all-reduce per bucket; `stats` (k values of this replica) rides in the last one.

        Returns the [world_size, k] matrix of all replicas' statistics and the cost of the round.
        """
        k = stats.numel()
        if not self.active:
            cost = SyncCost(sum(b.numel() * b.element_size() for b in buckets), 0, 0)
            return stats.detach().reshape(1, k).to(torch.float32).cpu(), cost
        block = torch.zeros(self.world_size * k, dtype=torch.float32, device=self.device)
        block[self.rank * k : (self.rank + 1) * k] = stats.detach().to(self.device, torch.float32)
        payload = 0
        last = len(buckets) - 1
        for index, bucket in enumerate(buckets):
            buffer = torch.cat([bucket, block]) if index == last else bucket
            dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=self.group)
            payload += buffer.numel() * buffer.element_size()
            if index == last:
                bucket.copy_(buffer[: bucket.numel()])
                block = buffer[bucket.numel() :]
            bucket.div_(self.world_size)
        cost = SyncCost(payload, ring_all_reduce_bytes(payload, self.world_size), len(buckets))
        return block.reshape(self.world_size, k).cpu(), cost
