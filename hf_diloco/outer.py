"""The DiLoCo outer step (Douillard et al., arXiv 2311.08105, Algorithm 1).

    θ_global  parameters every replica agreed on at the start of the round (fp32)
    for each round:
        each replica i:  θ_i ← InnerOpt^H(θ_i)             (H local steps, no communication; done by Trainer)
        each replica i:  Δ_i ← θ_global − θ_i               (pseudo-gradient)             -> pseudo_gradient()
        all replicas:    Δ  ← (1/M) Σ_i Δ_i                 (the round's only collective)  -> comm.ReplicaComm
        all replicas:    θ_global ← OuterOpt(θ_global, Δ)   (SGD, lr 0.7, momentum 0.9, Nesterov by default)
        each replica i:  θ_i ← θ_global                     (inner optimizer state is kept) -> apply()

Design choices:
- θ_global and the outer optimizer state are fp32 whatever the model's dtype, on CPU by default (`offload`), so the
  outer loop costs no accelerator memory. The pseudo-gradient is formed on the communication device, bucket by
  bucket, so the extra memory is one bucket at a time.
- Every replica runs the identical outer step on the identical averaged Δ, so after `apply()` all replicas hold
  bit-identical parameters without a broadcast.
- The outer optimizer is a stock torch optimizer whose "gradient" is Δ: torch's Nesterov SGD computes
  v ← μ v + Δ;  θ ← θ − lr (Δ + μ v), the formulation DiLoCo uses.
- Only the parameters handed in are synced: for a PEFT model these are the trainable adapter weights.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def build_outer_optimizer(
    params: list[nn.Parameter], name: str, lr: float, momentum: float, nesterov: bool
) -> torch.optim.Optimizer:
    """The outer optimizer over θ_global: the paper's Nesterov SGD, or AdamW (beta1 = momentum) for ablations."""
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


class OuterLoop:
    """θ_global, the outer optimizer, and the two halves of a sync: pseudo-gradient out, averaged Δ in.

    >>> replica = [nn.Parameter(torch.tensor([1.0, 2.0]))]
    >>> outer = OuterLoop(replica, lr=1.0, momentum=0.0, nesterov=False)
    >>> with torch.no_grad():
    ...     _ = replica[0].sub_(torch.tensor([0.5, 0.5]))      # pretend the inner steps moved θ_i
    >>> delta = outer.pseudo_gradient(torch.device("cpu"))  # Δ_i = θ_global − θ_i
    >>> delta[0].tolist()
    [0.5, 0.5]
    >>> outer.apply(delta)                                   # lr 1, no momentum: θ_global ← θ_i
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
    ):
        self.params = list(params)
        if not self.params:
            raise ValueError("the model has no trainable parameters to synchronise")
        state_device = torch.device("cpu") if offload else self.params[0].device
        self.global_params = [
            nn.Parameter(p.detach().to(device=state_device, dtype=torch.float32, copy=True)) for p in self.params
        ]
        self.optimizer = build_outer_optimizer(self.global_params, optimizer, lr, momentum, nesterov)
        self.buckets = partition_into_buckets([p.numel() for p in self.params], bucket_numel)

    @property
    def numel(self) -> int:
        """Number of synced values (trainable parameters)."""
        return sum(p.numel() for p in self.params)

    @torch.no_grad()
    def pseudo_gradient(self, device: torch.device) -> list[torch.Tensor]:
        """Δ_i = θ_global − θ_i in fp32, flattened into one buffer per bucket on `device`."""
        return [
            torch.cat([
                (self.global_params[i].to(device) - self.params[i].to(device, torch.float32)).reshape(-1)
                for i in bucket
            ])
            for bucket in self.buckets
        ]

    @torch.no_grad()
    def apply(self, averaged: list[torch.Tensor]) -> None:
        """Outer step with the averaged Δ as gradient, then θ_i ← θ_global."""
        for bucket, flat in zip(self.buckets, averaged, strict=True):
            offset = 0
            for i in bucket:
                target = self.global_params[i]
                n = target.numel()
                target.grad = flat[offset : offset + n].view_as(target).to(target.device)
                offset += n
            assert offset == flat.numel(), "pseudo-gradient bucket size does not match its parameters"
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.copy_global_to_replica()

    @torch.no_grad()
    def copy_global_to_replica(self) -> None:
        for param, global_param in zip(self.params, self.global_params, strict=True):
            param.copy_(global_param)

    @torch.no_grad()
    def reset_global_from_replica(self) -> None:
        """θ_global ← θ_i (used after the replicas were made identical at the start of training)."""
        for param, global_param in zip(self.params, self.global_params, strict=True):
            global_param.copy_(param)

    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def state_dict(self) -> dict:
        return {
            "global_params": [p.detach().cpu() for p in self.global_params],
            "optimizer": self.optimizer.state_dict(),
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        saved = state["global_params"]
        if len(saved) != len(self.global_params):
            raise ValueError(
                f"the checkpoint's outer state holds {len(saved)} tensors but the model has "
                f"{len(self.global_params)} trainable parameters"
            )
        for target, value in zip(self.global_params, saved, strict=True):
            target.copy_(value)
        self.optimizer.load_state_dict(state["optimizer"])
