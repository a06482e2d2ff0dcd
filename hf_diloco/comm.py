"""Cross-replica collectives and their byte accounting.

Layout: W processes form M = W / g replicas of g processes each (`replica_group_size` = g). Process r belongs to
replica r // g, where it is member r % g. Two kinds of process groups exist when g > 1:
- a replica group: the g processes of one replica (DDP all-reduces their gradients every step, inside the replica);
- a slice group: member j of every replica, M processes (the only path between replicas).
With g = 1 a replica is one process and the slice group is the whole world.

Design choices:
- This module is the only place where replicas talk. Every collective below says who calls it, when, and what it
  costs. Between two outer syncs nothing here is called, so zero bytes cross replicas.
- A sync round is ONE all-reduce per bucket of the flat fp32 pseudo-gradient across replicas. With g > 1 the
  replica's members hold the same pseudo-gradient (DDP keeps them identical), so member j all-reduces only the
  j-th 1/g slice with its counterparts in the other replicas, then the g averaged slices are all-gathered inside
  the replica: the bytes that cross replicas drop g-fold per process, and the all-gather stays on the fast
  intra-replica links.
- The round statistics (loss, steps, tokens, time, pseudo-gradient norm, stop request) ride in a few extra slots
  of the last bucket: replica r writes its statistics into row r of an M x k block and zeros elsewhere, so the
  summed block holds every replica's row; with g > 1 the blocks of all members travel in the all-gather too.
  Every process ends with every process's statistics, so decisions taken from them (stop now) are the same
  everywhere. Metrics cost no extra collective and no extra round trip.
- Bytes are counted with the ring model: an all-reduce sends 2 (M - 1) / M x payload per process, an all-gather
  (g - 1) / g x payload; NCCL's and gloo's ring algorithms send that. The WAN benchmark checks it against the
  network interface counters.
- All processes must call `all_reduce_round` the same number of times with buffers of the same sizes, in the same
  order (bucket 0, 1, ...), or the collectives deadlock; the trainer guarantees this by syncing at the same global
  steps everywhere. Process groups are created in the constructor, which every process must run, in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class SyncCost:
    """What one sync round cost this process."""

    payload_bytes: int  # bytes of the pseudo-gradient buffers (plus metric slots) this process reduced
    bytes_sent: int  # bytes this process sent to other replicas (ring model)
    intra_replica_bytes: int  # bytes this process sent inside its replica (the all-gather of slices)
    collectives: int  # number of collective calls made


def ring_all_reduce_bytes(payload_bytes: int, world_size: int) -> int:
    """Bytes one process sends in a ring all-reduce of `payload_bytes`: reduce-scatter plus all-gather.

    >>> ring_all_reduce_bytes(1000, 2)
    1000
    >>> ring_all_reduce_bytes(1000, 1)
    0
    """
    return (2 * (world_size - 1) * payload_bytes) // world_size


def ring_all_gather_bytes(payload_bytes: int, world_size: int) -> int:
    """Bytes one process sends in a ring all-gather whose result is `payload_bytes`.

    >>> ring_all_gather_bytes(1000, 4)
    750
    """
    return ((world_size - 1) * payload_bytes) // world_size


class ReplicaComm:
    """The replicas of a run and the collectives between them.

    With one process (no process group, or a world of one) every collective is a local no-op costing 0 bytes, so
    the same code path serves a single process and a fleet.
    """

    def __init__(self, group_size: int = 1):
        self.distributed = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if self.distributed else 1
        rank = dist.get_rank() if self.distributed else 0
        if world % group_size:
            raise ValueError(f"replica_group_size={group_size} does not divide the {world} processes")
        self.group_size = group_size
        self.num_replicas = world // group_size
        self.replica_index, self.member = divmod(rank, group_size)
        self.replica_group: dist.ProcessGroup | None = None  # None: a replica of one process
        self.slice_group: dist.ProcessGroup | None = None  # None: the whole world (g = 1)
        if self.distributed and group_size > 1:
            # dist.new_group is collective: every process creates every group, in the same order.
            for k in range(self.num_replicas):
                group = dist.new_group(list(range(k * group_size, (k + 1) * group_size)))
                if k == self.replica_index:
                    self.replica_group = group
            for j in range(group_size):
                group = dist.new_group(list(range(j, world, group_size)))
                if j == self.member:
                    self.slice_group = group
        backend = dist.get_backend() if self.distributed else "none"
        # NCCL reduces device tensors; gloo (and no backend at all) works on CPU tensors.
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    @property
    def active(self) -> bool:
        """True when there are other replicas to talk to."""
        return self.distributed and self.num_replicas > 1

    def broadcast_parameters(self, tensors: list[torch.Tensor]) -> SyncCost:
        """Make every process start from global rank 0's parameters.

        Called once by every process before the first inner step; one broadcast per parameter dtype.
        """
        if not self.distributed or self.num_replicas * self.group_size == 1:
            return SyncCost(0, 0, 0, 0)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for tensor in tensors:
            by_dtype.setdefault(tensor.dtype, []).append(tensor)
        payload = 0
        for group in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1).to(self.device) for t in group])
            dist.broadcast(flat, src=0)
            offset = 0
            with torch.no_grad():
                for t in group:
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()
            payload += flat.numel() * flat.element_size()
        # A pipelined broadcast sends about one payload from every process but the last.
        return SyncCost(payload, payload, 0, len(by_dtype))

    def all_reduce_round(self, buckets: list[torch.Tensor], stats: torch.Tensor) -> tuple[torch.Tensor, SyncCost]:
        """Average the pseudo-gradient buckets over replicas, in place, and gather every process's statistics.

        Called by every process at the end of every round, with buckets of identical sizes everywhere. Makes, per
        bucket, one all-reduce across replicas and, when g > 1, one all-gather inside the replica. `stats` (k
        values of this process) rides in the last bucket's all-reduce (as row `replica_index` of an M x k block)
        and, with g > 1, in its all-gather, so every process ends with the same statistics.

        Returns the [g, M, k] tensor of all processes' statistics (member, replica, value), identical on every
        process, and the cost of the round.
        """
        k = stats.numel()
        g, m = self.group_size, self.num_replicas
        block = torch.zeros(m, k, dtype=torch.float32)
        block[self.replica_index] = stats.detach().to(torch.float32).cpu()
        if not self.active:
            payload = sum(b.numel() * b.element_size() for b in buckets)
            return block.reshape(1, m, k), SyncCost(payload, 0, 0, 0)
        block = block.reshape(-1).to(self.device)
        payload = sent = intra = collectives = 0
        last = len(buckets) - 1
        gathered_stats = None
        for index, bucket in enumerate(buckets):
            pad = -bucket.numel() % g  # slices must have equal sizes for the all-gather
            padded = torch.cat([bucket, bucket.new_zeros(pad)]) if pad else bucket
            chunk = padded.view(g, -1)[self.member]
            n = chunk.numel()
            # In place when nothing rides along: the bucket is overwritten below anyway.
            buffer = torch.cat([chunk, block]) if index == last else chunk
            dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=self.slice_group)
            collectives += 1
            payload += buffer.numel() * buffer.element_size()
            sent += ring_all_reduce_bytes(buffer.numel() * buffer.element_size(), m)
            buffer[:n] /= m
            if g == 1:
                bucket.copy_(buffer[:n])
                if index == last:
                    gathered_stats = buffer[n:].reshape(1, m, k)
                continue
            gathered = torch.empty(g * buffer.numel(), dtype=buffer.dtype, device=buffer.device)
            dist.all_gather_into_tensor(gathered, buffer, group=self.replica_group)
            collectives += 1
            intra += ring_all_gather_bytes(gathered.numel() * gathered.element_size(), g)
            rows = gathered.view(g, -1)
            bucket.copy_(rows[:, :n].reshape(-1)[: bucket.numel()])
            if index == last:
                gathered_stats = rows[:, n:].reshape(g, m, k)
        return gathered_stats.cpu(), SyncCost(payload, sent, intra, collectives)
