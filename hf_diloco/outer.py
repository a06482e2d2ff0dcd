"""The DiLoCo outer step (Douillard et al., arXiv 2311.08105, Algorithm 1), one bucket at a time.

    θ_global  parameters every replica agreed on at the start of the round (fp32)
    for each round:
        each replica i:  θ_i ← InnerOpt^H(θ_i)             (H local steps, no communication; done by Trainer)
        each replica i:  Δ_i ← θ_global − θ_i               (pseudo-gradient)
        all replicas:    Δ  ← (1/M) Σ_i Δ_i                 (the round's only communication; comm.ReplicaComm)
        all replicas:    θ_global ← OuterOpt(θ_global, Δ)   (SGD, lr 0.7, momentum 0.9, Nesterov by default)
        each replica i:  θ_i ← θ_global                     (inner optimizer state is kept)

A blocking sync is that loop body as written, one bucket at a time: `outer_round`, the production path of every sync
that does not overlap inner steps (Δ_i, its codec and the average run there, in the open, then the outer step and
the copy back). A sync that overlaps inner steps, or waits for a vote, runs it in two halves: `exchange` (the first
three lines, every bucket's average held) and later `land` (the last two).
Streaming DiLoCo (arXiv 2501.18512) syncs one fragment of the model at a time, and with an overlap of τ
inner steps lands it τ steps after the exchange started (which then runs in the background), where the copy back
mixes θ_i ← α·θ_i + (1 − α)·θ_global. hf_diloco.engine decides when each half runs; these lines are the same for
every sync of every backend.

Backends (hf_diloco.backends) change who takes part, not these lines: the mean is a weighted one,
Δ = Σ_i w_i Δ_i / Σ_i w_i, with w_i = 1 on a fixed group (the plain mean, bit for bit) and torchft's token and
staleness weights on a quorum; a replica whose parameters are not finite takes part with w_i = 0. A backend that
votes on each sync (torchft) applies a sync only if it commits.

Design choices:
- θ_global and the outer optimizer state are fp32 whatever the model's dtype, on CPU by default (`offload`; pinned
  host memory under a CUDA model), so the outer loop costs no accelerator memory.
- Bounded memory: the parameters are cut into buckets of at most `bucket_numel` values, and a blocking sync forms,
  sends, receives and applies one bucket before it starts the next. The extra memory of a sync is the bucket's
  Δ_i, its average Δ and the codec's payloads, whatever the model's size. (A sync that waits for a vote, or runs
  in the background, holds every bucket's average until it is applied.)
- The outer optimizer is one stock torch optimizer over θ_global; a bucket's step sets the gradients of its
  parameters only, and torch optimizers skip parameters without a gradient, so stepping bucket by bucket is the
  same arithmetic as one step over all of them. torch's Nesterov SGD computes v ← μ v + Δ; θ ← θ − lr (Δ + μ v),
  the formulation DiLoCo uses.
- Every replica runs the identical outer step on the identical averaged Δ, so after `land` (with α = 0) all
  replicas hold bit-identical parameters in the synced buckets without a broadcast.
- Only the parameters handed in are synced: for a PEFT model these are the trainable adapter weights.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from .codecs import Codec, ErrorFeedback
from .comm import ReplicaComm, SyncCost


def local_shard(param: torch.Tensor) -> torch.Tensor:
    """This process's part of `param`: the local shard of a DTensor (FSDP2), sharing its storage, else `param`."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        with torch.no_grad():
            return param.to_local()
    return param


class DelayedNesterov(torch.optim.Optimizer):
    """Outer Nesterov SGD whose momentum moves only every `delay` steps of a parameter (after Asynchronous Local-SGD's
    delayed Nesterov, arXiv 2401.09135: with replicas of unequal speed, momentum built from every single merge
    amplifies the noise of small or stale contributions; here it is built from the mean of `delay` of them).

    Per parameter θ, with lr η, momentum β, delay N and gradient scale c, each step with gradient g:

        θ ← θ − η·c·g                          (every step: the pseudo-gradient itself)
        a ← a + g;  k ← k + 1
        if k = N:   m ← β·m + a/N;  θ ← θ − η·β·m;  a ← 0;  k ← 0      (every N-th step: the momentum)

    With N = 1 and c = 1 this is torch's Nesterov SGD (m ← β·m + g; θ ← θ − η·(g + β·m)), to rounding.

    >>> theta = nn.Parameter(torch.zeros(1))
    >>> opt = DelayedNesterov([theta], lr=1.0, momentum=0.5, delay=2)
    >>> for g in (1.0, 3.0):
    ...     theta.grad = torch.tensor([g])
    ...     opt.step()
    >>> theta.item()    # −1 − 3, then m = 0.5·0 + (1 + 3)/2 = 2 and −0.5·2 = −1
    -5.0
    """

    def __init__(self, params, lr: float, momentum: float, delay: int, scale: float = 1.0):
        super().__init__(params, {"lr": lr, "momentum": momentum, "delay": delay, "scale": scale})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, beta, delay, scale = group["lr"], group["momentum"], group["delay"], group["scale"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(param)
                    state["accumulated"] = torch.zeros_like(param)
                    state["count"] = 0
                grad = param.grad
                param.add_(grad, alpha=-lr * scale)
                state["accumulated"].add_(grad)
                state["count"] += 1
                if state["count"] >= delay:
                    state["momentum_buffer"].mul_(beta).add_(state["accumulated"], alpha=1.0 / delay)
                    param.add_(state["momentum_buffer"], alpha=-lr * beta)
                    state["accumulated"].zero_()
                    state["count"] = 0


def build_outer_optimizer(
    params: list[nn.Parameter], name: str, lr: float, momentum: float, nesterov: bool, momentum_delay: int = 1,
    delayed_scale: float = 1.0,
) -> torch.optim.Optimizer:
    """The outer optimizer over θ_global: the paper's Nesterov SGD (its momentum moved every `momentum_delay`
    steps when above 1: DelayedNesterov), or AdamW (beta1 = momentum) for ablations."""
    if name == "sgd" and momentum_delay > 1:
        return DelayedNesterov(params, lr=lr, momentum=momentum, delay=momentum_delay, scale=delayed_scale)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=nesterov and momentum > 0)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=(momentum, 0.999), weight_decay=0.0)
    raise ValueError(f"unknown outer optimizer {name!r}")


def partition_into_buckets(numels: list[int], bucket_numel: int) -> list[list[int]]:
    """Group consecutive parameter indices so that each group holds at most `bucket_numel` values.

    A parameter larger than the limit gets a bucket of its own.

    >>> partition_into_buckets([3, 3, 5, 1], bucket_numel=6)
    [[0, 1], [2, 3]]
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for index, numel in enumerate(numels):
        if current and size + numel > bucket_numel:
            buckets.append(current)
            current, size = [], 0
        current.append(index)
        size += numel
    if current:
        buckets.append(current)
    return buckets


def layer_of(name: str) -> int | None:
    """The transformer layer a parameter belongs to: the first number in its dotted name, None for embeddings,
    final norms and heads.

    >>> layer_of("model.layers.3.mlp.up_proj.weight"), layer_of("model.embed_tokens.weight")
    (3, None)
    """
    found = re.search(r"\.(\d+)\.", f".{name}.")
    return int(found.group(1)) if found else None


def assign_fragments(names: list[str], num_fragments: int, pattern: str = "strided") -> list[list[int]]:
    """Parameter indices of each streaming fragment; every fragment holds at least one parameter.

    One fragment: everything. F > 1: fragment 0 holds the parameters outside the layers (embeddings, final norm,
    head) and the layers are spread over fragments 1..F−1; where every parameter is in a layer (a LoRA model's
    adapters, a model whose modules are `layers.0`, `layers.1`, ...) the layers are spread over all F fragments, so
    that no sync exchanges nothing. Layers go strided (the l-th layer to l mod the fragments that hold layers: the
    paper's better choice) or sequential (contiguous runs of layers, as even as they divide).

    >>> names = ["embed.weight", "layers.0.w", "layers.1.w", "layers.2.w", "layers.3.w", "norm.weight"]
    >>> assign_fragments(names, 3), assign_fragments(names, 3, "sequential")
    ([[0, 5], [1, 3], [2, 4]], [[0, 5], [1, 2], [3, 4]])
    >>> assign_fragments(names[1:5], 2)                      # nothing outside the layers: all fragments hold layers
    [[0, 2], [1, 3]]
    """
    if num_fragments == 1:
        return [list(range(len(names)))]
    layer = [layer_of(name) for name in names]
    layers = sorted({number for number in layer if number is not None})
    first = 1 if None in layer else 0  # the first fragment that holds layers
    groups = num_fragments - first
    if len(layers) < groups:
        inside = [name for name, number in zip(names, layer, strict=True) if number is not None]
        shown = ", ".join(inside[:4]) + (", ..." if len(inside) > 4 else "") if inside else "none"
        outside = f"besides the fragment of the {layer.count(None)} parameter(s) outside the layers " if first else ""
        raise ValueError(
            f"num_fragments={num_fragments} needs at least {groups} layers {outside}so that every fragment syncs "
            f"something, but the model's trainable parameters span {len(layers)} layer(s) (in layers: {shown}); "
            f"use at most {len(layers) + first} fragments."
        )
    position = {number: rank for rank, number in enumerate(layers)}

    def fragment(number: int | None) -> int:
        if number is None:
            return 0
        rank = position[number]
        return first + (rank % groups if pattern == "strided" else rank * groups // len(layers))

    fragments: list[list[int]] = [[] for _ in range(num_fragments)]
    for index, number in enumerate(layer):
        fragments[fragment(number)].append(index)
    return fragments


class OuterState:
    """θ_global and the outer optimizer (the outer state), cut into buckets; the per-bucket steps of a sync.

    >>> replica = [nn.Parameter(torch.tensor([1.0, 2.0]))]
    >>> outer = OuterState(replica, lr=1.0, momentum=0.0, nesterov=False)
    >>> with torch.no_grad():
    ...     _ = replica[0].sub_(torch.tensor([0.5, 0.5]))     # pretend the inner steps moved θ_i
    >>> bucket = outer.buckets[0]
    >>> delta = outer.pseudo_gradient(bucket)               # Δ_i = θ_global − θ_i
    >>> delta.tolist()
    [0.5, 0.5]
    >>> outer.step(bucket, delta)                            # lr 1, no momentum: θ_global ← θ_i
    >>> outer.copy_to_replica(bucket)
    >>> replica[0].tolist()
    [0.5, 1.5]
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        *,
        lr: float,
        momentum: float,
        nesterov: bool,
        optimizer: str = "sgd",
        offload: bool = True,
        bucket_numel: int = 64 * 2**20,
        fragments: list[list[int]] | None = None,
        momentum_delay: int = 1,
        delayed_scale: float = 1.0,
    ):
        params = list(params)
        if not params:
            raise ValueError("the model has no trainable parameters to synchronise")
        # A sharded replica (FSDP2) hands in DTensor parameters: this process syncs and keeps its own shard of
        # each, so θ_global and the outer optimizer state cost it 1/g of the model. Buckets are cut by the full
        # sizes, so every member of a replica cuts the same buckets and sends its statistics at the same ones.
        self.full_numels = [p.numel() for p in params]
        self.full_shapes = [p.shape for p in params]
        self.params = [local_shard(p) for p in params]
        self.laid_out = params  # as handed in: DTensors (FSDP2, tensor parallel) say how they are laid out
        state_device = torch.device("cpu") if offload else self.params[0].device
        # Offloaded from a CUDA model, θ_global sits in pinned (page-locked) host memory, which CUDA copies to and
        # from without staging it through a buffer of its own.
        pin = offload and self.params[0].is_cuda
        held = [p.detach().to(device=state_device, dtype=torch.float32, copy=True) for p in self.params]
        self.global_params = [nn.Parameter(h.pin_memory() if pin else h) for h in held]
        self.optimizer = build_outer_optimizer(self.global_params, optimizer, lr, momentum, nesterov,
                                               momentum_delay, delayed_scale)
        # Buckets never straddle fragments: fragment f syncs buckets fragment_buckets[f].
        fragments = fragments or [list(range(len(self.params)))]
        self.buckets: list[list[int]] = []
        self.fragment_buckets: list[list[int]] = []
        for members in fragments:
            first = len(self.buckets)
            for group in partition_into_buckets([self.full_numels[i] for i in members], bucket_numel):
                self.buckets.append([members[j] for j in group])
            self.fragment_buckets.append(list(range(first, len(self.buckets))))

    @property
    def numel(self) -> int:
        """Number of synced values (trainable parameters; with a sharded replica, of the whole model)."""
        return sum(self.full_numels)

    def bucket_shapes(self) -> dict[str, list[torch.Size]]:
        """The full shapes of each bucket's parameters, by the key the bucket is synced under."""
        return {str(index): [self.full_shapes[i] for i in bucket] for index, bucket in enumerate(self.buckets)}

    def repeated_spans(self, tp_rank: int) -> dict[str, list[tuple[int, int]]]:
        """(offset, length) in each bucket's flat local values of the parameters whose values another process of
        the replica holds too and counts instead of this one, by the key the bucket is synced under; buckets
        with none are left out. With tensor parallel (this process is `tp_rank` of its piece-set), a value laid out
        on no `tp` mesh dimension (the norms and a tied embedding, whole or sharded by FSDP2 alone) is held alike
        by every process of the piece-set and counts on tp_rank 0; a value replicated along a mesh dimension
        counts on the process at coordinate 0 of it."""
        from torch.distributed.tensor import DTensor

        def counted_here(param) -> bool:
            if not isinstance(param, DTensor):
                return tp_rank == 0
            mesh = param.device_mesh
            if "tp" not in (mesh.mesh_dim_names or ()) and tp_rank != 0:
                return False
            return all(mesh.get_local_rank(dim) == 0 for dim, p in enumerate(param.placements) if p.is_replicate())

        spans = {}
        for index, bucket in enumerate(self.buckets):
            offset, repeated = 0, []
            for i in bucket:
                n = self.params[i].numel()
                if not counted_here(self.laid_out[i]):
                    repeated.append((offset, n))
                offset += n
            if repeated:
                spans[str(index)] = repeated
        return spans

    @property
    def local_numel(self) -> int:
        """Number of values this process syncs (its shards, or every parameter)."""
        return sum(p.numel() for p in self.params)

    def bucket_numel(self, bucket: list[int]) -> int:
        return sum(self.params[i].numel() for i in bucket)

    @torch.no_grad()
    def pseudo_gradient(self, bucket: list[int], device: torch.device | None = None) -> torch.Tensor:
        """Δ_i = θ_global − θ_i for one bucket, flat fp32 on `device` (the communication device)."""
        device = device or torch.device("cpu")
        out = torch.empty(self.bucket_numel(bucket), dtype=torch.float32, device=device)
        offset = 0
        for i in bucket:  # written in place: no per-parameter temporaries beside the bucket
            n = self.params[i].numel()
            global_param = self.global_params[i].reshape(-1).to(device)
            torch.sub(global_param, self.params[i].reshape(-1).to(device, torch.float32), out=out[offset : offset + n])
            offset += n
        return out

    @torch.no_grad()
    def step(self, bucket: list[int], delta: torch.Tensor) -> None:
        """θ_global ← OuterOpt(θ_global, Δ) for the bucket's parameters only."""
        offset = 0
        for i in bucket:
            target = self.global_params[i]
            n = target.numel()
            target.grad = delta[offset : offset + n].view_as(target).to(target.device)
            offset += n
        assert offset == delta.numel(), "pseudo-gradient bucket size does not match its parameters"
        self.optimizer.step()
        for i in bucket:
            self.global_params[i].grad = None

    @torch.no_grad()
    def copy_to_replica(self, bucket: list[int], alpha: float = 0.0, since: list[torch.Tensor] | None = None) -> None:
        """θ_i ← α·θ_i + (1 − α)·θ_global for the bucket (α = 0: a plain copy, bit for bit); with `since` (the
        bucket's θ_i at an earlier step, `replica_copy`), θ_i ← θ_global + (θ_i − since): the replica's steps since
        then kept on top of θ_global."""
        for k, i in enumerate(bucket):
            param, global_param = self.params[i], self.global_params[i]
            if since is not None:
                param.copy_(global_param + (param.to(global_param.device, torch.float32) - since[k]))
            elif alpha == 0:
                param.copy_(global_param)
            else:
                param.copy_(alpha * param.to(global_param.device, torch.float32) + (1 - alpha) * global_param)

    @torch.no_grad()
    def replica_copy(self, bucket: list[int]) -> list[torch.Tensor]:
        """θ_i of the bucket's parameters now: fp32 copies beside θ_global (on its device)."""
        return [self.params[i].detach().to(self.global_params[i].device, torch.float32, copy=True) for i in bucket]

    def copy_global_to_replica(self) -> None:
        for bucket in self.buckets:
            self.copy_to_replica(bucket)

    @torch.no_grad()
    def take_replica(self) -> None:
        """θ_global ← θ_i (fp32), as at construction: after the replicas' start was made identical."""
        for param, global_param in zip(self.params, self.global_params, strict=True):
            global_param.copy_(param)

    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def state_dict(self) -> dict:
        return {
            "global_params": [p.detach().cpu() for p in self.global_params],
            "optimizer": self.optimizer.state_dict(),
        }

    def mismatch(self, state: object) -> str | None:
        """Why `state` cannot be this outer step's state (a clause), or None: it must hold `global_params` with a
        tensor of this replica's shape and dtype per trainable parameter, and an `optimizer` state of the same
        parameter groups whose tensors fit their parameters; every tensor and number in it finite. Nothing is
        broadcast or converted: a checkpoint or a peer that disagrees in any of these is refused whole."""
        if not isinstance(state, dict) or not isinstance(state.get("global_params"), list | tuple) \
                or not isinstance(state.get("optimizer"), dict):
            return "it is not an outer state (global_params and optimizer)"
        saved, own = state["global_params"], self.global_params
        if len(saved) != len(own):
            return f"it holds {len(saved)} parameters where the model has {len(own)} trainable ones"
        for i, (value, target) in enumerate(zip(saved, own, strict=True)):
            if not isinstance(value, torch.Tensor):
                return f"parameter {i} is a {type(value).__name__}, not a tensor"
            if value.shape != target.shape or value.dtype != target.dtype:
                return (f"parameter {i} is {value.dtype} {tuple(value.shape)} where this replica's is "
                        f"{target.dtype} {tuple(target.shape)}")
            if not bool(torch.isfinite(value).all()):
                return f"parameter {i} holds NaN or infinite values"
        optimizer = state["optimizer"]
        groups, own_groups = optimizer.get("param_groups"), self.optimizer.state_dict()["param_groups"]
        if not isinstance(groups, list) or [g.get("params") if isinstance(g, dict) else None for g in groups] \
                != [g["params"] for g in own_groups]:
            return "its optimizer state has other parameter groups than this replica's"
        for group in groups:
            for key, value in group.items():
                if isinstance(value, float) and not math.isfinite(value):
                    return f"its optimizer setting {key} is {value}"
        entries = optimizer.get("state")
        if not isinstance(entries, dict) or not set(entries) <= set(range(len(own))):
            return "its optimizer state names parameters this replica does not have"
        for i, entry in entries.items():
            for key, value in (entry.items() if isinstance(entry, dict) else [("entry", entry)]):
                if isinstance(value, int | float) and not isinstance(value, bool):  # a count (delayed Nesterov)
                    if not math.isfinite(value):
                        return f"the optimizer's {key} of parameter {i} is {value}"
                    continue
                if not isinstance(value, torch.Tensor):
                    return f"the optimizer's {key} of parameter {i} is a {type(value).__name__}, not a tensor"
                if value.dim() > 0 and (value.shape != own[i].shape or value.dtype != own[i].dtype):
                    return (f"the optimizer's {key} of parameter {i} is {value.dtype} {tuple(value.shape)} where "
                            f"the parameter is {own[i].dtype} {tuple(own[i].shape)}")
                if not bool(torch.isfinite(value).all()):
                    return f"the optimizer's {key} of parameter {i} holds NaN or infinite values"
        return None

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Take a saved outer state, after `mismatch` found nothing wrong with it (else ValueError, naming what)."""
        wrong = self.mismatch(state)
        if wrong:
            raise ValueError(f"the outer state does not fit this model: {wrong}")
        for target, value in zip(self.global_params, state["global_params"], strict=True):
            target.copy_(value)
        self.optimizer.load_state_dict(state["optimizer"])


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
    """The first half of a sync: every bucket's averaged Δ, waiting to be applied (`land`). `weight` is the weight
    this replica sent with (0: it sat the sync out, and takes θ_global as it is)."""

    buckets: list[int]
    averaged: list[tuple[int, torch.Tensor]]
    result: SyncResult
    weight: float = 1.0


# Statistics that ride along with a sync's last collective, made once ‖Δ_i‖² of the whole sync is known. Slot 0
# is reserved for this replica's weight, which the sync fills in; the first bucket carries the weight alone when
# the sync has several, so every process knows every weight before it divides the first sum.
StatsFn = Callable[[float], torch.Tensor]


def is_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """True when no value is NaN or infinite: one boolean reduction per tensor, no copy of it, and one read of the
    answers per device (an accelerator is waited for once, not once per tensor)."""
    flags: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        flags.setdefault(t.device, []).append(torch.isfinite(t).all())
    return all(bool(torch.stack(found).all()) for found in flags.values())


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


def outer_round(outer: OuterState, comm: ReplicaComm, buckets: list[int], *, codec: Codec | None = None,
                feedback: ErrorFeedback | None = None, stats: StatsFn | None = None, weight: float = 1.0,
                alpha: float = 0.0, decoded: bool = False, finite: bool | None = None,
                deltas: list[torch.Tensor] | None = None, device: torch.device | None = None) -> SyncResult:
    """One blocking sync over `buckets` (all of them: the paper's outer round; or the due fragments'), the loop
    body of Algorithm 1 one bucket at a time: the path of every sync that does not overlap inner steps.

    `weight` is this replica's share in the average (1 on the torch backend; torchft's token and staleness
    weights, relative to the largest). A replica whose parameters hold a NaN or an infinity (`finite` False, or
    found so here) sits the sync out (weight 0: it sends zeros, the others divide by the weight that took part) and
    takes θ_global; with no weight at all θ_global does not move. Each bucket's Δ_i is formed, averaged (the
    network), stepped and copied back before the next is formed (bounded memory: one bucket's Δ_i and Δ held). On a
    backend that votes on each sync (`comm.votes`: torchft) every averaged bucket is held until the vote and applied
    only if the sync commits (`exchange`, then `land`), as is a healed replica's `deltas` (its Δ_i taken against
    the base it left). Δ_i is formed on `device` (the communication device by default: `sync_device`). Every
    process must call this with the same buckets.
    """
    if finite is None and deltas is None:
        finite = comm.control.members_all(is_finite(outer.params[i] for b in buckets for i in outer.buckets[b]))
    if deltas is not None or comm.votes:
        formed = deltas if deltas is not None else pseudo_gradients(outer, comm, buckets, device)
        return land(outer, exchange(comm, buckets, formed, codec=codec, feedback=feedback, stats=stats,
                                    weight=weight, finite=finite, decoded=decoded), alpha)
    weight = weight if finite else 0.0
    keep = alpha if weight > 0 else 0.0  # a replica that sat the sync out takes θ_global as it is
    result = SyncResult()
    for position, index in enumerate(buckets):
        bucket = outer.buckets[index]
        delta_i = outer.pseudo_gradient(bucket, device or comm.device)               # Δ_i ← θ_global − θ_i
        riding = _riding(position, len(buckets), weight, stats)
        delta = _average_bucket(comm, index, delta_i, result, weight, codec, feedback, riding, decoded)  # Δ (network)
        del delta_i
        if result.committed:  # (refused: this bucket and those after it keep θ_global and θ_i as they are)
            if result.participants:
                outer.step(bucket, delta)                                             # θ_global ← OuterOpt(θ_global, Δ)
            outer.copy_to_replica(bucket, keep)                                       # θ_i ← α·θ_i + (1 − α)·θ_global
        del delta  # freed before the next bucket's Δ_i is formed
    return result


def norm(comm: ReplicaComm, buckets: list[int], deltas: list[torch.Tensor] | Iterator[torch.Tensor]) -> float:
    """‖Δ_i‖ of this replica over `buckets` (a sharded replica's members add their shards' squares)."""
    total = sum(_counted_dot(comm, index, delta, delta) for index, delta in zip(buckets, deltas, strict=True))
    if comm.sharded:
        total = comm.control.shards_total([total])[0]
    return math.sqrt(total) if total >= 0 else float("nan")


def snapshot(outer: OuterState, comm: ReplicaComm, buckets: list[int],
             device: torch.device | None = None) -> list[torch.Tensor]:
    """Δ_i of `buckets` on `device` (the communication device by default), taken now (before the replica trains on
    while they are sent)."""
    return [outer.pseudo_gradient(outer.buckets[index], device or comm.device) for index in buckets]


def replica_copies(outer: OuterState, buckets: list[int]) -> dict[int, list[torch.Tensor]]:
    """θ_i of `buckets` now, by bucket (OuterState.replica_copy): what an eager landing keeps the steps since."""
    return {index: outer.replica_copy(outer.buckets[index]) for index in buckets}


def pseudo_gradients(outer: OuterState, comm: ReplicaComm, buckets: list[int],
                     device: torch.device | None = None) -> Iterator[torch.Tensor]:
    """Δ_i of `buckets` on `device` (the communication device by default), each formed when the exchange reaches it
    (a blocking sync holds one bucket's at a time)."""
    return (outer.pseudo_gradient(outer.buckets[index], device or comm.device) for index in buckets)


def exchange(comm: ReplicaComm, buckets: list[int], deltas: Iterable[torch.Tensor], *, codec: Codec | None = None,
             feedback: ErrorFeedback | None = None, stats: StatsFn | None = None, weight: float = 1.0,
             finite: bool | None = None, decoded: bool = False) -> Exchange:
    """The communication half of a sync that overlaps inner steps or waits for a vote: Δ = Σ_i w_i Δ_i / Σ_i w_i for
    each of `buckets`, every one held until `land` applies it, then (torchft) the vote.

    `deltas`: each bucket's Δ_i, taken at launch (an overlapped sync: the replica trains on while they are sent, in a
    background thread), or formed as the exchange reaches each (`pseudo_gradients`: a voted blocking sync).
    `finite` says whether this replica's values are finite; without it the deltas are checked here. `decoded`: with
    a codec, also measure what the others decode of this replica's contribution (SyncResult.decoded_*). On a backend
    that votes, the result says whether the sync committed; a sync that did not is never applied, whatever part of
    it arrived. Touches neither θ_global nor the replica's parameters.
    """
    result = SyncResult()
    if finite is None:
        deltas = list(deltas)
        finite = comm.control.members_all(is_finite(deltas))
    if not finite:
        weight = 0.0
    # A sync that may be rolled back must not leave its trace in the residuals: the replica sends the same
    # progress again in its next sync.
    kept = feedback.copy([str(i) for i in buckets]) if feedback is not None and comm.votes else None
    averaged = [(index, _average_bucket(comm, index, delta_i, result, weight, codec, feedback,
                                        _riding(position, len(buckets), weight, stats), decoded))
                for position, (index, delta_i) in enumerate(zip(buckets, deltas, strict=True))]
    if comm.votes:
        result.committed = comm.vote() and not result.refused
        if not result.committed and kept is not None:
            feedback.restore(kept)
    return Exchange(buckets, averaged, result, weight)


def land(outer: OuterState, landed: Exchange, alpha: float = 0.0,
         launched: dict[int, list[torch.Tensor]] | None = None) -> SyncResult:
    """The second half of a sync, if it committed: for each bucket, θ_global ← OuterOpt(θ_global, Δ), then
    θ_i ← α·θ_i + (1 − α)·θ_global, or with `launched` (an eager landing: each bucket's θ_i at the sync's launch)
    θ_i ← θ_global + (θ_i − θ_i at launch), the steps taken while it was in flight kept (a replica that sat the sync
    out, weight 0, takes θ_global as it is): the same two lines as `outer_round`'s, for an overlapped sync (τ steps
    after its launch) and a voted one (torchft). A sync that did not commit leaves θ_global and θ_i as they are: the
    replica keeps its progress for the next sync."""
    result = landed.result
    if not result.committed:
        return result
    keep, launched = (alpha, launched or {}) if landed.weight > 0 else (0.0, {})
    for index, delta in landed.averaged:
        bucket = outer.buckets[index]
        if result.participants:
            outer.step(bucket, delta)                                         # θ_global ← OuterOpt(θ_global, Δ)
        outer.copy_to_replica(bucket, keep, launched.get(index))              # θ_i ← α·θ_i + (1 − α)·θ_global
    return result
