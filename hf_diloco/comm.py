"""Cross-replica collectives and their byte accounting.

Layout: W processes form M = W / g replicas of g processes each (`replica_group_size` = g). Process r belongs to
replica r // g, where it is member r % g. Two kinds of process groups exist when g > 1:
- a replica group: the g processes of one replica (DDP all-reduces their gradients every step, inside the replica);
- a slice group: member j of every replica, M processes (the only path between replicas).
With g = 1 a replica is one process and the slice group is the whole world.

Design choices:
- Every round's collectives run through `ReplicaComm` here: each below says who calls it, when, and what it costs.
  (On torchft, `TorchftComm` replaces the three collectives across replicas, all-reduce, all-to-all and
  all-gather, with torchft's process group, and the membership table and healing of hf_diloco.torchft_backend talk
  through torchft's Manager.) Between two outer syncs nothing here crosses replicas, so zero bytes do: the one call
  between syncs is `Control.members_any` inside a replica of several processes (its members agree on the step a
  time-budget sync starts at), over the replica's own group.
- A sync is a sequence of buckets of the flat fp32 pseudo-gradient, summed over replicas one at a time
  (`sum_replicas`; the caller divides by the replicas that took part). With g > 1 the replica's members hold the
  same pseudo-gradient (DDP keeps them identical), so member j sums only the j-th 1/g slice with its
  counterparts in the other replicas, then the g summed slices are all-gathered
  inside the replica: the bytes that cross replicas drop g-fold per process, and the all-gather stays on the fast
  intra-replica links.
- Three ways across replicas, by codec:
    none      one fp32 all-reduce per bucket: 2 (M − 1)/M · 4n bytes sent per process (ring).
    dense     (bf16, fp16, int8, int4) a quantized reduce-scatter, as an all-to-all of the M encoded shards of
              the bucket; each process decodes the M copies of its own shard and sums them in fp32; it
              re-encodes the sum and an all-gather hands every process every encoded sum:
              2 (M − 1)/M · S bytes sent per process, S the encoded bucket, so the cost does not grow with M.
    sparse    an all-gather of every replica's payload (top-k positions differ between replicas, so sparse
              vectors cannot be summed on the way): (M − 1) · S bytes per process. S is ~1/136 of fp32 with the
              defaults, so this beats the dense codecs until M is in the dozens.
  Every process decodes the same bytes in the same order, so all hold bit-identical sums.
- The round statistics (loss, steps, tokens, time, pseudo-gradient norm, stop request) ride with the last
  bucket: in the fp32 all-reduce as row r of an M x k block of zeros, in the codecs' all-gather as k fp32 values
  appended to the payload, and with g > 1 in the all-gather inside the replica. Every process ends with every
  process's statistics, so decisions taken from them (stop now) are the same everywhere. Metrics cost no extra
  collective across replicas and no extra round trip (a sharded replica's members add up their shards' norms, and
  agree on whether their values are finite, with small all-reduces inside the replica).
- Bytes are counted from the payload sizes and the algorithm: ring all-reduce 2 (M − 1)/M x payload, all-to-all
  (M − 1) shards, ring all-gather (M − 1) payloads (inside a replica: (g − 1)/g of the result). The two-node test
  checks the count against the network interface counters.
- All processes must call `sum_replicas` the same number of times with buckets of the same sizes, in the same order,
  or the collectives deadlock; the trainer guarantees this by syncing the same buckets at the same global steps
  everywhere. Process groups are created in the constructor, which every process must run, in the same order.
  A sync overlapped with training runs in one background thread on process groups of its own.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import math
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from .codecs import Codec, ErrorFeedback, SparseCodec, from_bytes
from .errors import ConfigError, RunError, first_line


def gather_into(output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Every process's `tensor`, concatenated into `output`. torch 2.13 calls it all_gather_single and warns on the
    old name, which is all that torch 2.4 to 2.12 have (looked up at each call, so a wrapper set later is used)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor, group=group)


def tensor_digest(tensors: list[torch.Tensor]) -> bytes:
    """SHA-256 of the tensors' bytes, in order: equal exactly when every bit is (how replicas check that they start
    from identical parameters)."""
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return digest.digest()


@torch.no_grad()
def copy_flat(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy the values of `flat` (the tensors, flattened and concatenated in order) back into `tensors`."""
    offset = 0
    for tensor in tensors:
        tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()


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


def sync_bytes(numel: int, replicas: int, group_size: int = 1, codec: Codec | None = None, stats: int = 0) -> int:
    """Bytes one process sends across replicas to sum `numel` values (one bucket) with `codec`, plus `stats`
    fp32 values riding along, by the algorithms of `ReplicaComm.sum_replicas`.

    >>> sync_bytes(1000, replicas=2), sync_bytes(1000, replicas=8)   # fp32 ring all-reduce
    (4000, 7000)
    >>> from hf_diloco.codecs import make_codec
    >>> sync_bytes(1000, replicas=2, codec=make_codec("int8")), sync_bytes(1000, replicas=8, codec=make_codec("int8"))
    (1008, 1806)
    """
    m = replicas
    if m <= 1:
        return 0
    values = -(-numel // group_size)
    if codec is None or codec.name == "none":
        return ring_all_reduce_bytes(4 * (values + m * stats), m)
    if isinstance(codec, SparseCodec):
        return (m - 1) * (codec.encoded_bytes(values) + 4 * stats)
    shard = -(-values // m)
    return (m - 1) * codec.encoded_bytes(shard) + (m - 1) * (codec.encoded_bytes(shard) + 4 * stats)


class ShardLayout:
    """Which values of one bucket each of a replica's g members syncs: parameter after parameter, the rows FSDP2
    gives that member (ceil(rows/g) to each in turn, so the last members get fewer or none), padded with zeros to
    ceil(rows/g) rows. Member j of every replica syncs part j. A replica with DDP inside and one sharded by FSDP2
    thus send the same values in the same order, and every codec quantizes them alike.

    >>> layout = ShardLayout([torch.Size([3, 2]), torch.Size([1])], group_size=2)
    >>> full = torch.arange(7.0)                   # rows [0 1] [2 3] [4 5] of the first parameter, then [6]
    >>> layout.part(full, 0).tolist(), layout.part(full, 1).tolist()
    ([0.0, 1.0, 2.0, 3.0, 6.0], [4.0, 5.0, 0.0, 0.0, 0.0])
    >>> layout.assemble(torch.stack([layout.part(full, 0), layout.part(full, 1)])).tolist() == full.tolist()
    True
    >>> layout.unpad(layout.pad(torch.tensor([4.0, 5.0]), 1), 1).tolist()    # member 1's own shards, unpadded
    [4.0, 5.0]
    """

    def __init__(self, shapes: list[torch.Size], group_size: int):
        self.group_size = group_size
        self.params = []  # (rows, values per row, rows per member)
        for shape in shapes:
            rows = shape[0] if len(shape) else 1
            width = math.prod(shape[1:]) if len(shape) > 1 else 1
            self.params.append((rows, width, -(-rows // group_size)))
        self.part_numel = sum(per * width for _, width, per in self.params)

    def _spans(self, member: int):
        """(offset in the full bucket, offset in the local shards, offset in the part, values held, values padded)
        of each parameter, for `member`."""
        full = local = part = 0
        for rows, width, per in self.params:
            start = min(rows, member * per)
            held = (min(rows, start + per) - start) * width
            yield full + start * width, local, part, held, per * width
            full, local, part = full + rows * width, local + held, part + per * width

    def part(self, full: torch.Tensor, member: int) -> torch.Tensor:
        out = full.new_zeros(self.part_numel)
        for at_full, _, at_part, held, _ in self._spans(member):
            out[at_part : at_part + held] = full[at_full : at_full + held]
        return out

    def pad(self, local: torch.Tensor, member: int) -> torch.Tensor:
        out = local.new_zeros(self.part_numel)
        for _, at_local, at_part, held, _ in self._spans(member):
            out[at_part : at_part + held] = local[at_local : at_local + held]
        return out

    def unpad(self, part: torch.Tensor, member: int) -> torch.Tensor:
        return torch.cat([part[at_part : at_part + held] for _, _, at_part, held, _ in self._spans(member)])

    def place(self, part: torch.Tensor, member: int, full: torch.Tensor) -> None:
        """Write `member`'s part into its places in `full` (the inverse of `part`)."""
        for at_full, _, at_part, held, _ in self._spans(member):
            full[at_full : at_full + held] = part[at_part : at_part + held]

    def assemble(self, parts: torch.Tensor) -> torch.Tensor:
        total = sum(rows * width for rows, width, _ in self.params)
        out = parts.new_empty(total)
        for member in range(self.group_size):
            for at_full, _, at_part, held, _ in self._spans(member):
                out[at_full : at_full + held] = parts[member, at_part : at_part + held]
        return out


@dataclass
class Topology:
    """Where this process sits: `num_replicas` replicas of `group_size` processes each; this process is member
    `member` of replica `replica_index`. Its process groups: the replica's own (`replica_group`; None for a replica of
    one process), member j of every replica (`slice_group`, the sync's collectives across replicas) and the sync's
    all-gather inside the replica (`gather_group`; its own group when syncs run in a background thread)."""

    group_size: int = 1
    num_replicas: int = 1
    replica_index: int = 0
    member: int = 0
    distributed: bool = False
    # Sharded replicas (FSDP2): member j holds shard j of every parameter, so what it syncs is its own shard, whole,
    # with member j of every other replica, and nothing is gathered back inside the replica.
    sharded: bool = False
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    timeout_seconds: float | None = None
    replica_group: dist.ProcessGroup | None = None
    slice_group: dist.ProcessGroup | None = None
    gather_group: dist.ProcessGroup | None = None

    @classmethod
    def of_launch(cls, group_size: int = 1, background: bool = False, timeout_seconds: float | None = None,
                  sharded: bool = False) -> Topology:
        """The launch's processes cut into replicas of `group_size` (collective: every process calls it, in the
        same order). `background`: the sync's all-gather gets a group of its own, so that a sync running in a
        background thread never interleaves with the training thread's DDP all-reduces."""
        distributed = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if distributed else 1
        rank = dist.get_rank() if distributed else 0
        if world % group_size:
            raise ConfigError(f"replica_group_size={group_size} does not divide the {world} launched process(es); "
                              f"launch a multiple of it (accelerate launch --num_processes).")
        replica_index, member = divmod(rank, group_size)
        topology = cls(group_size=group_size, num_replicas=world // group_size, replica_index=replica_index,
                       member=member, distributed=distributed, sharded=sharded and group_size > 1,
                       timeout_seconds=timeout_seconds)
        if not distributed:
            return topology
        # dist.new_group is collective: every process creates every group, in the same order. The groups the sync
        # uses across replicas carry the sync timeout; DDP's replica groups keep the backend's default.
        timeout = None if timeout_seconds is None else timedelta(seconds=timeout_seconds)
        for k in range(topology.num_replicas if group_size > 1 else 0):
            group = dist.new_group(list(range(k * group_size, (k + 1) * group_size)))
            if k == replica_index:
                topology.replica_group = topology.gather_group = group
        for j in range(group_size):
            group = dist.new_group(list(range(j, world, group_size)), timeout=timeout)
            if j == member:
                topology.slice_group = group
        for k in range(topology.num_replicas if group_size > 1 and background else 0):
            group = dist.new_group(list(range(k * group_size, (k + 1) * group_size)))
            if k == replica_index:
                topology.gather_group = group
        # NCCL reduces device tensors; gloo works on CPU tensors.
        nccl = dist.get_backend() == "nccl"
        topology.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        return topology

    @property
    def active(self) -> bool:
        """True when there are other replicas to talk to."""
        return self.distributed and self.num_replicas > 1


_TRAININGS = itertools.count(1)  # trainings begun in this process: every process of a launch counts alike


class Rendezvous:
    """The launch's rendezvous store (TCPStore) beside the collectives: a few bytes that need no collective. Who
    reached which sync (`arrive`), so that a sync that timed out names the replicas it waited for
    (`naming_the_absent`); that a process wrote its part of a checkpoint (`written`, `wait_for`); numbers known only
    after the last collective (`replica_values`). Outside a launch (one process) every call does nothing.

    The store outlives a training: a launch that trains several times (a second Trainer, or `train()` again) must
    not read the keys of the one before (a checkpoint of the same step would look written by every process before it
    is). Every key is under this training's number (`key`), which every process counts alike, as they make the same
    collectives in the same order."""

    def __init__(self, topology: Topology):
        self.topology = topology
        self.training = next(_TRAININGS)
        self.trained = False

    def begin_training(self) -> None:
        """A `train()` begins: a second one of the same trainer gets a number of its own."""
        if self.trained:
            self.training = next(_TRAININGS)
        self.trained = True

    def key(self, name: str) -> str:
        """`name` in the store, under this training's number."""
        return f"hf_diloco/{self.training}/{name}"

    def store(self):
        """The launch's rendezvous store, None when no process group is up."""
        if not self.topology.distributed:
            return None
        try:
            return dist.distributed_c10d._get_default_store()
        except Exception:  # no store reachable: a timeout is still reported, without names
            return None

    def arrive(self, step: int) -> None:
        """Note in the rendezvous store that this process reached the sync of `step` (a few bytes, no collective)."""
        store = self.store() if self.topology.active else None
        if store is not None:
            store.set(self.key(f"arrived/{dist.get_rank()}"), str(step))

    def written(self, name: str) -> None:
        """Say that this process's part of `name` (a checkpoint, or a step of writing one) is done."""
        store = self.store()
        if store is not None:
            store.set(self.key(f"{name}/{dist.get_rank()}"), "1")

    def wait_for(self, name: str, ranks: list[int] | None, timeout_seconds: float) -> bool:
        """Wait until the processes `ranks` (None: every process of the launch) have said `written(name)`; False
        if they have not within `timeout_seconds`. The store is looked at every 20 ms rather than waited on, so a
        wait in a background thread (a checkpoint's marker) holds the store for one look at a time, never across
        the main thread's own use of it. Runs at a sync boundary, not as a collective between syncs."""
        store = self.store()
        if store is None:
            return True
        everyone = range(self.topology.num_replicas * self.topology.group_size)
        keys = [self.key(f"{name}/{rank}") for rank in (everyone if ranks is None else ranks)]
        deadline = time.monotonic() + timeout_seconds
        while not store.check(keys):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def replica_values(self, name: str, value: float, timeout_seconds: float) -> list[float] | None:
        """Every replica's `value` (its first member's), through the rendezvous store; None outside a launch.

        For numbers known only after the last collective (the last round's agreement): a few bytes at the end of
        training, no collective.
        """
        store = self.store() if self.topology.active else None
        if store is None:
            return None
        topology = self.topology
        if topology.member == 0:
            store.set(self.key(f"{name}/{topology.replica_index}"), repr(float(value)))
        keys = [self.key(f"{name}/{replica}") for replica in range(topology.num_replicas)]
        store.wait(keys, timedelta(seconds=timeout_seconds))
        return [float(store.get(key)) for key in keys]

    def absent(self, step: int) -> dict[int, int | None]:
        """Replicas that have not reached the sync of `step`, with the step of the last sync each reached."""
        store = self.store()
        if store is None:
            return {}
        group_size = self.topology.group_size
        missing: dict[int, int | None] = {}
        for rank in range(self.topology.num_replicas * group_size):
            key = self.key(f"arrived/{rank}")
            seen = int(store.get(key)) if store.check([key]) else None
            if seen is None or seen < step:
                replica = rank // group_size
                missing[replica] = seen if replica not in missing else min(missing[replica] or 0, seen or 0)
        return missing

    @contextlib.contextmanager
    def naming_the_absent(self, step: int):
        """A collective of the sync of `step` that failed (sync_timeout expired, or a peer's connection closed)
        becomes one sentence naming the replicas that never reached this sync and the last sync step each was seen
        at (from `arrive`)."""
        try:
            yield
        except RuntimeError as error:
            if not self.topology.active:
                raise
            absent = self.absent(step)
            if not absent:
                raise RunError(f"the sync at step {step} failed: {first_line(error)}.") from None
            names = ", ".join(
                f"replica {replica} (last seen at the sync of step {seen})" if seen is not None
                else f"replica {replica} (never reached a sync)" for replica, seen in sorted(absent.items())
            )
            timeout = self.topology.timeout_seconds
            timeout = f"sync_timeout={timeout:g} s" if timeout else "the sync timeout"
            raise RunError(
                f"the sync at step {step} gave up after waiting for {names} ({timeout}, or its connection closed); "
                f"check that process, or raise sync_timeout for slow links."
            ) from None


class Unwatched(Rendezvous):
    """No rendezvous across replicas: a backend whose syncs never wait for an absent replica (torchft: its syncs
    roll back instead, and each replica is a launch of its own), so there is no one to name and nothing to hand
    over."""

    def arrive(self, step: int) -> None:
        pass

    def replica_values(self, name: str, value: float, timeout_seconds: float) -> list[float] | None:
        return None

    @contextlib.contextmanager
    def naming_the_absent(self, step: int):
        yield


class Control:
    """Small control collectives of a few float64 numbers each, beside the sync's data: tables across replicas (what
    a time-budget sync agrees on, the contribution checks' rows) and totals and flags inside one replica (its
    members' shards' norms, whether any member's budget is spent, whether every member's values are finite). Each
    returns or documents the bytes it sent; with one process each is a no-op costing 0 bytes."""

    def __init__(self, topology: Topology):
        self.topology = topology

    def replica_table(self, tokens: float, row: list[float]) -> tuple[torch.Tensor, int]:
        """One small all-reduce over every process: an M x (1 + len(row)) float64 table whose row r holds replica
        r's tokens (the sum over its members) and its first member's `row`; and the bytes this process sent. Every
        process gets the same table: what a time-budget sync agrees on before its exchange.

        >>> ReplicaComm().control.replica_table(128, [7.0, 0.0])[0].tolist()
        [[128.0, 7.0, 0.0]]
        """
        table = torch.zeros(self.topology.num_replicas, 1 + len(row), dtype=torch.float64)
        table[self.topology.replica_index, 0] = float(tokens)
        if self.topology.member == 0:
            table[self.topology.replica_index, 1:] = torch.tensor(row, dtype=torch.float64)
        if not self.topology.distributed:
            return table, 0
        on_device = table.to(self.topology.device)
        dist.all_reduce(on_device)
        world = self.topology.num_replicas * self.topology.group_size
        return on_device.cpu(), ring_all_reduce_bytes(table.numel() * 8, world)

    def replica_rows(self, row: list[float]) -> tuple[torch.Tensor, int]:
        """Every replica's `row` (each member of a replica gives the same one): an M x len(row) float64 table,
        all-reduced over this member's slice group, which carries the sync timeout (a replica that never arrives
        is named, as in the sync's own collectives); and the bytes this process sent.

        >>> ReplicaComm().control.replica_rows([7.0, 0.5])[0].tolist()
        [[7.0, 0.5]]
        """
        table = torch.zeros(self.topology.num_replicas, len(row), dtype=torch.float64)
        table[self.topology.replica_index] = torch.tensor(row, dtype=torch.float64)
        if not self.topology.active:
            return table, 0
        on_device = table.to(self.topology.device)
        dist.all_reduce(on_device, group=self.topology.slice_group)
        return on_device.cpu(), ring_all_reduce_bytes(table.numel() * 8, self.topology.num_replicas)

    def shards_total(self, values: list[float]) -> list[float]:
        """Sums of `values` over this replica's members: sharded replicas add up their shards' norms and dot
        products (an all-reduce of a few numbers inside the replica, at a round's end). Otherwise the values."""
        if not self.topology.sharded or self.topology.replica_group is None:
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=self.topology.device)
        dist.all_reduce(tensor, group=self.topology.replica_group)
        return tensor.tolist()

    def members_total(self, values: list[float]) -> list[float]:
        """Sums of `values` over this replica's members, sharded or not (an all-reduce of a few numbers inside the
        replica). With one process per replica, the values."""
        if self.topology.group_size == 1 or self.topology.replica_group is None:
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=self.topology.device)
        dist.all_reduce(tensor, group=self.topology.replica_group)
        return tensor.tolist()

    def members_any(self, flag: bool) -> bool:
        """True when `flag` holds on any member of this replica (a replica of several processes decides together
        whether its time budget is spent: one tiny all-reduce inside the replica). Otherwise `flag`."""
        if self.topology.replica_group is None:
            return flag
        tensor = torch.tensor([1.0 if flag else 0.0], device=self.topology.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.topology.replica_group)
        return bool(tensor.item() > 0)

    def members_all(self, flag: bool) -> bool:
        """True when `flag` holds on every member of this replica (sharded replicas: each member checks its own
        shards, and the replica sits a round out as a whole). Otherwise `flag`."""
        if not self.topology.sharded or self.topology.gather_group is None:
            return flag
        tensor = torch.tensor([0.0 if flag else 1.0], device=self.topology.device)
        dist.all_reduce(tensor, group=self.topology.gather_group)
        return bool(tensor.item() == 0)


class ReplicaComm:
    """The reduction across replicas (the `torch` backend: a fixed group): the sync's sums, the start from
    identical parameters, each documenting its bytes. Where this process sits is its `topology`; the rendezvous store
    beside the collectives is its `rendezvous`; small tables and totals of a few numbers are its `control`.

    With one process (no process group, or a world of one) every collective is a local no-op costing 0 bytes, so
    the same code path serves a single process and a fleet. The three collectives across replicas
    (`_all_reduce`, `_all_to_all`, `_all_gather`) are the only methods another backend replaces
    (hf_diloco.torchft_backend.TorchftComm runs them on torchft's process group over the sync's quorum).
    """

    # A backend that votes on every round (torchft) holds the averaged pseudo-gradient until the vote and applies
    # it only if every participant's collectives succeeded; a fixed group either completes a round or fails.
    votes = False
    # The full shapes of each bucket's parameters, by bucket key: with g > 1 each member syncs the rows FSDP2 would
    # give it (ShardLayout). Without them (a caller that syncs bare vectors) member j syncs the j-th 1/g slice.
    bucket_shapes: dict[str, list[torch.Size]] | None = None
    # Tensor parallel: the (offset, length) of the values in each bucket that another member of the replica holds too
    # and counts instead of this one (OuterState.repeated_spans), so that a replica's norms count them once.
    repeated_spans: dict[str, list[tuple[int, int]]] | None = None

    # Where this process sits (its Topology), read through the communicator.
    @property
    def group_size(self) -> int:
        """Processes in a replica (g) (Topology.group_size)."""
        return self.topology.group_size

    @property
    def num_replicas(self) -> int:
        """Replicas in the sync (M) (Topology.num_replicas)."""
        return self.topology.num_replicas

    @property
    def replica_index(self) -> int:
        """This process's replica, among the sync's (Topology.replica_index)."""
        return self.topology.replica_index

    @property
    def member(self) -> int:
        """This process's place in its replica (Topology.member)."""
        return self.topology.member

    @property
    def distributed(self) -> bool:
        """Whether a process group exists (Topology.distributed)."""
        return self.topology.distributed

    @property
    def sharded(self) -> bool:
        """Whether each member holds its own shard of every parameter (Topology.sharded)."""
        return self.topology.sharded

    @property
    def device(self) -> torch.device:
        """Where the sync's collectives run (Topology.device)."""
        return self.topology.device

    @property
    def timeout_seconds(self) -> float | None:
        """How long a collective waits (Topology.timeout_seconds)."""
        return self.topology.timeout_seconds

    @property
    def replica_group(self) -> dist.ProcessGroup | None:
        """The group of this replica's processes (Topology.replica_group)."""
        return self.topology.replica_group

    @property
    def slice_group(self) -> dist.ProcessGroup | None:
        """Member j of every replica: the only path between replicas (Topology.slice_group)."""
        return self.topology.slice_group

    @property
    def gather_group(self) -> dist.ProcessGroup | None:
        """The group a replica's summed slices are all-gathered over (Topology.gather_group)."""
        return self.topology.gather_group

    @property
    def active(self) -> bool:
        """Whether there is anyone to reduce with (Topology.active)."""
        return self.topology.active

    def __init__(self, group_size: int = 1, background: bool = False, timeout_seconds: float | None = None,
                 sharded: bool = False, *, topology: Topology | None = None, rendezvous: Rendezvous | None = None):
        self.topology = topology or Topology.of_launch(group_size, background, timeout_seconds, sharded)
        self.rendezvous = rendezvous or Rendezvous(self.topology)
        self.control = Control(self.topology)

    def vote(self) -> bool:
        return True

    def describe_buckets(self, bucket_shapes: dict[str, list[torch.Size]] | None,
                         repeated_spans: dict[str, list[tuple[int, int]]] | None) -> None:
        """What this member syncs of each bucket (see the class attributes), told once the outer state is cut."""
        self.bucket_shapes, self.repeated_spans = bucket_shapes, repeated_spans

    def start_identical(self, tensors: list[torch.Tensor], step: int = 0, resumed: bool = False
                        ) -> tuple[SyncCost, tuple[int, int]]:
        """Make every process start from global rank 0's parameters, sending them only if they differ; and the
        lowest and highest step the processes start at.

        Called once by every process before the first inner step. Each process hashes its parameters (SHA-256 of
        their bytes); one all-reduce of 2 x 9 small integers (MAX of the start step and the digest and of their
        negations, so min and max at once) tells every process whether all start at one step and whether all
        digests agree. Processes that start at different steps (they resumed from different checkpoints, or some
        from none) get the two steps and nothing is sent: the caller stops. Processes that `resumed` keep what they
        loaded (a replica's parameters are its own mid-run). Otherwise replicas built from the same seed, or loaded
        from the same files, agree and nothing else is sent; where they differ rank 0 broadcasts its parameters,
        one broadcast per dtype (what a ring-pipelined broadcast puts on the wire: about one payload from every
        process but the last, counted here for every process).
        """
        nothing = SyncCost(0, 0, 0, 0)
        if not self.distributed or self.num_replicas * self.group_size == 1:
            return nothing, (step, step)
        # Sharded replicas: member j of every replica holds shard j, so the check and the broadcast run among
        # them (from replica 0's member j); whole replicas: among every process, from global rank 0.
        group, source, world = ((self.slice_group, self.member, self.num_replicas) if self.sharded
                                else (None, 0, self.num_replicas * self.group_size))
        if world == 1:
            return nothing, (step, step)
        digest = tensor_digest(tensors)
        words = [step, *(int.from_bytes(digest[i : i + 4], "big") for i in range(0, 32, 4))]  # 32-bit words
        check = torch.tensor(words + [-w for w in words], dtype=torch.int64, device=self.device)
        dist.all_reduce(check, op=dist.ReduceOp.MAX, group=group)
        cost = SyncCost(check.numel() * 8, ring_all_reduce_bytes(check.numel() * 8, world), 0, 1)
        steps = (-int(check[9]), int(check[0]))
        if steps[0] != steps[1] or resumed or bool((check[:9] == -check[9:]).all()):
            return cost, steps  # (max == min for every word: every process holds the same bits)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for tensor in tensors:
            by_dtype.setdefault(tensor.dtype, []).append(tensor)
        for same_dtype in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1).to(self.device) for t in same_dtype])
            dist.broadcast(flat, src=source, group=group)
            copy_flat(flat, same_dtype)
            payload = flat.numel() * flat.element_size()
            cost = SyncCost(cost.payload_bytes + payload, cost.bytes_sent + payload, 0, cost.collectives + 1)
        return cost, steps

    def fp32_bytes_sent(self, numel: int, with_stats: int = 0) -> int:
        """What this process would send to sum `numel` values (+ k stats) with an fp32 all-reduce."""
        if not self.active:
            return 0
        values = (numel if self.sharded else -(-numel // self.group_size)) + self.num_replicas * with_stats
        return ring_all_reduce_bytes(4 * values, self.num_replicas)

    def sum_replicas(
        self,
        delta: torch.Tensor,
        *,
        codec: Codec | None = None,
        feedback: ErrorFeedback | None = None,
        key: str = "",
        stats: torch.Tensor | None = None,
        decoded: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, SyncCost]:
        """Σ_i Δ_i over the replicas for one bucket of the flat fp32 pseudo-gradient; `delta` is left untouched.

        The caller divides by the total weight of the replicas that took part (the weighted mean of
        hf_diloco.fragments, whose weights ride along with the first bucket).

        Called by every process, once per bucket, in the same bucket order everywhere, with buckets of identical
        sizes (the trainer syncs the same buckets at the same steps on every process). With g > 1 each member
        sums its 1/g slice across replicas, then the slices are all-gathered inside the replica.

        `codec` None (or "none") is an fp32 all-reduce. A dense codec (bf16, fp16, int8, int4) is a quantized
        reduce-scatter (all-to-all of encoded shards), an fp32 sum of the M decoded copies of this process's
        shard, a re-encode of the sum and an all-gather of the encoded sums: about 2·S bytes sent per
        process whatever M (S = the encoded bucket). `sparse` all-gathers every replica's payload and sums the M
        decoded payloads in replica order: (M − 1)·S, fine while M is small, and the only way to add sparse
        vectors whose kept positions differ. Every process decodes the same bytes in the same order, so all hold
        bit-identical sums.

        `feedback` (error feedback, codecs only) adds this replica's residual for `key` before encoding and keeps
        what the encoding lost. `stats` (k values of this process) ride along with the bucket's collective; the
        [g, M, k] statistics of every process come back, identical everywhere.

        `decoded`, a list, receives what the others decode of this replica's contribution (a codec's values, the
        error-feedback residual included) in `delta`'s frame; with g > 1 and no sharding it holds this member's
        slice and zeros where the replica's other members send.
        """
        codec = None if codec is None or codec.name == "none" else codec
        g, m = self.group_size, self.num_replicas
        shapes = (self.bucket_shapes or {}).get(key) if g > 1 else None
        layout = ShardLayout(shapes, g) if shapes is not None else None
        if self.sharded:
            chunk = delta if layout is None else layout.pad(delta, self.member)
        elif layout is not None:
            chunk = layout.part(delta, self.member)
        else:
            pad = -delta.numel() % g  # slices must have equal sizes for the all-gather inside the replica
            flat = torch.cat([delta, delta.new_zeros(pad)]) if pad else delta
            chunk = flat.view(g, -1)[self.member]
        if codec is None:
            total, rows, cost = self._sum_fp32(chunk, stats)
        elif isinstance(codec, SparseCodec):
            total, rows, cost = self._sum_sparse(chunk, codec, feedback, key, stats, decoded)
        else:
            total, rows, cost = self._sum_dense(chunk, codec, feedback, key, stats, decoded)
        if decoded and codec is not None:
            decoded[0] = self._in_frame(decoded[0], delta, layout)
        if g == 1:
            return total[: delta.numel()], None if rows is None else rows.reshape(1, m, -1).cpu(), cost
        if self.sharded:  # the shard's sum is this process's to keep; only the statistics go round the replica
            total = total if layout is None else layout.unpad(total, self.member)
            return total, None if rows is None else self._gather_rows(rows, cost), cost
        # Inside the replica: every member contributes its summed slice (fp32, fast links) and its stats rows.
        k = 0 if rows is None else rows.numel() // m
        piece = total if rows is None else torch.cat([total, rows.reshape(-1).to(total.device)])
        gathered = torch.empty(g * piece.numel(), dtype=piece.dtype, device=piece.device)
        gather_into(gathered, piece, group=self.gather_group)
        cost.collectives += 1
        cost.intra_replica_bytes += ring_all_gather_bytes(gathered.numel() * gathered.element_size(), g)
        pieces = gathered.view(g, -1)
        n = chunk.numel()
        result = (pieces[:, :n].reshape(-1)[: delta.numel()].clone() if layout is None
                  else layout.assemble(pieces[:, :n]))
        return result, None if rows is None else pieces[:, n:].reshape(g, m, k).cpu(), cost

    def _gather_rows(self, rows: torch.Tensor, cost: SyncCost) -> torch.Tensor:
        """[g, M, k]: the statistics rows of every member of this replica (an all-gather inside it, k·M values)."""
        piece = rows.reshape(-1).to(self.device, torch.float32)
        gathered = torch.empty(self.group_size * piece.numel(), dtype=piece.dtype, device=piece.device)
        gather_into(gathered, piece, group=self.gather_group)
        cost.collectives += 1
        cost.intra_replica_bytes += ring_all_gather_bytes(gathered.numel() * 4, self.group_size)
        return gathered.view(self.group_size, self.num_replicas, -1).cpu()

    # --- the collectives across replicas (member j of every replica), in place on their output ---

    def _all_reduce(self, buffer: torch.Tensor) -> None:
        dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=self.slice_group)

    def _all_to_all(self, received: torch.Tensor, send: torch.Tensor) -> None:
        dist.all_to_all_single(received, send, group=self.slice_group)

    def _all_gather(self, gathered: torch.Tensor, payload: torch.Tensor) -> None:
        gather_into(gathered, payload, group=self.slice_group)

    # --- the three ways across replicas, for this process's slice ---

    def _stats_row(self, stats: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
        return stats.detach().to(torch.float32).reshape(-1).to(device or self.device)

    def _sum_fp32(self, chunk: torch.Tensor, stats):
        """One fp32 all-reduce; the stats travel as row `replica_index` of an M x k block of zeros. With nobody to
        reduce with, the sum stays on the chunk's own device."""
        m, n = self.num_replicas, chunk.numel()
        k = 0 if stats is None else stats.numel()
        device = self.device if self.active else chunk.device
        buffer = torch.empty(n + m * k, dtype=torch.float32, device=device)  # one buffer: no second copy
        buffer[:n] = chunk
        if stats is not None:
            buffer[n:].zero_()
            buffer[n:].view(m, k)[self.replica_index] = self._stats_row(stats, device)
        cost = SyncCost(buffer.numel() * 4, 0, 0, 0)
        if self.active:
            self._all_reduce(buffer)
            cost.bytes_sent = ring_all_reduce_bytes(buffer.numel() * 4, m)
            cost.collectives = 1
        return buffer[:n], None if stats is None else buffer[n:].view(m, -1), cost

    def _gather_payloads(self, payload: torch.Tensor, stats, cost: SyncCost) -> torch.Tensor:
        """All-gather one uint8 payload (plus this process's stats bytes) per replica: rows [M, bytes]."""
        if stats is not None:
            payload = torch.cat([payload, self._stats_row(stats).view(torch.uint8)])
        payload = payload.to(self.device)
        cost.payload_bytes += payload.numel()
        if not self.active:
            return payload.view(1, -1)
        gathered = torch.empty(self.num_replicas * payload.numel(), dtype=torch.uint8, device=self.device)
        self._all_gather(gathered, payload)
        cost.collectives += 1
        cost.bytes_sent += (self.num_replicas - 1) * payload.numel()  # ring: every other replica's share once
        return gathered.view(self.num_replicas, -1)

    def _stats_rows(self, gathered: torch.Tensor, body: int, stats):
        if stats is None:
            return None
        return from_bytes(gathered[:, body:].contiguous(), torch.float32).view(self.num_replicas, -1)

    def _in_frame(self, own: torch.Tensor, delta: torch.Tensor, layout: ShardLayout | None) -> torch.Tensor:
        """This process's decoded chunk (`sum_replicas`' `decoded`) laid out as `delta` is."""
        g = self.group_size
        if g == 1:
            return own[: delta.numel()].to(delta.device)
        if self.sharded:
            return (own if layout is None else layout.unpad(own, self.member)).to(delta.device)
        out = torch.zeros(delta.numel(), dtype=torch.float32, device=delta.device)
        if layout is not None:
            layout.place(own.to(delta.device), self.member, out)
        else:
            at = self.member * own.numel()
            held = max(0, min(own.numel(), delta.numel() - at))
            out[at : at + held] = own[:held]
        return out

    def _sum_dense(self, chunk, codec: Codec, feedback, key, stats, decoded=None):
        """Quantized reduce-scatter, fp32 sum, re-quantize the sum, all-gather."""
        m, n = self.num_replicas, chunk.numel()
        shard = -(-n // m)
        shard_bytes = codec.encoded_bytes(shard)
        x = chunk.to(torch.float32) if feedback is None else feedback.accumulate(key, chunk.to(torch.float32))
        parts = []
        own = None if decoded is None else torch.empty(m * shard, dtype=torch.float32)
        for j in range(m):  # shard j goes to replica j; the last one is padded with zeros
            piece = x[j * shard : (j + 1) * shard]
            padded = torch.cat([piece, piece.new_zeros(shard - piece.numel())]) if piece.numel() < shard else piece
            parts.append(codec.encode(padded.cpu()))
            if feedback is not None or own is not None:
                carried = codec.decode(parts[-1], shard)
                if own is not None:
                    own[j * shard : (j + 1) * shard] = carried
                if feedback is not None:  # x is the residual: what this shard failed to carry stays in it
                    piece.sub_(carried[: piece.numel()].to(piece.device))
                del carried  # a shard-sized copy (a whole bucket at M = 1): not held past its use
        if own is not None:
            decoded.append(own[:n])
        send = torch.cat(parts).to(self.device)
        del parts, x
        cost = SyncCost(send.numel(), 0, 0, 0)
        if self.active:
            received = torch.empty_like(send)
            self._all_to_all(received, send)
            cost.collectives += 1
            cost.bytes_sent += (m - 1) * shard_bytes  # every shard but this process's own leaves it
            del send
        else:
            received = send
        copies = received.cpu().view(m, shard_bytes)
        total = codec.decode(copies[0], shard)
        for r in range(1, m):  # fp32 sum in replica order
            total += codec.decode(copies[r], shard)
        del received, copies
        mine = codec.encode(total)
        gathered = self._gather_payloads(mine, stats, cost).cpu()
        summed = torch.empty(m * shard, dtype=torch.float32)
        for r in range(m):
            summed[r * shard : (r + 1) * shard] = codec.decode(gathered[r, :shard_bytes], shard)
        return summed[:n].to(self.device), self._stats_rows(gathered, shard_bytes, stats), cost

    def _sum_sparse(self, chunk, codec: SparseCodec, feedback, key, stats, decoded=None):
        """All-gather of every replica's sparse payload, summed in fp32 in replica order."""
        m, n = self.num_replicas, chunk.numel()
        body = codec.encoded_bytes(n)
        x = chunk.to(torch.float32) if feedback is None else feedback.accumulate(key, chunk.to(torch.float32))
        payload = codec.encode(x.cpu())
        if feedback is not None or decoded is not None:
            carried = codec.decode(payload, n)
            if decoded is not None:
                decoded.append(carried)
            if feedback is not None:
                x.sub_(carried.to(x.device))  # x is the residual: what was not sent stays
            del carried
        del x
        cost = SyncCost(0, 0, 0, 0)
        gathered = self._gather_payloads(payload, stats, cost).cpu()
        total = codec.decode(gathered[0, :body], n)
        for r in range(1, m):
            total += codec.decode(gathered[r, :body], n)
        return total.to(self.device), self._stats_rows(gathered, body, stats), cost
