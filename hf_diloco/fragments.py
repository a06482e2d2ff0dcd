"""A sync, fragment by fragment: each streaming fragment owns its share of θ_global and of the replica's
parameters, its buckets and their residuals, and the verbs of a sync; `outer_round` is the blocking sync, the loop
body of Algorithm 1 (hf_diloco.outer) one bucket at a time, and `exchange` then `land` the same lines in two halves.

Streaming DiLoCo (arXiv 2501.18512) syncs one fragment of the model at a time (with F = 1 the one fragment is the
whole model), and with an overlap of τ inner steps lands it τ steps after its exchange started (which then runs in
the background), where the copy back mixes θ_i ← α·θ_i + (1 − α)·θ_global. A fragment's verbs, per bucket:

    pseudo_gradient(b)    Δ_i ← θ_global − θ_i                     (taken at launch by a sync that overlaps)
    (the network)         Δ  ← Σ_i w_i Δ_i / Σ_i w_i               (`outer_round` or `exchange`: comm.ReplicaComm)
    outer_step(b, Δ)      θ_global ← OuterOpt(θ_global, Δ)
    copy_back(b, α)       θ_i ← α·θ_i + (1 − α)·θ_global           (α = 0: a plain copy, bit for bit)

A blocking sync runs them bucket after bucket (`outer_round`: one bucket's Δ_i and Δ held at a time); a sync that
overlaps inner steps, or waits for a vote, runs the first two for every bucket (`exchange`, in the background
thread of hf_diloco.engine for an overlapped one) and the last two once it lands (`land`), or never if the vote
rolled it back. These lines are the same for every sync of every backend.

Backends (hf_diloco.backends) change who takes part, not these lines: the mean is a weighted one, with w_i = 1 on a
fixed group (the plain mean, bit for bit) and torchft's token and staleness weights on a quorum; a replica whose
parameters are not finite takes part with w_i = 0. Every replica runs the identical outer step on the identical
averaged Δ, so after a landing with α = 0 all replicas hold bit-identical parameters in the synced buckets without a
broadcast.

What else a fragment keeps, for the engine and the schedule:

    in_flight    the step the sync carrying it was launched at, until that sync lands (at most one at a time)
    last_synced  the step of the last sync that carried it and landed
    covered      what its Δ_i covers: the inner steps, their Σ η and the examples they trained on since its base
                 moved, before the sync in flight;
    at_launch    the same with the sync launched last

The engine (hf_diloco.engine) tells every fragment when it launches a sync (`launched`) and when that sync is
decided (`decided`, or `call_off`); the schedule (hf_diloco.schedule) says which fragments a sync carries.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from .codecs import Codec, ErrorFeedback
from .comm import ReplicaComm, SyncCost
from .outer import OuterState, assign_fragments, is_finite


class Fragment:
    """One streaming fragment of a replica: its buckets (indices into OuterState.buckets, the keys it is synced
    under), for each the tensors of θ_global (`theta_global`, which the outer optimizer holds and this fragment
    steps) and of θ_i (`theta_i`, the replica's own parameters, or their local shards), the error-feedback residuals
    of its buckets (`feedback`, or None), and `size`, the values it syncs (of the whole model, when sharded).

    >>> replica = [torch.nn.Parameter(torch.tensor([1.0, 2.0]))]
    >>> outer = OuterState(replica, lr=1.0, momentum=0.0, nesterov=False)
    >>> fragment = Fragment(0, [0], outer)
    >>> with torch.no_grad():
    ...     _ = replica[0].sub_(torch.tensor([0.5, 0.5]))     # pretend the inner steps moved θ_i
    >>> delta = fragment.pseudo_gradient(0)                  # Δ_i = θ_global − θ_i
    >>> delta.tolist()
    [0.5, 0.5]
    >>> fragment.outer_step(0, delta)                        # lr 1, no momentum: θ_global ← θ_i
    >>> fragment.copy_back(0)
    >>> replica[0].tolist(), outer.global_params[0].tolist()
    ([0.5, 1.5], [0.5, 1.5])
    """

    def __init__(self, index: int, buckets: list[int], outer: OuterState, feedback: ErrorFeedback | None = None):
        self.index = index
        self.buckets = buckets
        self.theta_global = {b: [outer.global_params[i] for i in outer.buckets[b]] for b in buckets}
        self.theta_i = {b: [outer.params[i] for i in outer.buckets[b]] for b in buckets}
        self.size = sum(outer.full_numels[i] for b in buckets for i in outer.buckets[b])
        self.optimizer = outer.optimizer  # the one outer optimizer: a step moves the parameters given a gradient
        self.feedback = feedback
        self.in_flight: int | None = None
        self.last_synced: int | None = None
        self.covered: tuple[float, float, float] = (0, 0.0, 0)
        self.at_launch: tuple[float, float, float] = (0, 0.0, 0)

    def __repr__(self) -> str:
        return (f"Fragment({self.index}, buckets={self.buckets}, size={self.size}, in_flight={self.in_flight}, "
                f"last_synced={self.last_synced})")

    # --- the verbs of a sync, one bucket at a time ---

    def numel(self, bucket: int) -> int:
        """The values this process syncs of `bucket` (its shards, or every parameter)."""
        return sum(p.numel() for p in self.theta_i[bucket])

    @torch.no_grad()
    def pseudo_gradient(self, bucket: int, device: torch.device | None = None) -> torch.Tensor:
        """Δ_i = θ_global − θ_i for one of its buckets, flat fp32 on `device` (the communication device)."""
        device = device or torch.device("cpu")
        out = torch.empty(self.numel(bucket), dtype=torch.float32, device=device)
        offset = 0
        for param, global_param in zip(self.theta_i[bucket], self.theta_global[bucket], strict=True):
            n = param.numel()  # written in place: no per-parameter temporaries beside the bucket
            torch.sub(global_param.reshape(-1).to(device), param.reshape(-1).to(device, torch.float32),
                      out=out[offset : offset + n])
            offset += n
        return out

    def pseudo_gradients(self, device: torch.device | None = None) -> list[torch.Tensor]:
        """Δ_i of each of its buckets, taken now (a sync that overlaps: before the replica trains on)."""
        return [self.pseudo_gradient(bucket, device) for bucket in self.buckets]

    @torch.no_grad()
    def outer_step(self, bucket: int, delta: torch.Tensor) -> None:
        """θ_global ← OuterOpt(θ_global, Δ) for the bucket's parameters only (the others have no gradient, which
        torch optimizers skip)."""
        offset = 0
        for target in self.theta_global[bucket]:
            n = target.numel()
            target.grad = delta[offset : offset + n].view_as(target).to(target.device)
            offset += n
        assert offset == delta.numel(), "pseudo-gradient bucket size does not match its parameters"
        self.optimizer.step()
        for target in self.theta_global[bucket]:
            target.grad = None

    @torch.no_grad()
    def copy_back(self, bucket: int, alpha: float = 0.0, since: list[torch.Tensor] | None = None) -> None:
        """θ_i ← α·θ_i + (1 − α)·θ_global for the bucket (α = 0: a plain copy, bit for bit); with `since` (the
        bucket's θ_i at an earlier step, `replica_copies`), θ_i ← θ_global + (θ_i − since): the replica's steps since
        then kept on top of θ_global. Every copy of θ_global into the replica is this one."""
        for k, (param, global_param) in enumerate(zip(self.theta_i[bucket], self.theta_global[bucket], strict=True)):
            if since is not None:
                param.copy_(global_param + (param.to(global_param.device, torch.float32) - since[k]))
            elif alpha == 0:
                param.copy_(global_param)
            else:
                param.copy_(alpha * param.to(global_param.device, torch.float32) + (1 - alpha) * global_param)

    def take_global(self) -> None:
        """θ_i ← θ_global for all of it (a replica that starts again, a resumed one, the run's final model)."""
        for bucket in self.buckets:
            self.copy_back(bucket)

    @torch.no_grad()
    def replica_copies(self) -> dict[int, list[torch.Tensor]]:
        """θ_i of its buckets now, fp32 copies beside θ_global, by bucket: what an eager landing keeps the steps
        since."""
        return {bucket: [p.detach().to(g.device, torch.float32, copy=True)
                         for p, g in zip(self.theta_i[bucket], self.theta_global[bucket], strict=True)]
                for bucket in self.buckets}

    # --- what the engine tells it ---

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
                              feedback: Callable[[], ErrorFeedback] | None = None,
                              **outer_settings) -> tuple[OuterState, list[Fragment]]:
    """θ_global and the outer optimizer (`outer_settings`: OuterState's) over the replica's trainable parameters,
    cut into buckets, and the streaming fragments over those buckets, each with its own residuals (`feedback`
    makes an empty ErrorFeedback; None: no error feedback). ValueError, naming the parameters, when a fragment
    would sync nothing."""
    assigned = assign_fragments([name for name, _ in named], num_fragments, pattern)
    outer = OuterState([p for _, p in named], fragments=assigned, **outer_settings)
    return outer, fragments_of(outer, feedback)


def fragments_of(outer: OuterState, feedback: Callable[[], ErrorFeedback] | None = None) -> list[Fragment]:
    """The fragments of `outer` (OuterState.fragment_buckets), each with its own residuals (`feedback` makes an
    empty ErrorFeedback; None: no error feedback)."""
    return [Fragment(f, buckets, outer, feedback() if feedback is not None else None)
            for f, buckets in enumerate(outer.fragment_buckets)]


def residuals_state(fragments: list[Fragment]) -> dict | None:
    """Every fragment's residuals as one error-feedback state (keys are bucket indices, unique across fragments),
    or None without error feedback: what a checkpoint keeps."""
    held = [f.feedback for f in fragments if f.feedback is not None]
    if not held:
        return None
    return {"decay": held[0].decay, "residuals": {k: v for feedback in held for k, v in feedback.residuals.items()}}


def load_residuals(fragments: list[Fragment], state: dict) -> None:
    """Put back what `residuals_state` kept, each bucket's residual with the fragment that owns the bucket."""
    for fragment in fragments:
        if fragment.feedback is not None:
            fragment.feedback.load_state_dict({"decay": state["decay"], "residuals": {
                key: value for key, value in state["residuals"].items() if int(key) in fragment.buckets}})


# --- one sync ----------------------------------------------------------------------------------------------------


@dataclass
class SyncResult:
    """What a sync measured beside the math: who took part and with what weight, norms, agreement, statistics,
    cost, and whether the sync landed."""

    weights: list[float] | None = None  # per replica: its weight in the average (0: it sat the sync out)
    local_norm_sq: float = 0.0  # ‖Δ_i‖² of this replica's pseudo-gradient over the sync's buckets
    average_norm_sq: float = 0.0  # ‖Δ‖²
    dot: float = 0.0  # Δ_i · Δ, for the agreement cos(Δ_i, Δ)
    unsent_norm_sq: float = 0.0  # a replica of weight 0: ‖Δ_i‖² and Δ_i · Δ of what it did not send (its checks)
    unsent_dot: float = 0.0
    # With a codec and `exchange(decoded=True)`: ‖D_i‖² and D_i · Δ of what the others decoded of this replica's
    # contribution D_i (weighted, as sent); None without (fp32 sends Δ_i exactly)
    decoded_norm_sq: float | None = None
    decoded_dot: float | None = None
    stats: torch.Tensor | None = None  # [g, M, k] statistics of every process
    cost: SyncCost = field(default_factory=lambda: SyncCost(0, 0, 0, 0))
    fp32_bytes_sent: int = 0  # what an fp32 all-reduce of the same values would have sent
    committed: bool = True  # False: a backend that votes (torchft) rolled the sync back, or the sync was refused
    # Why the sync was refused, if it was (`refuse`): what arrived breaks a bound no honest replica breaks
    refused: list[str] = field(default_factory=list)

    def refuse(self, reason: str) -> None:
        """What arrived cannot be applied (a merge weight out of bounds, an average that is not finite): the outer
        step is skipped from this bucket on and the replicas keep their own parameters, as for a sync rolled back."""
        self.refused.append(reason)
        self.committed = False

    @property
    def healthy(self) -> list[bool] | None:
        return None if self.weights is None else [w > 0 for w in self.weights]

    @property
    def participants(self) -> int:
        return sum(w > 0 for w in self.weights) if self.weights is not None else 0

    @property
    def total_weight(self) -> float:
        return sum(self.weights) if self.weights is not None else 0.0

    def own_terms(self, weight: float, decoded: bool = False) -> tuple[float, float]:
        """(‖Δ_i‖², Δ_i · Δ) of this replica's own, unweighted pseudo-gradient, whatever weight it sent with; with
        `decoded` and a codec, of what the others decoded of it instead (D_i / w_i), which is what the average
        holds of it."""
        if weight > 0 and decoded and self.decoded_norm_sq is not None:
            return self.decoded_norm_sq / weight**2, self.decoded_dot / weight
        if weight > 0:
            return self.local_norm_sq / weight**2, self.dot / weight
        return self.unsent_norm_sq, self.unsent_dot

    def agreement(self, replica_index: int) -> float:
        """cos(Δ_i, Δ) of this replica's own Δ_i, whatever weight it sent with (a replica left out has one too)."""
        own_norm_sq, own_dot = self.own_terms(self.weights[replica_index]) if self.weights is not None else \
            (self.local_norm_sq, self.dot)
        scale = math.sqrt(own_norm_sq * self.average_norm_sq)
        return own_dot / scale if scale > 0 else float("nan")

    def sum_over_members(self, comm: ReplicaComm) -> None:
        """A replica of several processes: its norms and dot products as sums over its members' parts (sharded:
        every term is a shard's; otherwise only the decoded terms are per member: each member decodes its own
        slice). One all-reduce of a few numbers inside the replica."""
        names = ["local_norm_sq", "average_norm_sq", "dot", "unsent_norm_sq", "unsent_dot"] if comm.sharded else []
        if self.decoded_norm_sq is not None and comm.group_size > 1:
            names += ["decoded_norm_sq", "decoded_dot"]
        if names:
            for name, value in zip(names, comm.control.members_total([getattr(self, n) for n in names]), strict=True):
                setattr(self, name, value)

    def count_extra(self, sent: int) -> None:
        """Bytes the sync sent beside its exchange (membership, check tables); an fp32 sync sends the same tables,
        so they count in both and a codec's ratio stays its own."""
        self.cost.bytes_sent += sent
        self.fp32_bytes_sent += sent

    def add_cost(self, cost: SyncCost, fp32_bytes: int) -> None:
        self.cost.payload_bytes += cost.payload_bytes
        self.cost.bytes_sent += cost.bytes_sent
        self.cost.intra_replica_bytes += cost.intra_replica_bytes
        self.cost.collectives += cost.collectives
        self.fp32_bytes_sent += fp32_bytes


@dataclass
class Exchange:
    """The first half of a sync: every bucket's averaged Δ with the fragment it belongs to, waiting to be applied
    (`land`). `weight` is the weight this replica sent with (0: it sat the sync out, and takes θ_global as it is)."""

    averaged: list[tuple[Fragment, int, torch.Tensor]]
    result: SyncResult
    weight: float = 1.0


# Statistics that ride along with a sync's last collective, made once ‖Δ_i‖² of the whole sync is known. Slot 0
# is reserved for this replica's weight, which the sync fills in; the first bucket carries the weight alone when
# the sync has several, so every process knows every weight before it divides the first sum.
StatsFn = Callable[[float], torch.Tensor]


def sync_device(outer: OuterState, comm: ReplicaComm, codec: Codec | None) -> torch.device:
    """Where a sync forms and averages Δ_i: the communication device (the accelerator for NCCL, the host for gloo),
    except for a replica with nobody to reduce with and no codec, which keeps the whole sync on its model's device:
    a lone GPU replica sends nothing through the host but what its offloaded outer step needs."""
    if comm.active or comm.group_size > 1 or (codec is not None and codec.name != "none"):
        return comm.device
    return outer.params[0].device


def _riding(position: int, count: int, weight: float, stats: StatsFn | None) -> StatsFn | None:
    if position == count - 1 and stats is not None:
        def full(norm_sq: float) -> torch.Tensor:
            values = stats(norm_sq).clone()
            values[0] = weight
            return values

        return full
    if position == 0:
        return lambda _norm_sq: torch.tensor([weight], dtype=torch.float64)
    return None


def _counted_dot(comm: ReplicaComm, index: int, a: torch.Tensor, b: torch.Tensor) -> float:
    """a · b over what this process counts of bucket `index`: everything, except that with tensor parallel the
    values several processes of the replica hold alike count on one of them only (comm.repeated_spans), so that the
    replica's sum over its members (Control.shards_total) counts them once."""
    def dot(x: torch.Tensor, y: torch.Tensor) -> float:
        return float(torch.linalg.vector_norm(x)) ** 2 if x is y else float(torch.dot(x, y))

    total = dot(a, b)
    if comm.sharded and comm.repeated_spans:
        for at, n in comm.repeated_spans.get(str(index), ()):
            piece = a[at : at + n]
            total -= dot(piece, piece if b is a else b[at : at + n])
    return total


def _average_bucket(comm: ReplicaComm, index: int, delta_i: torch.Tensor, result: SyncResult, weight: float,
                    codec: Codec | None, feedback: ErrorFeedback | None, riding: StatsFn | None,
                    decoded: bool = False) -> torch.Tensor:
    """Δ for one bucket: Σ_i w_i Δ_i / Σ_i w_i over the replicas, with this bucket's norms, agreement terms and
    cost added to `result`. A replica of weight 0 sends zeros and leaves its residual alone; a weight of exactly 1
    sends Δ_i untouched, so equal weights give the plain mean bit for bit. `decoded`: with a codec, also the terms
    of what the others decode of this replica's contribution."""
    if weight == 1:
        sent = delta_i
    elif weight > 0:
        sent = delta_i.mul(weight)
    else:
        sent = torch.zeros_like(delta_i)
    # Reductions straight over the bucket (no temporary copies of it): the metrics cost no memory.
    result.local_norm_sq += _counted_dot(comm, index, sent, sent)
    values = None if riding is None else riding(result.local_norm_sq)
    carried: list[torch.Tensor] | None = [] if decoded and weight > 0 and codec is not None else None
    total, rows, cost = comm.sum_replicas(sent, codec=codec, feedback=feedback if weight > 0 else None,
                                          key=str(index), stats=values, decoded=carried)
    if rows is not None:
        if result.weights is None:
            result.weights = bounded_weights(rows[0, :, 0].tolist(), result)
        if rows.shape[-1] > 1:
            result.stats = rows
    total_weight = result.total_weight
    delta = total.div_(total_weight) if total_weight > 0 else total.zero_()
    average_norm_sq = _counted_dot(comm, index, delta, delta)  # (NaN or infinite exactly when the average is not)
    result.average_norm_sq += average_norm_sq
    result.dot += _counted_dot(comm, index, sent, delta)
    # Every replica sees the same sum, so all refuse alike; a sharded replica's members agree on their shards.
    if result.committed and not comm.control.members_all(math.isfinite(average_norm_sq)):
        result.refuse(f"the average of bucket {index} is not finite, though every replica reported finite values: "
                      f"a replica sent what its report did not show")
    if carried:
        result.decoded_norm_sq = (result.decoded_norm_sq or 0.0) + _counted_dot(comm, index, carried[0], carried[0])
        result.decoded_dot = (result.decoded_dot or 0.0) + _counted_dot(comm, index, carried[0], delta)
        del carried
    if weight <= 0:
        result.unsent_norm_sq += _counted_dot(comm, index, delta_i, delta_i)
        result.unsent_dot += _counted_dot(comm, index, delta_i, delta)
    result.add_cost(cost, comm.fp32_bytes_sent(delta_i.numel(), with_stats=0 if values is None else values.numel()))
    return delta


def bounded_weights(reported: list[float], result: SyncResult) -> list[float]:
    """Each replica's merge weight as it reported it, if every one is what an honest replica sends (from 0 to 1: a
    weight is relative to the largest); otherwise the sync is refused, naming who sent what, since the sum the
    weights divide already holds their contributions (a weight of 1e9, or a negative one leaving a tiny total,
    would make Δ anything). Weights out of bounds count as 0."""
    honest = [0.0 <= w <= 1.0 + 1e-6 for w in reported]  # (NaN fails both comparisons)
    if not all(honest):
        result.refuse("merge weight out of bounds (0 to 1) from " + ", ".join(
            f"replica {r} ({w:g})" for r, (w, ok) in enumerate(zip(reported, honest, strict=True)) if not ok))
    return [w if ok else 0.0 for w, ok in zip(reported, honest, strict=True)]


def outer_round(fragments: list[Fragment], comm: ReplicaComm, *, codec: Codec | None = None,
                stats: StatsFn | None = None, weight: float = 1.0, alpha: float = 0.0, decoded: bool = False,
                finite: bool | None = None, deltas: list[torch.Tensor] | None = None,
                device: torch.device | None = None) -> SyncResult:
    """One blocking sync of `fragments` (all of them: the paper's outer round; or the due ones), the loop body of
    Algorithm 1 one bucket at a time, through each fragment's verbs: the path of every sync that does not overlap
    inner steps.

    `weight` is this replica's share in the average (1 on the torch backend; torchft's token and staleness
    weights, relative to the largest). A replica whose parameters hold a NaN or an infinity (`finite` False, or
    found so here) sits the sync out (weight 0: it sends zeros, the others divide by the weight that took part) and
    takes θ_global; with no weight at all θ_global does not move. Each bucket's Δ_i is formed, averaged (the
    network), stepped and copied back before the next is formed (bounded memory: one bucket's Δ_i and Δ held). On a
    backend that votes on each sync (`comm.votes`: torchft) every averaged bucket is held until the vote and applied
    only if the sync commits (`exchange`, then `land`), as is a healed replica's `deltas` (its Δ_i taken against
    the base it left, one per bucket in order). Δ_i is formed on `device` (the communication device by default:
    `sync_device`). Every process must call this with the same fragments.
    """
    carried = [(fragment, bucket) for fragment in fragments for bucket in fragment.buckets]
    device = device or comm.device
    if finite is None and deltas is None:
        finite = comm.control.members_all(is_finite(p for fragment, b in carried for p in fragment.theta_i[b]))
    if deltas is not None or comm.votes:
        formed = deltas if deltas is not None else (fragment.pseudo_gradient(b, device) for fragment, b in carried)
        return land(exchange(comm, fragments, formed, codec=codec, stats=stats, weight=weight, finite=finite,
                             decoded=decoded), alpha)
    weight = weight if finite else 0.0
    keep = alpha if weight > 0 else 0.0  # a replica that sat the sync out takes θ_global as it is
    result = SyncResult()
    for position, (fragment, index) in enumerate(carried):
        delta_i = fragment.pseudo_gradient(index, device)                            # Δ_i ← θ_global − θ_i
        riding = _riding(position, len(carried), weight, stats)
        delta = _average_bucket(comm, index, delta_i, result, weight, codec, fragment.feedback, riding,
                                decoded)                                             # Δ ← Σ w_i Δ_i / Σ w_i
        del delta_i
        if result.committed:  # (refused: this bucket and those after it keep θ_global and θ_i as they are)
            if result.participants:
                fragment.outer_step(index, delta)                                    # θ_global ← OuterOpt(θ_global, Δ)
            fragment.copy_back(index, keep)                                          # θ_i ← α·θ_i + (1 − α)·θ_global
        del delta  # freed before the next bucket's Δ_i is formed
    return result


def norm(comm: ReplicaComm, buckets: list[int], deltas: Iterable[torch.Tensor]) -> float:
    """‖Δ_i‖ of this replica over `buckets` (a sharded replica's members add their shards' squares)."""
    total = sum(_counted_dot(comm, index, delta, delta) for index, delta in zip(buckets, deltas, strict=True))
    if comm.sharded:
        total = comm.control.shards_total([total])[0]
    return math.sqrt(total) if total >= 0 else float("nan")


def exchange(comm: ReplicaComm, fragments: list[Fragment], deltas: Iterable[torch.Tensor], *,
             codec: Codec | None = None, stats: StatsFn | None = None, weight: float = 1.0,
             finite: bool | None = None, decoded: bool = False) -> Exchange:
    """The communication half of a sync that overlaps inner steps or waits for a vote: Δ = Σ_i w_i Δ_i / Σ_i w_i for
    each bucket of `fragments`, every one held until `land` applies it, then (torchft) the vote.

    `deltas`: each bucket's Δ_i in order, taken at launch (an overlapped sync: the replica trains on while they are
    sent, in a background thread), or formed as the exchange reaches each (a voted blocking sync). `finite` says
    whether this replica's values are finite; without it the deltas are checked here. `decoded`: with a codec,
    also measure what the others decode of this replica's contribution (SyncResult.decoded_*). On a backend that
    votes, the result says whether the sync committed; a sync that did not is never applied, whatever part of it
    arrived. Touches neither θ_global nor the replica's parameters.
    """
    carried = [(fragment, bucket) for fragment in fragments for bucket in fragment.buckets]
    result = SyncResult()
    if finite is None:
        deltas = list(deltas)
        finite = comm.control.members_all(is_finite(deltas))
    if not finite:
        weight = 0.0
    # A sync that may be rolled back must not leave its trace in the residuals: the replica sends the same
    # progress again in its next sync.
    kept = [(f.feedback, f.feedback.copy([str(b) for b in f.buckets])) for f in fragments
            if f.feedback is not None] if comm.votes else []
    averaged = [(fragment, index, _average_bucket(comm, index, delta_i, result, weight, codec, fragment.feedback,
                                                  _riding(position, len(carried), weight, stats), decoded))
                for position, ((fragment, index), delta_i) in enumerate(zip(carried, deltas, strict=True))]
    if comm.votes:
        result.committed = comm.vote() and not result.refused
        if not result.committed:
            for feedback, copies in kept:
                feedback.restore(copies)
    return Exchange(averaged, result, weight)


def land(landed: Exchange, alpha: float = 0.0, launched: dict[int, list[torch.Tensor]] | None = None) -> SyncResult:
    """The second half of a sync, if it committed: for each bucket, through its fragment, θ_global ←
    OuterOpt(θ_global, Δ), then θ_i ← α·θ_i + (1 − α)·θ_global, or with `launched` (an eager landing: each bucket's
    θ_i at the sync's launch, Fragment.replica_copies) θ_i ← θ_global + (θ_i − θ_i at launch), the steps taken while
    it was in flight kept (a replica that sat the sync out, weight 0, takes θ_global as it is): the same two lines
    as `outer_round`'s, for an overlapped sync (τ steps after its launch) and a voted one (torchft). A sync that did
    not commit leaves θ_global and θ_i as they are: the replica keeps its progress for the next sync."""
    result = landed.result
    if not result.committed:
        return result
    keep, launched = (alpha, launched or {}) if landed.weight > 0 else (0.0, {})
    for fragment, index, delta in landed.averaged:
        if result.participants:
            fragment.outer_step(index, delta)                                 # θ_global ← OuterOpt(θ_global, Δ)
        fragment.copy_back(index, keep, launched.get(index))                  # θ_i ← α·θ_i + (1 − α)·θ_global
    return result
