"""The inner optimizer a replica trains with between syncs: Trainer's own (`inner_optimizer: adamw`, whatever
`optim` says, AdamW by default), or Muon for the weight matrices with AdamW for the rest (`inner_optimizer: muon`).

MuLoCo (arXiv 2505.23725) reports Muon as DiLoCo's inner optimizer ahead of AdamW; DiLoCo itself does not change:
the pseudo-gradient is still θ_global − θ_i, whatever made θ_i. Muon's usual split is kept:

    Muon    every trainable 2-D weight inside the model's body (attention and MLP projections, LoRA's A and B);
    AdamW   embeddings (input and output, tied or not), task heads, and every vector (biases, norms).

`torch.optim.Muon` (momentum 0.95, Nesterov, five Newton-Schulz steps) with `adjust_lr_fn="match_rms_adamw"`: each
matrix's update is scaled to the root-mean-square of an AdamW step (0.2 · η per value), so the recipe's learning
rate, schedule and weight decay serve both parts unchanged, and the contribution checks' `size` rule (at most η
per value per step) bounds a Muon replica's pseudo-gradient as it bounds an AdamW one's.

On the CPU the orthogonalization runs in float32 (`newton_schulz_float32`): torch's runs it in bfloat16, which CPUs
without bfloat16 matrix units multiply far slower than float32 (one thread, a Muon step of the tiny T5: 1,126 ms
in bfloat16, 49 ms in float32, 4.8 ms for AdamW; benchmarks/muon.py --step-seconds). On accelerators torch's
bfloat16 iteration is kept.

Muon orthogonalizes each whole matrix: a replica whose processes each hold a piece of it (FSDP2 or tensor
parallel inside the replica) is refused by DiLoCoConfig; DDP inside a replica gives every process the whole
matrix and the same averaged gradient, and is served.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.optim._muon as torch_muon
from torch import nn

from .errors import ConfigError

# Modules whose parameters are a task's head, trained by AdamW: causal and masked LM heads, sequence and token
# classifiers, question answering, BERT's pre-training heads.
HEAD_MODULES = ("lm_head", "score", "classifier", "qa_outputs", "cls", "pooler")
MUON_MOMENTUM = 0.95


def muon_parameter_names(model: nn.Module) -> list[str]:
    """The names of the trainable parameters Muon takes: 2-D, not an embedding (any module's nn.Embedding weight,
    or the output embeddings, tied or not), not in a task head (HEAD_MODULES)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if output is not None and getattr(output, "weight", None) is not None:
        embeddings.add(id(output.weight))
    names = []
    for name, param in model.named_parameters():
        in_head = any(part in HEAD_MODULES for part in name.split(".")[:-1])
        if param.requires_grad and param.dim() == 2 and id(param) not in embeddings and not in_head:
            names.append(name)
    return names


def newton_schulz_float32(grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int,
                          eps: float) -> torch.Tensor:
    """Muon's orthogonalization of a gradient matrix G, as torch.optim.Muon computes it (the quintic Newton-Schulz
    iteration X <- aX + (bA + cA^2)X with A = XX^T, from X = G / |G|_F, on the wide orientation), in float32."""
    a, b, c = ns_coefficients
    tall = grad.size(0) > grad.size(1)
    x = (grad.T if tall else grad).to(torch.float32, copy=True)
    x.div_(x.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


@contextmanager
def orthogonalized_in_float32_on_cpu() -> Iterator[None]:
    """While open, torch.optim.Muon orthogonalizes CPU matrices with `newton_schulz_float32` (and others as it
    does: in bfloat16). torch's Muon calls its module's `_zeropower_via_newtonschulz` by name on every step."""
    original = getattr(torch_muon, "_zeropower_via_newtonschulz", None)
    if original is None:  # a torch whose Muon is built otherwise: nothing to replace
        yield
        return

    def orthogonalize(grad, ns_coefficients, ns_steps, eps):
        if grad.device.type == "cpu":
            return newton_schulz_float32(grad, ns_coefficients, ns_steps, eps)
        return original(grad, ns_coefficients, ns_steps, eps)

    torch_muon._zeropower_via_newtonschulz = orthogonalize
    try:
        yield
    finally:
        torch_muon._zeropower_via_newtonschulz = original


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimizer over two: `torch.optim.Muon` for the matrices, `torch.optim.AdamW` for the rest. Its
    `param_groups` are the two optimizers' own group dicts (Muon's first), so a learning-rate scheduler that sets
    `lr` on them steers both; `step`, `zero_grad`, `state_dict` and `load_state_dict` go to both.

    `muon_groups` and `adamw_groups`: parameter groups as torch optimizers take them (each a dict with `params`
    and, optionally, its own `weight_decay`)."""

    # The contribution checks' `size` rule: no step moves a value by much more than the learning rate.
    steps_bounded_by_lr = True

    def __init__(self, muon_groups: Iterable[dict], adamw_groups: Iterable[dict], lr: float, weight_decay: float,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        muon_groups = [g for g in muon_groups if g["params"]]
        adamw_groups = [g for g in adamw_groups if g["params"]]
        if not muon_groups:
            raise ConfigError("inner_optimizer muon found no weight matrix among the trainable parameters for Muon "
                              "(it takes 2-D weights outside embeddings and heads); use inner_optimizer adamw.")
        self.muon = torch.optim.Muon(muon_groups, lr=lr, weight_decay=weight_decay, momentum=MUON_MOMENTUM,
                                     nesterov=True, adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW(adamw_groups, lr=lr, weight_decay=weight_decay, betas=betas,
                                       eps=eps) if adamw_groups else None
        super().__init__(self._groups(), {"lr": lr})
        self._link()

    def _parts(self) -> list[torch.optim.Optimizer]:
        return [self.muon] + ([self.adamw] if self.adamw is not None else [])

    def _groups(self) -> list[dict]:
        return [group for part in self._parts() for group in part.param_groups]

    def _link(self) -> None:
        """This optimizer's groups and state are its parts' (their dicts, not copies)."""
        self.param_groups = self._groups()
        self.state = {param: state for part in self._parts() for param, state in part.state.items()}

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with orthogonalized_in_float32_on_cpu():
            self.muon.step()
        if self.adamw is not None:
            self.adamw.step()
        if len(self.state) != sum(len(part.state) for part in self._parts()):  # the first step made their state
            self._link()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self._parts():
            part.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": None if self.adamw is None else self.adamw.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        if not saved_by_muon(state_dict):
            raise ConfigError("the checkpoint's optimizer state was saved by inner_optimizer adamw, and this run "
                              "trains with inner_optimizer muon; resume with the inner_optimizer it was saved with.")
        self.muon.load_state_dict(state_dict["muon"])
        if self.adamw is not None:
            self.adamw.load_state_dict(state_dict["adamw"])
        self._link()


def unwrapped(optimizer):
    """The torch optimizer inside accelerate's wrapper (AcceleratedOptimizer), or `optimizer` itself."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def saved_by_muon(state_dict: dict) -> bool:
    """Whether an optimizer state dict is MuonWithAdamW's (its two parts), not a single torch optimizer's."""
    return set(state_dict) == {"muon", "adamw"}


def check_resumable(optimizer, state_dict: dict) -> None:
    """Refuse, in one sentence, a checkpoint of inner_optimizer muon resumed by another optimizer (the other way
    round, MuonWithAdamW.load_state_dict refuses). `optimizer` may be wrapped (accelerate's AcceleratedOptimizer)."""
    if saved_by_muon(state_dict) and not isinstance(unwrapped(optimizer), MuonWithAdamW):
        raise ConfigError("the checkpoint's optimizer state was saved by inner_optimizer muon, and this run trains "
                          "with inner_optimizer adamw; resume with the inner_optimizer it was saved with.")


def muon_with_adamw(model: nn.Module, decay_names: Iterable[str], lr: float, weight_decay: float,
                    betas: tuple[float, float], eps: float) -> MuonWithAdamW:
    """The optimizer of `inner_optimizer: muon` over `model`'s trainable parameters: Muon for
    `muon_parameter_names(model)` (with weight decay), AdamW for the rest (weight decay on `decay_names` only, as
    Trainer's AdamW has it: not on biases and norms)."""
    muon = set(muon_parameter_names(model))
    decay = set(decay_names)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return MuonWithAdamW(
        [{"params": [p for n, p in named if n in muon]}],
        [{"params": [p for n, p in named if n not in muon and n in decay]},
         {"params": [p for n, p in named if n not in muon and n not in decay], "weight_decay": 0.0}],
        lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)


def muon_for(trainer, model: nn.Module) -> MuonWithAdamW:
    """`muon_with_adamw` over `model` with a Trainer's settings: its learning rate, weight decay (on the parameters
    Trainer decays: not biases and norms), AdamW betas and epsilon."""
    args = trainer.args
    return muon_with_adamw(model, trainer.get_decay_parameter_names(model), lr=args.learning_rate,
                           weight_decay=args.weight_decay, betas=(args.adam_beta1, args.adam_beta2),
                           eps=args.adam_epsilon)


class InnerOptimizer:
    """Trainer's `create_optimizer` with `inner_optimizer` (a DiLoCoConfig field) followed: Trainer's own optimizer
    (`optim`) for adamw, `muon_for` for muon. Put before Trainer in the bases: DiLoCoMixin has it, and so has the
    data-parallel baseline's Trainer when a recipe compares DiLoCo with Muon against DDP with the same optimizer."""

    def create_optimizer(self, model=None):
        if getattr(self.args, "inner_optimizer", "adamw") == "muon" and self.optimizer is None:
            self.optimizer = muon_for(self, self.model if model is None else model)
        return super().create_optimizer(model)
