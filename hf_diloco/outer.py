"""θ_global and the outer optimizer of DiLoCo (Douillard et al., arXiv 2311.08105, Algorithm 1), and how the
replica's parameters are cut into buckets and streaming fragments.

    θ_global  parameters every replica agreed on at the start of the round (fp32)
    for each round:
        each replica i:  θ_i ← InnerOpt^H(θ_i)             (H local steps, no communication; done by Trainer)
        each replica i:  Δ_i ← θ_global − θ_i               (pseudo-gradient)
        all replicas:    Δ  ← (1/M) Σ_i Δ_i                 (the round's only communication; comm.ReplicaComm)
        all replicas:    θ_global ← OuterOpt(θ_global, Δ)   (SGD, lr 0.7, momentum 0.9, Nesterov by default)
        each replica i:  θ_i ← θ_global                     (inner optimizer state is kept)

`OuterState` holds θ_global, the one outer optimizer over it, the buckets and fragments it is cut into, and its
checkpoint (with the checks a saved or received state passes). The round's loop body is the fragments':
hf_diloco.fragments (each fragment's verbs, and `outer_round`, the blocking sync that reads as the loop above).

Design choices:
- θ_global and the outer optimizer state are fp32 whatever the model's dtype, on CPU by default (`offload`; pinned
  host memory under a CUDA model), so the outer loop costs no accelerator memory.
- Bounded memory: the parameters are cut into buckets of at most `bucket_numel` values, and a blocking sync forms,
  sends, receives and applies one bucket before it starts the next. Buckets never straddle fragments.
- The outer optimizer is one stock torch optimizer over θ_global; a bucket's step sets the gradients of its
  parameters only, and torch optimizers skip parameters without a gradient, so stepping bucket by bucket is the
  same arithmetic as one step over all of them. torch's Nesterov SGD computes v ← μ v + Δ; θ ← θ − lr (Δ + μ v),
  the formulation DiLoCo uses.
- Only the parameters handed in are synced: for a PEFT model these are the trainable adapter weights.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

import torch
from torch import nn


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


class RestartedSGD(torch.optim.SGD):
    """torch's SGD with momentum (Nesterov or heavy ball) whose momentum starts afresh every `restart` steps of a
    parameter: the step after each restart builds its momentum from that step's gradient alone, as a first step
    does (outer-momentum restarts, arXiv 2605.28585: the stale momentum dropped, what the inner steps made kept).
    Each parameter counts its own steps (`since_restart`, kept in the optimizer's state and its checkpoint), so a
    fragment synced less often restarts after as many of its own syncs.

    >>> theta = nn.Parameter(torch.zeros(1))
    >>> opt = RestartedSGD([theta], lr=1.0, momentum=0.5, nesterov=True, restart=2)
    >>> for g in (1.0, 2.0, 3.0):
    ...     theta.grad = torch.tensor([g])
    ...     opt.step()
    >>> theta.item()    # −(1 + 0.5·1), −(2 + 0.5·2.5), then afresh: −(3 + 0.5·3)
    -9.25
    """

    def __init__(self, params, lr: float, momentum: float, nesterov: bool, restart: int):
        super().__init__(params, lr=lr, momentum=momentum, nesterov=nesterov)
        self.restart = restart

    @torch.no_grad()
    def step(self, closure=None):
        stepped = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        for param in stepped:
            state = self.state[param]
            if state.get("since_restart", 0) >= self.restart:
                state.pop("momentum_buffer", None)
                state["since_restart"] = 0
        super().step(closure)
        for param in stepped:
            self.state[param]["since_restart"] = self.state[param].get("since_restart", 0) + 1


def build_outer_optimizer(
    params: list[nn.Parameter], name: str, lr: float, momentum: float, nesterov: bool, momentum_delay: int = 1,
    delayed_scale: float = 1.0, momentum_restart: int = 0,
) -> torch.optim.Optimizer:
    """The outer optimizer over θ_global: the paper's Nesterov SGD (its momentum moved every `momentum_delay`
    steps when above 1: DelayedNesterov; restarted every `momentum_restart` steps when above 0: RestartedSGD), or
    AdamW (beta1 = momentum) for ablations."""
    if name == "sgd" and momentum_delay > 1:
        return DelayedNesterov(params, lr=lr, momentum=momentum, delay=momentum_delay, scale=delayed_scale)
    if name == "sgd" and momentum_restart > 0 and momentum > 0:
        return RestartedSGD(params, lr=lr, momentum=momentum, nesterov=nesterov, restart=momentum_restart)
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
    """θ_global and the outer optimizer (the outer state) over the replica's trainable parameters, cut into buckets
    (`buckets`: parameter indices; `fragment_buckets`: each streaming fragment's buckets), and its checkpoint. The
    verbs of a sync are each fragment's (hf_diloco.fragments.Fragment): it steps this optimizer on its own buckets.

    >>> outer = OuterState([nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(5))], lr=0.7, momentum=0.9,
    ...                    nesterov=True, bucket_numel=4, fragments=[[0], [1]])
    >>> outer.buckets, outer.fragment_buckets                  # the 5 values of parameter 1 are a bucket alone
    ([[0], [1]], [[0], [1]])
    >>> outer.global_params[1].dtype, outer.numel
    (torch.float32, 8)
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
        momentum_restart: int = 0,
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
                                               momentum_delay, delayed_scale, momentum_restart)
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


def is_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """True when no value is NaN or infinite: one boolean reduction per tensor, no copy of it, and one read of the
    answers per device (an accelerator is waited for once, not once per tensor)."""
    flags: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        flags.setdefault(t.device, []).append(torch.isfinite(t).all())
    return all(bool(torch.stack(found).all()) for found in flags.values())
