"""The set-up of one replica spread over several processes: DDP, FSDP2 or tensor parallel inside it, never across.

A replica of g processes trains like one model; replicas still talk only at syncs. This module lays out a replica
and its checkpoints; hf_diloco.comm syncs it, and DiLoCoTrainer calls both.

Design choices:
- The mesh of a launch is replicas × dp_shard × tp (accelerate's `ParallelismConfig`). FSDP2 shards over `dp_shard`
  only: accelerate's HSDP would also all-reduce every step's gradients over the replicas, which the outer sync
  replaces (`ReplicaSharding`).
- Tensor parallel is transformers' own plan (`tp_plan`), applied by DiLoCoTrainer on the replica's `tp` dimension
  before accelerate sees the model; FSDP2 then shards each piece. Tied weights stay whole.
- A replica of several processes with neither is DDP over its own processes only (`ddp_inside_replica`).
- Checkpoints hold ordinary consolidated weights (`full_state_dict`, `load_full_weights`) and each process's own
  optimizer shards as plain tensors (`local_shards`, `as_parameter_shards`), so a checkpoint of sharded replicas
  loads like any other model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from accelerate import ParallelismConfig

from .config import ConfigError, DiLoCoConfig


class ReplicaSharding(ParallelismConfig):
    """Accelerate's parallelism configuration for sharded replicas: FSDP2 over each replica's `dp_shard` processes
    only. Accelerate's HSDP would also all-reduce every step's gradients over `dp_replicate`, the replicas; DiLoCo
    replaces that dimension's per-step all-reduce with its outer syncs, so FSDP's mesh leaves it out.

    With tensor parallel beside FSDP2 the mesh keeps its `tp` dimension, but accelerate's own tensor-parallel
    preparation stays off: DiLoCoTrainer splits the layers on this mesh before accelerate sees the model (accelerate
    1.15's preparation also imports a class transformers 5.23 no longer has), and FSDP2 then shards each piece.
    tests/test_compat.py checks that accelerate still reads the three properties overridden here."""

    @property
    def fsdp_dim_names(self):
        return ["dp_shard_cp"]

    @property
    def tp_enabled(self):
        return False

    @property
    def non_dp_dim_names(self):
        return ["tp"] if self.tp_size > 1 else []


def replica_sharding(args: DiLoCoConfig) -> ReplicaSharding:
    """The mesh of a launch of sharded replicas: replicas × dp_shard × tp processes (torchft: one replica), where
    dp_shard × tp = replica_group_size (tp = 1 without tensor parallel)."""
    group = args.replica_group_size  # DiLoCoConfig refuses FSDP over fewer than 2 processes per tp piece
    replicas = 1 if args.outer_backend == "torchft" else max(1, args.world_size // group)
    return ReplicaSharding(dp_replicate_size=replicas, dp_shard_size=args.dp_shard_size, tp_size=args.tp_size)


def _embeddings(model) -> list[torch.nn.Module]:
    """The model's input and output embeddings (None left out): the modules accelerate's FSDP2 preparation shards
    as units of their own (one unit when they are tied)."""
    found = [model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None]
    try:
        found.append(model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None)
    except NotImplementedError:
        pass
    return [m for m in found if m is not None]


def fsdp_units(model, names: list[str] | None) -> list[str]:
    """The module classes FSDP2 shards as units in `model` (`names`; None: the model's `_no_split_modules`), less
    those holding the input or output embeddings: accelerate shards the embeddings as units of their own, and a
    unit inside another unit would shard its parameters twice (BERT's and ViT's embedding blocks are among their
    `_no_split_modules`)."""
    names = list(names if names is not None else getattr(model, "_no_split_modules", None) or [])
    inside = {id(m) for e in _embeddings(model) for m in e.modules()}
    holding = {type(module).__name__ for module in model.modules()
               if any(id(m) in inside for m in module.modules()) and module is not model}
    return [name for name in names if name not in holding]


def check_shardable(model) -> None:
    """ConfigError when FSDP2 inside a replica cannot shard `model`: a parameter held by several modules (tied) that
    are not just its input and output embeddings. Accelerate's preparation puts a tied input and output embedding
    in one unit, but a third holder (T5's encoder and decoder embeddings, BERT's prediction-head bias) would then
    be sharded by two units."""
    allowed = {id(m) for m in _embeddings(model)}
    holders: dict[int, list[tuple[str, str, torch.nn.Module]]] = {}  # parameter → (module name, its name, module)
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, parameter in module.named_parameters(recurse=False, remove_duplicate=False):
            holders.setdefault(id(parameter), []).append((module_name, name, module))
    for held_by in holders.values():
        if len(held_by) > 1 and not all(id(module) in allowed for _, _, module in held_by):
            first, name, _ = held_by[0]
            raise ConfigError(
                f"FSDP2 inside a replica cannot shard this {type(model).__name__}: its parameter "
                f"{f'{first}.{name}' if first else name!r} is tied across {len(held_by)} modules "
                f"({', '.join(m for m, _, _ in held_by)}), and accelerate's FSDP2 shards a tied weight only between an "
                f"input and an output embedding; train it as replicas of one process each.")


def set_fsdp_units(plugin, model) -> None:
    """Before accelerate prepares `model` with FSDP2 (`plugin`, its FSDP plugin; None: no FSDP): refuse a model it
    cannot shard (`check_shardable`) and give the plugin `fsdp_units` (read by its transformer-based wrap policy,
    accelerate's default; a size-based policy ignores them)."""
    if plugin is None:
        return
    check_shardable(model)
    plugin.transformer_cls_names_to_wrap = fsdp_units(model, getattr(plugin, "transformer_cls_names_to_wrap", None))


def tensor_parallel_plan(model) -> dict[str, str]:
    """The model's own tensor-parallel plan (transformers' `tp_plan`, one entry per module and parameter), less the
    rules on tied weights: a tied input embedding and LM head stay whole on every process of the replica (their
    vocabulary-sharded styles cannot share one weight). Empty where the model has no plan."""
    plan = model._expand_parallel_plan(model.tp_plan or {}) if hasattr(model, "_expand_parallel_plan") else {}
    names_of: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    tied = {name for names in names_of.values() if len(names) > 1 for name in names}
    tied |= {name.rpartition(".")[0] for name in tied}
    return {name: style for name, style in plan.items() if name not in tied}


def checked_tensor_parallel_plan(model, tp_size: int) -> dict[str, str]:
    """tensor_parallel_plan(model), or one sentence on why `model` cannot be split over `tp_size` processes."""
    plan = tensor_parallel_plan(model)
    if not plan:
        try:
            check_shardable(model)
            instead = "use FSDP2 inside the replica instead"
        except ConfigError:  # a weight tied beyond the embeddings: FSDP2 cannot shard it either
            instead = "train it as replicas of one process each"
        raise ConfigError(f"tp_size={tp_size}: {type(model).__name__} has no tensor-parallel plan in transformers, so "
                          f"its layers cannot be split; {instead}.")
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for name in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, name, None)
        if heads and heads % tp_size:
            raise ConfigError(f"tp_size={tp_size} does not divide the model's {name}={heads}: tensor parallel gives "
                              f"each process whole attention heads.")
    return plan


def apply_tensor_parallel(model, args: DiLoCoConfig):
    """Split `model`'s layers over tp_size processes of its replica with transformers' tensor parallel
    (transformers.distributed.tensor_parallel), on a device mesh whose `tp` dimension is inside the replica:
    column-sharded q/k/v, gate and up projections, row-sharded o and down projections; every other parameter
    (norms, a tied embedding) stays whole on each process. No collective crosses replicas. With FSDP2 in the same
    replica, the mesh is the one accelerate shards over (replicas × dp_shard × tp), so that FSDP2 then shards each
    piece over `dp_shard`, and the parameters the plan leaves whole (plain tensors) over `dp_shard` alone."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    plan = checked_tensor_parallel_plan(model, args.tp_size)
    device = args.device
    if args.sharded_replica:
        mesh = args.parallelism_config.get_device_mesh(device.type)
    else:
        replicas = 1 if args.outer_backend == "torchft" else args.world_size // args.tp_size
        mesh = init_device_mesh(device.type, (replicas, args.tp_size), mesh_dim_names=("replica", "tp"))
    return apply_tensor_parallelism(model.to(device), mesh["tp"], plan)


def ddp_inside_replica(model: torch.nn.Module, replica_group, device: torch.device) -> torch.nn.Module:
    """`model` in DDP over its replica's processes only (`replica_group`), for a replica of several processes with
    neither FSDP2 nor tensor parallel: gradients are averaged inside the replica at every step, never across
    replicas, and buffers are not broadcast at every step."""
    device_ids = [torch.cuda.current_device()] if device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids, process_group=replica_group,
                                                     broadcast_buffers=False)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights on CPU, each tensor-parallel piece gathered from the replica's processes (a
    collective inside the replica, which every one of its processes must call)."""
    from torch.distributed.tensor import DTensor

    return {name: (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu()
            for name, value in model.state_dict().items()}


def load_full_weights(model: torch.nn.Module, checkpoint: str | Path) -> None:
    """Read a checkpoint's consolidated weights (`model*.safetensors`) into a sharded or tensor-parallel `model`:
    every process reads the whole file and keeps its own shards."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    files = sorted(Path(checkpoint).glob("model*.safetensors"))
    if not files:
        raise ConfigError(f"checkpoint {checkpoint} holds no model.safetensors to resume from.")
    weights = {name: tensor for file in files for name, tensor in load_file(file).items()}
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=False))


def local_shards(value):
    """`value` (a state dict) with every DTensor replaced by this process's local shard."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.to_local().detach().clone()
    if isinstance(value, dict):
        return {key: local_shards(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(local_shards(item) for item in value)
    return value


@torch.no_grad()
def as_parameter_shards(optimizer: torch.optim.Optimizer) -> None:
    """After loading local shards into an optimizer over DTensor parameters (a sharded replica's): make each
    parameter-shaped state tensor a DTensor laid out like its parameter again."""
    from torch.distributed.tensor import DTensor

    for group in optimizer.param_groups:
        for param in group["params"]:
            if not isinstance(param, DTensor):
                continue
            state = optimizer.state.get(param, {})
            for key, value in state.items():
                if torch.is_tensor(value) and not isinstance(value, DTensor) and value.shape == param.to_local().shape \
                        and value.dim() > 0:
                    state[key] = DTensor.from_local(value.to(param.device), param.device_mesh, param.placements,
                                                    run_check=False, shape=param.shape, stride=param.stride())
