"""One training process, assembled from a recipe's arguments: the library behind `hf-diloco train` and the demo.

    from hf_diloco.train import train
    trainer = train(run, config)            # run: RunArguments, config: DiLoCoConfig

Design choices:
- One function, `train`, does what a run is: check the output folder and the checkpoint to resume from, build the
  model (plus LoRA adapters), load and cut the data, pick the trainer (`DiLoCoTrainer`, or plain `Trainer` for the
  `trainer: ddp` baseline), train, save the model (and the merged model), write run_config.json and
  run_metrics.json, with progress recorded for the app and a graceful stop on request or signal from the start
  (DiLoCoTrainer's own while it trains: hf_diloco.trainer).
  The CLI only parses arguments and prints.
- Checks that need no model or data (`check_arguments`, `check_output_dir`, `resolve_checkpoint`,
  `check_accelerate_config`) run before anything is built, so bad input costs nothing and overwrites nothing.
- `check_inputs` checks the model (built from its config on the meta device, with its LoRA adapters) and the data
  (the dataset's first row) cheaply: a dry run and `hf-diloco launch` run it once, before any process starts.
- `dry_run_plan` is the same assembly up to the model, with the byte maths of a round instead of training.
- Every error a user can cause is a `ConfigError` with one sentence.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from . import checks
from .checks import AUTO, TRL_TRAINERS
from .errors import ConfigError, first_line
from .files import read_yaml, write_json

if TYPE_CHECKING:  # importing them pulls in torch and transformers, which `hf-diloco app` never needs
    from .config import DiLoCoConfig, RunArguments

RUN_METRICS_FILE = "run_metrics.json"


# --- checks before anything is built --------------------------------------------------------------------------------


def check_arguments(run: RunArguments, config: DiLoCoConfig) -> None:
    """Combinations of model/data and training arguments that cannot work, refused in one sentence."""
    if run.streaming and config.max_steps <= 0:
        raise ConfigError("a streamed dataset has no length: set max_steps.")
    if run.streaming and config.data_sharding == "non_iid":
        raise ConfigError(
            "data_sharding=non_iid needs the dataset's length to give each replica a contiguous slice, which a "
            "streamed dataset does not have; set streaming: false or data_sharding: iid."
        )
    if run.lora_r > 0 and config.tensor_parallel:
        raise ConfigError("LoRA adapters cannot be split by tensor parallel inside a replica (its plan names the "
                          "model's own layers, which PEFT wraps); split a LoRA replica with FSDP2 (fsdp: true) "
                          "instead, or set lora_r: 0.")


def restarted() -> bool:
    """True in processes that torchelastic (`accelerate launch --max_restarts N`) brought back after a failure."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0


def check_output_dir(config: DiLoCoConfig) -> None:
    """Refuse to train into a folder that already holds a run, unless resuming from it."""
    from .metrics import syncs_file

    out = Path(config.output_dir)
    if config.resume_from_checkpoint or restarted() or not out.exists():
        return
    if config.outer_backend == "torchft":
        return  # a torchft replica started again heals from a live peer and goes on writing the same folder
    if syncs_file(out).exists() or any(out.glob("checkpoint-*")):
        raise ConfigError(
            f"output_dir {str(out)!r} already holds a run; choose another output_dir or pass "
            f"--resume_from_checkpoint latest to continue it."
        )


def newest_complete_checkpoint(output_dir: str, clean_up: bool = True) -> str | None:
    """The newest complete `checkpoint-<step>` in output_dir (see hf_diloco.checkpoints: a folder is complete
    when its marker, written last, is there). With `clean_up` (the main process, before training), what a process
    that died while saving or removing a checkpoint left behind (a `checkpoint-<step>` without its marker, a
    `tmp-checkpoint-*` folder) is removed, with a one-line notice each."""
    from . import checkpoints

    out = Path(output_dir)
    if not out.is_dir():
        return None
    for leftover in checkpoints.leftovers(out) if clean_up else []:
        print(f"[diloco] removing {leftover.name}: an incomplete checkpoint left by a process that stopped while "
              f"saving or removing it", flush=True)
        checkpoints.remove(leftover)
    newest = checkpoints.newest_complete(out, report=(lambda line: print(line, flush=True)) if clean_up else None)
    return str(newest) if newest else None


def resolve_checkpoint(config: DiLoCoConfig) -> str | None:
    """The checkpoint folder to resume from, or None.

    `auto` (and any restart by torchelastic): the newest complete checkpoint if there is one, else a fresh start.
    `latest`: the newest complete checkpoint, which must exist. Anything else: that folder.
    """
    value = config.resume_from_checkpoint
    main = int(os.environ.get("RANK", "0") or 0) == 0
    if value == "auto" or (not value and restarted()):
        found = newest_complete_checkpoint(config.output_dir, clean_up=main)
        if found and main:
            print(f"[diloco] resuming from {found}", flush=True)
        return found
    if not value:
        return None
    if value in ("latest", "last", "True", "true"):
        found = newest_complete_checkpoint(config.output_dir, clean_up=main)
        if found is None:
            raise ConfigError(
                f"resume_from_checkpoint=latest but {config.output_dir!r} holds no complete checkpoint-* folder."
            )
        return found
    if not os.path.isdir(value):
        raise ConfigError(f"checkpoint {value!r} does not exist.")
    return value


def check_accelerate_config(path: str, config: DiLoCoConfig, processes: int | None = None,
                            machines: int | None = None, rank: int | None = None) -> dict:
    """The accelerate config exists, is readable, and fits the recipe's replica layout; returns its settings.

    `processes`, `machines` and `rank` are accelerate launch flags given beside the config (None: the config's);
    the layout they make together is what is checked, as every worker of the launch would find out.
    """
    values = read_yaml(path, "accelerate config", holds="accelerate settings")
    given = {"num_processes": processes, "num_machines": machines, "machine_rank": rank}
    for name, value in given.items():
        if value is not None and value < (0 if name == "machine_rank" else 1):
            raise ConfigError(f"--{name} must be {'0' if name == 'machine_rank' else '1'} or more, got {value}.")
    processes = processes if processes is not None else int(values.get("num_processes", 1) or 1)
    machines = machines if machines is not None else int(values.get("num_machines", 1) or 1)
    rank = rank if rank is not None else int(values.get("machine_rank", 0) or 0)
    source = f"accelerate config {path!r}" + (" with the launch flags" if any(v is not None for v in given.values())
                                               else "")
    kind = str(values.get("distributed_type", "NO")).upper()
    if str(values.get("rdzv_backend", "static")).lower() not in ("static", ""):
        raise ConfigError(
            f"accelerate config {path!r} asks for rdzv_backend {values['rdzv_backend']!r}, whose rendezvous store "
            f"listens on every interface and reads back what it receives with pickle (anyone who reaches it can run "
            f"code here); use rdzv_backend: static, or outer_backend: torchft for replicas that come and go."
        )
    group = config.replica_group_size
    if kind == "DEEPSPEED":
        raise ConfigError(
            f"accelerate config {path!r} uses DeepSpeed, whose ZeRO would shard one model across the replicas; use "
            f"distributed_type FSDP with fsdp_version 2, which hf-diloco keeps inside each replica (see "
            f"accelerate_configs/cpu-fsdp-2x2.yaml)."
        )
    layout = values.get("parallelism_config") or {}
    tp = int(layout.get("parallelism_config_tp_size", 1) or 1)
    if kind == "FSDP" or config.sharded_replica:
        if kind == "FSDP" and str((values.get("fsdp_config") or {}).get("fsdp_version", 1)) != "2":
            raise ConfigError(f"accelerate config {path!r} uses FSDP version 1; set fsdp_config: {{fsdp_version: 2}}, "
                              f"the FSDP hf-diloco shards each replica with.")
        shard = int(layout.get("parallelism_config_dp_shard_size", 0) or 0)
        tp = max(tp, config.tp_size)
        if shard and group not in (1, shard * tp):
            raise ConfigError(f"accelerate config {path!r} shards each replica over dp_shard_size={shard} "
                              + (f"× tp_size={tp} " if tp > 1 else "")
                              + f"processes but replica_group_size is {group}; set one of them, or both alike.")
        group = shard * tp if shard else group
        if group < 2 * tp or group % tp:
            raise ConfigError(f"accelerate config {path!r} uses FSDP, which hf-diloco runs inside each replica: set "
                              f"parallelism_config_dp_shard_size to the processes each value is sharded over, 2 or "
                              f"more" + (f" per tensor-parallel piece (a replica is then dp_shard_size × tp_size={tp} "
                                         f"processes)." if tp > 1 else "."))
    elif tp > 1 or config.tensor_parallel:
        tp = max(tp, config.tp_size)
        if group not in (1, tp):
            raise ConfigError(f"accelerate config {path!r} splits each replica's layers over tp_size={tp} processes "
                              f"but replica_group_size is {group}; set one of them, or both alike.")
        group = tp
    if processes % group:
        raise ConfigError(
            f"{source} starts {processes} processes, which replica_group_size={group} does not divide."
        )
    values["hf_diloco_layout"] = {"processes": processes, "group": group,
                                  "sharded": kind == "FSDP" or config.sharded_replica, "tp": tp}
    if processes % machines:
        raise ConfigError(f"{source} spreads {processes} processes over {machines} machines, which does not divide "
                          f"evenly; use a multiple of {machines} processes.")
    if rank >= machines:
        raise ConfigError(f"{source} gives this machine rank {rank}, but there are only {machines} machine(s); ranks "
                          f"count from 0.")
    values["hf_diloco_layout"]["note"] = spanning_note(processes // machines, group)
    return values


def spanning_note(per_machine: int, group: int) -> str | None:
    """The warning for replicas that span machines (a group larger than one machine's processes, or one that does
    not divide them), or None: DDP, FSDP2 or tensor parallel inside such a replica talk across the link between
    its machines at every step, which is what DiLoCo is there to avoid unless those machines share a fast fabric.

    >>> spanning_note(8, 8), spanning_note(8, 4), spanning_note(4, 8)[:60]
    (None, None, 'replica_group_size=8 puts each replica on more than one mach')
    """
    if group <= 1 or (group <= per_machine and per_machine % group == 0):
        return None
    return (f"replica_group_size={group} puts each replica on more than one machine ({per_machine} processes each), "
            f"so its DDP, FSDP2 or tensor parallel traffic crosses the link between them at every step; that "
            f"suits machines on one fast fabric only; across sites, make it divide {per_machine}.")


# --- the model -------------------------------------------------------------------------------------------------------


def build_model(run: RunArguments, labels: list[str] | None = None):
    """The model named by `run` (models.Loaded: the model, its tokenizer and the line on what a checkpoint left new),
    a classifier with one class per name in `labels` (data.class_names), with LoRA adapters when `lora_r > 0`."""
    import dataclasses

    from .models import load_model

    loaded = load_model(run.model_name_or_path, run.block_size, run.seed_model, run.tokenizer_name_or_path,
                        run.torch_dtype, run.task, labels)
    return dataclasses.replace(loaded, model=add_lora(loaded.model, run)) if run.lora_r > 0 else loaded


def lora_targets(model, named: str) -> list[str]:
    """The modules that get LoRA adapters: those `named` (comma-separated), or with "auto" PEFT's choice for the
    model's architecture (the attention's query and value projections: q_proj,v_proj for Llama, Qwen3, Mistral and
    Gemma 3, c_attn for GPT-2), else q_proj,v_proj where the model has them. ConfigError when none can be chosen."""
    if named.strip() != "auto":
        return [name.strip() for name in named.split(",") if name.strip()]
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    model_type = getattr(model.config, "model_type", "")
    chosen = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model_type)
    if chosen:
        return list(chosen)
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    if {"q_proj", "v_proj"} <= names:
        return ["q_proj", "v_proj"]
    raise ConfigError(f"lora_target_modules 'auto' has no choice for a {model_type or type(model).__name__} model; "
                      f"name the modules that get adapters (comma-separated).")


def add_lora(model, run: RunArguments):
    """PEFT LoRA adapters on `run.lora_target_modules` ("auto": chosen for the architecture), every one of which must
    name modules of the model; only they train, so only they are synced."""
    from peft import LoraConfig, get_peft_model

    targets = lora_targets(model, run.lora_target_modules)
    # PEFT adapts the modules that match any target and ignores the others: a misspelt one would go unnoticed.
    names = [name for name, _ in model.named_modules()]
    absent = [target for target in targets if not any(n == target or n.endswith("." + target) for n in names)]
    if absent:
        raise ConfigError(f"cannot add LoRA adapters: the model has no module named {', '.join(map(repr, absent))}; "
                          f"set lora_target_modules to names of its modules (e.g. q_proj,v_proj).")
    try:
        return get_peft_model(
            model, LoraConfig(r=run.lora_r, lora_alpha=run.lora_alpha, lora_dropout=run.lora_dropout,
                              target_modules=targets, task_type="CAUSAL_LM")
        )
    except ValueError as error:  # PEFT's first sentence says what is missing; the rest is ours
        raise ConfigError(f"cannot add LoRA adapters: {first_line(error).split('. ')[0]}; set lora_target_modules to "
                          f"names of the model's modules (e.g. q_proj,v_proj).") from None


# --- dry run ---------------------------------------------------------------------------------------------------------


def shape_only_model(run: RunArguments):
    """The model a dry run measures and a launch checks, built on the meta device from its config alone (no memory
    taken, no weights read, whatever its size) with its LoRA adapters: a preset from its settings, a local model
    folder or a Hub model from its config.json (a Hub model's is downloaded, its weights are not). ConfigError in
    the sentence training would end with when the model cannot be found or read, or a LoRA target is not among
    its modules."""
    import torch
    import transformers

    from .models import PRESETS, load_model_config, weights_dtype
    from .tasks import TASK_PRESETS, check_fits_task, get_task

    if run.model_name_or_path in PRESETS or run.model_name_or_path in TASK_PRESETS:
        with torch.device("meta"):
            return build_model(run).model
    config = load_model_config(run.model_name_or_path)
    task = get_task(run.task)
    check_fits_task(config, task, run.model_name_or_path)
    dtype = getattr(config, "dtype", None) if run.torch_dtype == "auto" else weights_dtype(run.torch_dtype)
    with torch.device("meta"):
        try:
            model = getattr(transformers, task.auto_class).from_config(config, dtype=dtype)
        except ValueError as error:  # a config of no model for the task
            raise ConfigError(f"could not load model {run.model_name_or_path!r}: {first_line(error)}.") from None
        return add_lora(model, run) if run.lora_r > 0 else model


def check_inputs(run: RunArguments, config: DiLoCoConfig):
    """Everything a dry run checks before it measures, and `hf-diloco launch` before it starts a process: the
    combinations of arguments (`check_arguments`), the model with its LoRA adapters (`shape_only_model`) and the
    dataset (`data.check_dataset`), each refused in the sentence training would end with. Returns the model,
    on the meta device."""
    from .data import check_dataset

    check_arguments(run, config)
    model = shape_only_model(run)
    check_dataset(run)
    return model


def dry_run_plan(run: RunArguments, config: DiLoCoConfig, processes: int | None = None,
                 group: int | None = None, sharded: bool | None = None, tp: int | None = None) -> dict[str, str]:
    """What a run would do, computed from the model alone: sizes, memory per process and the bytes of a round;
    nothing is trained. `processes`, `group`, `sharded` and `tp` give the layout of an accelerate config (`launch
    --dry-run`); by default it is this launch's.

    Args:
        run: the run's model and data settings.
        config: the DiLoCo settings.
        processes: the launch's number of processes (default: this launch's world size).
        group: processes per replica (default: `config.replica_group_size`).
        sharded: whether a replica's members shard the model (FSDP2).
        tp: the tensor-parallel size inside a replica.

    Returns:
        dict[str, str]: the plan's rows, name → value as `hf-diloco train --dry-run` prints them (sizes, memory
            per process, bytes of a round, the layout's note where one applies).
    """
    from .codecs import CODECS, make_codec
    from .comm import ring_all_reduce_bytes, sync_bytes
    from .metrics import format_bytes

    model = check_inputs(run, config)
    group = group or config.replica_group_size
    sharded = config.sharded_replica if sharded is None else sharded
    tp = config.tp_size if tp is None else tp
    share = parameter_shares(model, group // tp if sharded else 1, tp)
    on_torchft = config.outer_backend == "torchft"
    world = processes or int(os.environ.get("WORLD_SIZE", "1"))
    replicas = config.num_replicas if on_torchft else max(1, world // group)
    shown = replicas if replicas > 1 else 8  # alone, show the paper's M = 8 as the example
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    codecs = {name: make_codec(name, chunk=config.compression_chunk, sparse_k=config.sparse_k,
                               sparse_chunk=config.sparse_chunk, sparse_bits=config.sparse_bits) for name in CODECS}
    # Each member of a replica syncs a 1/g slice (tensor parallel: the pieces it holds, norms and a tied embedding
    # whole); the statistics riding along are left out (a few bytes).
    if tp > 1:
        held = round(sum(p.numel() * share[name] for name, p in model.named_parameters() if p.requires_grad))
        by_codec = {name: sync_bytes(held, shown, 1, codec) for name, codec in codecs.items()}
    else:
        by_codec = {name: sync_bytes(trainable, shown, group, codec) for name, codec in codecs.items()}
    per_round = by_codec[config.compression]
    optim = getattr(config.optim, "value", config.optim)
    schedule = getattr(config.lr_scheduler_type, "value", config.lr_scheduler_type)
    note = checks.rounds_note(AUTO if config.auto_inner_steps else config.inner_steps, config.max_steps, run.trainer,
                              config.round_seconds)
    plan = {
        "trainer": run.trainer,
        "model": f"{run.model_name_or_path} ({total:,} parameters, {trainable:,} trainable and synced)",
        "data": f"{run.dataset_name}" + (f" [{run.dataset_config}]" if run.dataset_config else "")
        + (f", rows as TRL prepares them (chat template), at most {config.max_length} tokens each"
           if trl_of(run, config) else
           (", streamed" if run.streaming else "") + f", {run.block_size}-token blocks, column {run.text_column!r}"),
        "replicas in this launch": (f"1 of {replicas} (outer_backend torchft: one launch per replica)" if on_torchft
                                    else f"{replicas} of {group} process(es) each")
        + (f", each split over {tp} processes by tensor parallel and each piece sharded over {group // tp} by FSDP2"
           if sharded and tp > 1 else
           f", each sharded over its {group} processes by FSDP2" if sharded else
           f", each split over its {tp} processes by tensor parallel" if tp > 1 else
           ", DDP inside each" if group > 1 else ""),
        "memory per process": memory_per_process(model, config, group // tp if sharded else 1, share),

        "inner_steps (H)": f"auto: {config.inner_steps} for the first rounds, then chosen so that waiting for syncs "
        f"stays under {100 * config.max_sync_overhead:g}% of compute" if config.auto_inner_steps
        else str(config.inner_steps),
        **({"note": note} if note else {}),
        "outer optimizer": f"{config.outer_optimizer} lr {config.outer_lr} momentum {config.outer_momentum}"
        + (" Nesterov" if config.outer_nesterov else "")
        + (f", its momentum moved every {config.outer_momentum_delay} syncs (pseudo-gradients × "
           f"{config.outer_delayed_scale:g} in between)" if config.outer_momentum_delay > 1 else "")
        + (f", its momentum restarted every {config.outer_momentum_restart} syncs"
           if config.outer_momentum_restart else ""),
        "inner optimizer": ("muon (weight matrices) + adamw (embeddings, heads, vectors)"
                            if config.inner_optimizer == "muon" else optim)
        + f" lr {config.learning_rate} weight decay {config.weight_decay}, "
        f"warmup {config.warmup_steps}, {schedule}",
        "tokens per inner step per process": ("at most " if trl_of(run, config) else "")
        + f"{tokens_per_step(run, config):,}",
        "pseudo-gradient per round": format_bytes(trainable * 4) + " (fp32)",
        f"sent across replicas per process per round, M={shown}": f"{format_bytes(per_round)} with "
        f"compression {config.compression} ({by_codec['none'] / per_round:.1f}x fewer bytes than fp32)",
        "per round by codec": ", ".join(f"{name} {format_bytes(sent)}" for name, sent in by_codec.items()),
        "streaming": f"{config.num_fragments} fragment(s), one sync every "
        + (f"{config.round_seconds / config.num_fragments:g} s" if config.round_seconds > 0
           else f"{config.inner_steps // config.num_fragments} steps")
        + f" of about {format_bytes(per_round / config.num_fragments)}, overlapped with "
        f"{'auto (from 1)' if config.auto_sync_delay else config.sync_delay} inner step(s)"
        + (" of each replica's own" if config.round_seconds > 0 and config.sync_delay > 0 else "") + "; the end "
        + ("staggered (each fragment's last sync overlapped)" if config.staggered_end
           else "blocking (every fragment syncs at the last step)"),
        f"DDP for the same {config.inner_steps} steps": format_bytes(
            config.inner_steps * ring_all_reduce_bytes(trainable * 4, shown * group)
        ),
    }
    if on_torchft:
        length = f"rounds of {config.round_seconds:g} s of inner steps" if config.round_seconds > 0 \
            else f"rounds of {config.inner_steps} steps"
        if config.max_steps > 0 and config.round_seconds <= 0:
            length += (f", {math.ceil(config.max_steps / config.inner_steps)} rounds in all (one fewer for each "
                       f"that rolls back)")
        plan["outer backend"] = (
            f"torchft: replica {config.replica_id} of {config.num_replicas}, a round needs {config.min_replicas} "
            f"replica(s) then waits up to {config.sync_grace_seconds:g} s for the others; {length}")
    if config.round_seconds > 0:
        plan["rounds"] = (f"time budget: each replica syncs after {config.round_seconds / config.num_fragments:g} s "
                          f"of inner steps, however many it took; the merge weights replicas by their tokens, and "
                          f"the run ends when its fastest replica reaches max_steps={config.max_steps}")
    if run.trainer == "ddp":  # the baseline has no rounds: what it sends is a gradient all-reduce every step
        plan = {key: value for key, value in plan.items() if key in DDP_PLAN_KEYS}
        plan["model"] = plan["model"].replace(" and synced", "")
        plan["sent per process per step (gradient all-reduce)"] = format_bytes(
            ring_all_reduce_bytes(trainable * 4, replicas * group if replicas > 1 else 8))
    return plan


DDP_PLAN_KEYS = ("trainer", "model", "data", "replicas in this launch", "inner optimizer",
                 "tokens per inner step per process")

# Inner optimizer state per parameter value, in values of the parameter's dtype, by TrainingArguments.optim.
OPTIMIZER_STATES = {"adam": 2, "lion": 1, "sgd": 0}


def parameter_shares(model, shards: int = 1, tp: int = 1) -> dict[str, float]:
    """The share of each parameter one process holds: with tensor parallel 1/tp of those the model's tensor-parallel
    plan splits and the whole of the rest, and of that 1/shards (FSDP2 over `shards` processes of the replica)."""
    split = set()
    if tp > 1:
        from .parallel import checked_tensor_parallel_plan

        split = set(checked_tensor_parallel_plan(model, tp))
    return {name: (1 / tp if name in split else 1.0) / shards for name, _ in model.named_parameters()}


def memory_per_process(model, config: DiLoCoConfig, shards: int, share: dict[str, float] | None = None) -> str:
    """The bytes of the tensors one process holds for training, each parameter's `share` of them (see
    parameter_shares; by default 1/shards of each, FSDP2 over a replica, or all): parameters, gradients, inner
    optimizer state (AdamW: two moments; inner_optimizer muon: one momentum per Muon matrix), and the outer state
    (θ_global in fp32 plus the outer optimizer's fp32 buffers). Activations are not counted."""
    from .metrics import format_bytes

    share = share or parameter_shares(model, shards)
    named = list(model.named_parameters())
    parameters = sum(p.numel() * p.element_size() * share[n] for n, p in named)
    gradients = sum(p.numel() * p.element_size() * share[n] for n, p in named if p.requires_grad)
    optim = str(getattr(config.optim, "value", config.optim))
    states = next((count for name, count in OPTIMIZER_STATES.items() if name in optim), None)
    state_bytes = None if states is None else states * gradients
    if config.inner_optimizer == "muon":  # Muon: one momentum buffer per matrix; AdamW's two moments elsewhere
        from .inner import muon_parameter_names

        muon = set(muon_parameter_names(model))
        state_bytes = sum(p.numel() * p.element_size() * share[n] * (1 if n in muon else 2)
                          for n, p in named if p.requires_grad)
    outer_buffers = 2 if config.outer_optimizer == "adamw" else \
        int(config.outer_momentum > 0) + int(config.outer_momentum_delay > 1)  # the delayed momentum's sum
    outer = sum(p.numel() * share[n] for n, p in named if p.requires_grad) * 4 * (1 + outer_buffers)
    split = any(value < 1 for value in share.values())
    inner = "not estimated for " + optim if state_bytes is None else format_bytes(state_bytes)
    total = parameters + gradients + outer + (state_bytes or 0)
    return (f"{format_bytes(total)}: parameters {format_bytes(parameters)}, gradients {format_bytes(gradients)}, "
            f"inner optimizer {inner}, outer state {format_bytes(outer)}"
            + (f" (tensor parallel: the split layers' share, norms and tied embeddings whole; 1/{shards} of that, "
               f"FSDP2)" if split and shards > 1 else
               f" (1/{shards} of each, FSDP2)" if shards > 1 else
               " (tensor parallel: the split layers' share, norms and tied embeddings whole)" if split else "")
            + "; activations not counted")


def trl_of(run: RunArguments, config: DiLoCoConfig) -> str | None:
    """The TRL trainer a run trains with, "sft" or "dpo" (with DiLoCo, or as a TRL recipe's `trainer: ddp`
    baseline, whose config is still TRL's: hf_diloco.recipes.parse_train_args), else None."""
    return run.trainer if run.trainer in TRL_TRAINERS else getattr(config, "trl_trainer", None)


def tokens_per_step(run: RunArguments, config: DiLoCoConfig) -> int:
    """Tokens an inner step takes per process: its blocks, or with a TRL trainer its rows at most (max_length)."""
    length = config.max_length if trl_of(run, config) else run.block_size
    return config.per_device_train_batch_size * config.gradient_accumulation_steps * length


# --- the run ---------------------------------------------------------------------------------------------------------


def train(run: RunArguments, config: DiLoCoConfig, callbacks: Sequence = (), stop_signals: bool = True):
    """Train one process of a run (one replica, or one member of a replica) and save what it produced.

    Every run records its progress for the app (`RunRecorder`: progress.json from the start, phases "loading
    model and data", "waiting for replicas", "training", "finished"; trainer_log.jsonl) and stops on request
    (`<output_dir>/stop.request`, and with `stop_signals`, called from the main thread, SIGUSR1, SIGTERM and
    SIGINT): DiLoCo at the end of a round, as every DiLoCoTrainer does; the `trainer: ddp` baseline after the
    current step (`StopOnRequest`). A request made while the model and data load is honoured at the start.
    Unless `run.verbose`, the console is calm (hf_diloco.console: one progress bar, one line per sync;
    transformers' own progress bars are turned off for the process). `callbacks` are added to the trainer.

    Args:
        run: what to train on and how the process behaves (model, data, task, trainer kind, LoRA, console).
        config: the DiLoCo and Trainer settings (a DiLoCoConfig, TrainingArguments' fields included).
        callbacks: TrainerCallbacks added to the trainer.
        stop_signals: whether SIGUSR1, SIGTERM and SIGINT stop the run at the next sync (main thread only).

    Returns:
        Trainer: the trainer, trained; its model is saved under `config.output_dir`.

    The README's quickstart (`hf-diloco train --config recipes/tiny-pretrain.yaml`) runs this in each process.
    """
    from .files import hold_run_folder
    from .run_callbacks import RunRecorder, StopOnRequest
    from .trainer import graceful_stop_signals

    check_arguments(run, config)
    # Process 0 holds the folder for the run's life: a second run into it stops here, before its clean-up.
    with hold_run_folder(config.output_dir) if config.process_index == 0 else contextlib.nullcontext():
        checkpoint = resolve_checkpoint(config)
        check_output_dir(config)
        recorder, stopper = RunRecorder(config.output_dir), StopOnRequest(config.output_dir)
        if config.process_index == 0:
            recorder.phase("loading model and data")
        with graceful_stop_signals(stopper.request) if stop_signals else contextlib.nullcontext():
            return _train(run, config, checkpoint, recorder, stopper, callbacks, stop_signals)


def _train(run: RunArguments, config: DiLoCoConfig, checkpoint: str | None, recorder, stopper, callbacks: Sequence,
           stop_signals: bool):
    from transformers import Seq2SeqTrainer, Trainer

    from .console import calm, quiet_other_processes
    from .data import build_datasets, build_task_datasets, class_names
    from .run_callbacks import SteadyClock
    from .tasks import CAUSAL_LM, SEQ2SEQ, get_task, task_collator, task_metrics
    from .trainer import DiLoCoSeq2SeqTrainer, DiLoCoTrainer, data_shard

    if not config.should_log:
        import datasets

        datasets.disable_progress_bars()  # one set of progress bars per run, from the main process
    from transformers import set_seed

    set_seed(config.seed)  # every replica builds the same LoRA adapters (and anything else drawn at random)
    if not run.verbose:
        quiet_other_processes(config)
    task = get_task(run.task)
    loaded = build_model(run, class_names(run, task))
    model, tokenizer = loaded.model, loaded.tokenizer
    if loaded.note and config.process_index == 0:
        print(f"[diloco] {loaded.note}", flush=True)
    # A stream is split between DiLoCo's replicas before it is tokenized; the baseline's by accelerate.
    shard = data_shard(config) if run.trainer != "ddp" else None
    if task.name != CAUSAL_LM:
        train_dataset, eval_dataset = build_task_datasets(run, task, tokenizer, model.config)
    else:
        train_dataset, eval_dataset = (trl_datasets if trl_of(run, config) else build_datasets)(run, tokenizer, shard)
    if eval_dataset is None and config.eval_strategy != "no":
        raise ConfigError(
            "eval_strategy asks for evaluation but eval_fraction is 0, so there is nothing to evaluate on."
        )
    clock = SteadyClock()
    common = dict(model=model, args=config, train_dataset=train_dataset, eval_dataset=eval_dataset,
                  processing_class=tokenizer, data_collator=task_collator(task, tokenizer),
                  compute_metrics=task_metrics(task))
    if trl_of(run, config):  # TRL prepares the data (chat template, tokens, its collator)
        from . import trl

        del common["data_collator"]
        if trl_of(run, config) == "dpo":  # its reference: with LoRA the adapter-free model, else a copy of the start
            common["ref_model"] = None if run.lora_r > 0 else copy.deepcopy(model)
        if run.trainer == "ddp":  # the baseline: TRL's own trainer and config, no DiLoCo
            if config.inner_optimizer == "muon":
                raise ConfigError("the trainer: ddp baseline of a TRL recipe trains with TRL's own trainer and its "
                                  "optimizer (optim), which has no muon; set inner_optimizer adamw for the baseline.")
            kind, common["args"] = trl.baseline(config)
            trainer = kind(**common, callbacks=[clock, recorder, stopper, *callbacks])
        else:
            kind = trl.DiLoCoSFTTrainer if run.trainer == "sft" else trl.DiLoCoDPOTrainer
            trainer = kind(**common, callbacks=[clock, recorder, *callbacks], stop_signals=stop_signals)
            if stopper.requested:
                trainer.request_stop()
    elif run.trainer == "diloco":
        # Its own stop handling, at a round boundary for all replicas together; a request made while loading is
        # handed on.
        kind = DiLoCoSeq2SeqTrainer if task.name == SEQ2SEQ else DiLoCoTrainer
        trainer = kind(**common, callbacks=[clock, recorder, *callbacks], stop_signals=stop_signals)
        if stopper.requested:
            trainer.request_stop()
    else:
        # The ordinary Trainer (Seq2SeqTrainer for seq2seq), with the inner optimizer DiLoCo's replicas use (muon:
        # its own).
        baseline = Seq2SeqTrainer if task.name == SEQ2SEQ else Trainer
        if config.inner_optimizer == "muon":
            from .inner import InnerOptimizer

            baseline = type("MuonTrainer", (InnerOptimizer, baseline), {})
        trainer = baseline(**common, callbacks=[clock, recorder, stopper, *callbacks])
    if not run.verbose:
        calm(trainer)
    if trainer.is_world_process_zero():
        if config.bf16 and trainer.accelerator.device.type == "cpu":  # a GPU recipe where there is no GPU, say
            weights = str(next(model.parameters()).dtype).removeprefix("torch.")
            print(f"[diloco] bf16 on the CPU: bfloat16 autocast, weights in {weights}", flush=True)
        write_run_config(config.output_dir, run, config)
    output = trainer.train(resume_from_checkpoint=checkpoint)
    trainer.save_model()
    if trainer.is_world_process_zero():
        write_run_metrics(config.output_dir, trainer, {**output.metrics, **clock.metrics(tokens_per_step(run, config))})
        if run.lora_r > 0 and run.merge_lora:
            merged = Path(config.output_dir) / "merged"
            model.merge_and_unload().save_pretrained(merged)
            tokenizer.save_pretrained(merged)
    return trainer


def trl_datasets(run: RunArguments, tokenizer, shard: tuple[int, int] | None = None):
    """The rows TRL's trainers take as they are stored (conversations, or prompt/chosen/rejected pairs): the last
    `eval_fraction` held out, or streamed, the first `eval_blocks` rows held out and the others split between the
    replicas (`shard`) before TRL tokenizes them. The tokenizer must render chats (the byte tokenizer is given
    its chat template)."""
    from .data import held_out_stream, load_raw_dataset, split_held_out
    from .models import give_chat_template

    if not give_chat_template(tokenizer):
        raise ConfigError(f"trainer {run.trainer} renders conversations with the tokenizer's chat template, and the "
                          f"tokenizer of {run.model_name_or_path!r} has none; name one that has with "
                          f"tokenizer_name_or_path.")
    if run.streaming:
        return held_out_stream(run, shard)
    rows = load_raw_dataset(run.dataset_name, run.dataset_config)
    return split_held_out(rows, run.eval_fraction)


def write_run_config(output_dir: str, run: RunArguments, config: DiLoCoConfig) -> None:
    """`run_config.json`: the model/data arguments and the settings the model card shows (no tokens)."""
    from .hub import RUN_CONFIG_FILE, run_settings

    write_json(Path(output_dir) / RUN_CONFIG_FILE, run_settings(config, run))  # every value is plain (hub._plain)


def write_run_metrics(output_dir: str, trainer, train_metrics: dict) -> None:
    """`run_metrics.json`: Trainer's end-of-training numbers, the last eval loss, and this process's peak memory.

    Written for every trainer (DiLoCo or the DDP baseline), so baselines and DiLoCo runs compare from one file.
    """
    import resource

    evals = [entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry]
    metrics = {
        "global_step": trainer.state.global_step,
        "eval_loss": evals[-1] if evals else None,
        "eval_loss_initial": evals[0] if evals else None,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # Linux reports kB
        **train_metrics,
    }
    write_json(Path(output_dir) / RUN_METRICS_FILE, metrics)
