"""DiLoCoTrainer: `transformers.Trainer` glue for the DiLoCo outer loop.

Each process is one replica (or one member of a replica group). Trainer runs the inner loop untouched (its
optimizer, scheduler, gradient accumulation, clipping, mixed precision); this module adapts Trainer where DiLoCo
needs it, and the outer loop itself is hf_diloco.rounds' callback (schedule, backend, round, records).

Design choices:
- No DDP across replicas. Accelerate would wrap the model in DistributedDataParallel and all-reduce gradients
  every step; the trainer prepares the model the way Accelerate prepares a model for evaluation (mixed precision
  and compilation only), with DDP over the replica's own processes when a replica has several. The data loader is
  still sharded, so each replica reads its own disjoint batches.
- No hidden per-step collective. Trainer averages the logged loss over processes with an all-gather; here each
  replica logs its own loss, and the mean over replicas is reported once per round with the sync. Token-count
  gathers are switched off in DiLoCoConfig.
- The outer step runs in `on_step_end`, after the inner optimizer and scheduler stepped and before Trainer logs,
  evaluates or saves, so evaluations and checkpoints see θ_global.
- Checkpoints are Trainer's (`checkpoint-<step>`), plus each replica's own inner optimizer and scheduler state
  (`process-<rank>/`) and the outer state (`diloco_outer.pt`: θ_global in fp32 and the outer optimizer); a marker
  written last says one is whole (hf_diloco.checkpoints).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path

import torch
from accelerate import ParallelismConfig
from transformers import Trainer

from . import checkpoints
from .comm import ReplicaComm
from .config import ConfigError, DiLoCoConfig
from .data import ReplicaSliceSampler
from .rounds import OuterLoopCallback
from .runs import PROGRESS_FILE

logger = logging.getLogger(__name__)

OUTER_STATE_FILE = "diloco_outer.pt"
REPLICA_STATE_FILE = "diloco_replica.pt"


@contextlib.contextmanager
def _replica_local_loss_logging():
    """Make Trainer log this replica's own training loss instead of all-gathering it from every process.

    Trainer's logging calls the module-level `nested_gather`; swapping it for the identity while Trainer logs
    removes a collective per logging step. Nothing else in Trainer uses that name.
    """
    import transformers.trainer as trainer_module

    original = trainer_module.nested_gather
    trainer_module.nested_gather = lambda tensors, parallel_mode, name=None: tensors
    try:
        yield
    finally:
        trainer_module.nested_gather = original


class ReplicaSharding(ParallelismConfig):
    """Accelerate's parallelism configuration for sharded replicas: FSDP2 over each replica's `dp_shard` processes
    only. Accelerate's HSDP would also all-reduce every step's gradients over `dp_replicate`, the replicas; DiLoCo
    replaces that dimension's per-step all-reduce with its outer syncs, so FSDP's mesh leaves it out.

    With tensor parallel beside FSDP2 the mesh keeps its `tp` dimension, but accelerate's own tensor-parallel
    preparation stays off: DiLoCoTrainer splits the layers on this mesh before accelerate sees the model (accelerate
    1.15's preparation also imports a class transformers 5.23 no longer has), and FSDP2 then shards each piece."""

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


def _local_shards(value):
    """`value` (a state dict) with every DTensor replaced by this process's local shard."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.to_local().detach().clone()
    if isinstance(value, dict):
        return {key: _local_shards(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_local_shards(item) for item in value)
    return value


@torch.no_grad()
def _as_parameter_shards(optimizer: torch.optim.Optimizer) -> None:
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


def _fsdp2_over_gloo(accelerator, sharding: ReplicaSharding, args: DiLoCoConfig) -> None:
    """Sharded replicas on CPU processes: accelerate 1.15 enables FSDP only on accelerators (its CPU state is
    MULTI_CPU), although FSDP2 itself runs over gloo. Give the accelerator's state the FSDP2 plugin (from the
    training arguments, or from the accelerate config's environment), the parallelism config and its CPU device
    mesh, so that Trainer and accelerate prepare, save and load the model exactly as they do on GPUs."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = accelerator.state
    state.fsdp_plugin = FullyShardedDataParallelPlugin(**(args.fsdp_plugin_args or {}))
    # The accelerator's state copies the process state's type whenever it is made again: set both.
    state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    state.parallelism_config = sharding
    state.device_mesh = sharding.get_device_mesh("cpu")


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
        raise ConfigError(f"tp_size={tp_size}: {type(model).__name__} has no tensor-parallel plan in transformers, so "
                          f"its layers cannot be split; use FSDP2 inside the replica instead.")
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


class DiLoCoTrainer(Trainer):
    """`Trainer` that trains each process as a DiLoCo replica and averages replicas every `inner_steps` steps.

    Takes exactly what `Trainer` takes; `args` must be a `DiLoCoConfig`.

    Example (a runnable version is in the README's "Python" section)::

        trainer = DiLoCoTrainer(model=model, args=DiLoCoConfig(output_dir="out", inner_steps=50),
                                train_dataset=train, eval_dataset=held_out)
        trainer.train()
    """

    def __init__(self, model=None, args: DiLoCoConfig | None = None, *pargs, **kwargs):
        if args is None:
            args = DiLoCoConfig(output_dir="trainer_output")
        if not isinstance(args, DiLoCoConfig):
            raise TypeError(f"DiLoCoTrainer needs a DiLoCoConfig as args, got {type(args).__name__}.")
        if args.sharded_replica:
            args.parallelism_config = replica_sharding(args)
        if args.tensor_parallel:
            if model is None:
                raise ConfigError("tensor parallel (tp_size > 1) splits the model DiLoCoTrainer is given, so pass "
                                  "model=...; a model_init is not supported with it.")
            model = apply_tensor_parallel(model, args)
        super().__init__(model, args, *pargs, **kwargs)
        # Creates the replica/slice process groups (and the background sync's own, with sync_delay > 0). A
        # tensor-parallel replica syncs like a sharded one: each process its own pieces, with the same-rank process
        # of every other replica.
        self.comm = ReplicaComm(args.replica_group_size, background=args.sync_delay > 0,
                                timeout_seconds=args.sync_timeout,
                                sharded=args.sharded_replica or args.tensor_parallel)
        if args.outer_backend == "torchft" and self.comm.num_replicas != 1:
            processes = self.comm.num_replicas * self.comm.group_size
            raise ConfigError(f"outer_backend torchft starts one launch per replica, so the {processes} processes of "
                              f"this launch are one replica: set replica_group_size {processes} (or launch one "
                              f"process per replica).")
        self.diloco = OuterLoopCallback(self)
        self.add_callback(self.diloco)

    # --- no DDP: a replica trains alone between syncs ---------------------------------------------------------

    def create_accelerator_and_postprocess(self) -> None:
        sharding = self.args.parallelism_config if self.args.sharded_replica else None
        on_cpu = sharding is not None and self.args.device.type == "cpu"
        # Accelerate takes a parallelism config on accelerators only (FSDP2 on CPU: handed over below); tensor
        # parallel is applied by DiLoCoTrainer inside each replica, so accelerate sees none (an accelerate
        # config's would make it build a mesh over every process).
        hide = on_cpu or (self.args.tensor_parallel and sharding is None)
        if hide:
            self.args.parallelism_config = None
            from_env = os.environ.pop("ACCELERATE_USE_PARALLELISM_CONFIG", None)
        super().create_accelerator_and_postprocess()
        if hide and from_env is not None:
            os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"] = from_env
        if on_cpu:
            self.args.parallelism_config = sharding
            _fsdp2_over_gloo(self.accelerator, sharding, self.args)
            self.is_fsdp_enabled = True
        prepare_model = self.accelerator.prepare_model

        def prepare_replica(model, device_placement=None, evaluation_mode=False):
            # evaluation_mode=True: device placement, mixed precision and compilation, but no DDP wrapper over
            # all processes, so no gradient all-reduce across replicas and no buffer broadcast on every step.
            model = prepare_model(model, device_placement=device_placement, evaluation_mode=True)
            if self.comm.replica_group is not None and not evaluation_mode and not self.args.tensor_parallel:
                # A replica of several processes: DDP inside the replica only.
                device_ids = [torch.cuda.current_device()] if self.args.device.type == "cuda" else None
                model = torch.nn.parallel.DistributedDataParallel(
                    model, device_ids=device_ids, process_group=self.comm.replica_group, broadcast_buffers=False
                )
            return model

        self.accelerator.prepare_model = prepare_replica

    @property
    def data_shard(self) -> tuple[int, int]:
        """(this process's shard, number of shards): its place in the launch, or with torchft (one launch per
        replica of g processes) member j of replica_id r takes shard r·g + j of num_replicas·g, the shard the same
        process has in a torch launch of num_replicas·g processes. Tensor parallel: the processes of a replica
        compute on the same batches: the tp_size processes of one piece-set take one shard (replica r of a tensor-
        parallel replica takes shard r of the replicas; with FSDP2 beside it, shard r·dp_shard + d)."""
        tp = self.args.tp_size
        if self.args.outer_backend == "torchft":
            g = self.args.replica_group_size // tp
            return self.args.replica_id * g + self.args.process_index // tp, self.args.num_replicas * g
        return self.args.process_index // tp, self.args.world_size // tp

    def _get_train_sampler(self, train_dataset=None):
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        index, count = self.data_shard
        if self.args.data_sharding == "non_iid" and count > 1:
            return ReplicaSliceSampler(
                len(dataset), index, count, self.args.seed,
                shuffle=self.args.train_sampling_strategy != "sequential",
            )
        return super()._get_train_sampler(train_dataset)

    def get_train_dataloader(self):
        if self.args.data_sharding == "non_iid" and not hasattr(self.train_dataset, "__len__"):
            raise ConfigError(
                "data_sharding non_iid cuts the corpus into one contiguous slice per replica, which a streamed "
                "dataset does not have; set streaming: false or data_sharding: iid."
            )
        if self.args.outer_backend == "torchft" or self.args.tensor_parallel:
            loader = self._one_shard_of_several(super().get_train_dataloader)
        else:
            loader = super().get_train_dataloader()
        # A ReplicaSliceSampler already picks this replica's examples; Accelerate's batch sharding on top would
        # keep only every M-th of its batches, so that wrapper is made a pass-through.
        shard = getattr(loader, "batch_sampler", None)
        inner = getattr(getattr(shard, "batch_sampler", None), "sampler", None)
        if isinstance(inner, ReplicaSliceSampler):
            shard.num_processes, shard.process_index = 1, 0
        return loader

    def get_eval_dataloader(self, eval_dataset=None):
        if self.args.tensor_parallel:  # the processes of a replica evaluate the same batches together
            return self._one_shard_of_several(lambda: super(DiLoCoTrainer, self).get_eval_dataloader(eval_dataset))
        return super().get_eval_dataloader(eval_dataset)

    def _one_shard_of_several(self, make_loader):
        """The loader `make_loader` builds, cut into `data_shard`'s shards instead of one per process. torchft: one
        launch per replica, so Accelerate sees one process; shard the batches as it would for num_replicas
        processes (replica r takes batches r, r + M, ...), exactly as the torch backend does. Tensor parallel: the
        tp_size processes of a replica take the same shard."""
        import accelerate.accelerator as accelerator_module

        prepare = accelerator_module.prepare_data_loader
        index, count = self.data_shard

        def sharded(*args, **kwargs):
            # No device mesh: with one it would recount the processes from the launch's own mesh (one replica).
            return prepare(*args, **{**kwargs, "num_processes": count, "process_index": index,
                                     "torch_device_mesh": None})

        accelerator_module.prepare_data_loader = sharded
        try:
            return make_loader()
        finally:
            accelerator_module.prepare_data_loader = prepare

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.diloco.observe_micro_batch(loss, inputs)
        return loss

    def _maybe_log_save_evaluate(self, *args, **kwargs):
        with _replica_local_loss_logging():
            return super()._maybe_log_save_evaluate(*args, **kwargs)

    def get_tp_size(self) -> int:
        """1: Trainer divides each batch's token count by this for processes that share a batch, which only an
        all-gathered count (average_tokens_across_devices, off in DiLoCoConfig) over-counts. A tensor-parallel
        replica's processes each compute the whole loss of their batch, which must not be scaled."""
        return 1

    def get_total_train_batch_size(self, args) -> int:
        """Sequences per inner step over all replicas: the processes of one tensor-parallel piece-set share a batch."""
        return self._train_batch_size * args.gradient_accumulation_steps * (args.world_size // args.tp_size)

    def store_flos(self) -> None:
        # Trainer sums the floating point operations of all processes with an all-gather at every log. Replicas
        # run the same number of steps on batches of the same shape, so this process's count times the number of
        # processes with batches of their own is the total, with no collective. Tensor parallel: the processes of
        # a replica compute one batch together, and each counts the whole model's operations for it.
        self.state.total_flos += self.current_flos * (self.args.world_size // self.args.tp_size)
        self.current_flos = 0

    def train(self, *args, **kwargs):
        """Trainer.train, after recording the run's settings in `<output_dir>/run_config.json` (main process) unless
        `hf-diloco train` already wrote a fuller one: `hf-diloco push` and the app describe any run folder, however
        it was trained."""
        if self.is_world_process_zero():
            from .hub import RUN_CONFIG_FILE, trainer_settings

            path = Path(self.args.output_dir) / RUN_CONFIG_FILE
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(trainer_settings(self), indent=2, default=str) + "\n")
        return super().train(*args, **kwargs)

    def create_model_card(self, *args, **kwargs) -> None:
        """The DiLoCo card of hf_diloco.hub (settings table, metrics, curve), as `hf-diloco push` writes it.

        The settings come from this trainer's own args, so a trainer used from Python gets the full card.
        """
        if not self.is_world_process_zero():
            return
        from .hub import CARD_FILE, CURVE_FILE, model_card, trainer_settings, write_training_curve

        output_dir = Path(self.args.output_dir)
        write_training_curve(output_dir, output_dir / CURVE_FILE)
        card = model_card(output_dir, self.hub_model_id, settings=trainer_settings(self))
        (output_dir / CARD_FILE).write_text(card)

    # --- checkpoints: every replica's inner state plus the outer state ----------------------------------------

    def _save_checkpoint(self, model, trial) -> None:
        """Trainer's checkpoint, named and written by Trainer (`checkpoint-<step>`), marked complete only when whole.

        The process that saves for its filesystem clears the folder and leaves a note before any process writes
        (a barrier through the rendezvous store); every process writes its part and marks it; once every process
        has said so (the store again), the saving process writes the marker, then rotates. A process killed at any
        instant leaves a folder without the marker, which resume and rotation ignore (see hf_diloco.checkpoints).
        """
        step = self.state.global_step
        run_dir = Path(self._get_output_dir(trial=trial))
        folder = run_dir / f"{checkpoints.CHECKPOINT_PREFIX}{step}"
        # One process per filesystem, as Trainer saves: the main process, or each machine's with save_on_each_node
        # (machines without a shared filesystem).
        if self.args.should_save:
            checkpoints.begin(folder)
        self.comm.wait_for_parts(f"{folder.name}/begun", self.args.sync_timeout)
        # Trainer 5.23 rotates at the end of its _save_checkpoint by calling trainer_utils.rotate_checkpoints, a
        # module function rather than a method to override (4.x had Trainer._rotate_checkpoints). It would run
        # before the marker exists, count the folder being saved, order folders by mtime and delete with rmtree.
        # Until Trainer offers a rotation hook, it sees no limit while it saves, and checkpoints.rotate runs once
        # the checkpoint is whole. tests/test_checkpoints.py checks that Trainer still rotates there and that
        # this keeps it from doing so.
        limit, self.args.save_total_limit = self.args.save_total_limit, None
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        checkpoints.finish_part(self._replica_dir(str(folder)))
        self.comm.wait_for_parts(folder.name, self.args.sync_timeout)
        if self.args.should_save:
            checkpoints.mark_complete(folder, step, self.args.world_size)
            if limit:
                checkpoints.rotate(run_dir, limit, self.state.best_model_checkpoint)

    def _replica_dir(self, checkpoint: str) -> Path:
        return checkpoints.part_dir(checkpoint, self.args.process_index)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Tensor parallel: every process gathers its replica's full weights (a collective inside the replica only),
        then the saving process writes an ordinary consolidated model."""
        if self.args.tensor_parallel and state_dict is None:
            from torch.distributed.tensor import DTensor

            model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
            state_dict = {name: (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu()
                          for name, value in model.state_dict().items()}
            if not self.args.should_save:
                return
        return super()._save(output_dir, state_dict)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        """Sharded replicas: every process reads the checkpoint's consolidated weights and keeps its shards (the
        round's θ_global and the replica's own parameters are then restored from the DiLoCo state on top)."""
        if not (self.args.sharded_replica or self.args.tensor_parallel):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        files = sorted(Path(resume_from_checkpoint).glob("model*.safetensors"))
        if not files:
            raise ConfigError(f"checkpoint {resume_from_checkpoint} holds no model.safetensors to resume from.")
        weights = {name: tensor for file in files for name, tensor in load_file(file).items()}
        set_model_state_dict(model if model is not None else self.model_wrapped, weights,
                             options=StateDictOptions(full_state_dict=True, strict=False))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        replica_dir = self._replica_dir(output_dir)
        replica_dir.mkdir(parents=True, exist_ok=True)
        # A sharded replica's optimizer holds DTensors: each process writes its own shards as plain tensors.
        torch.save(_local_shards(self.optimizer.state_dict()), replica_dir / "optimizer.pt")
        torch.save(self.lr_scheduler.state_dict(), replica_dir / "scheduler.pt")
        replica_state = self.diloco.replica_state()
        if replica_state:
            torch.save(replica_state, replica_dir / REPLICA_STATE_FILE)
        if self.diloco.outer is not None:
            # θ_global and the outer optimizer: one copy. Sharded replicas: replica 0's member j writes shard j
            # beside its part, which member j of every replica reads on resume.
            if self.comm.sharded and self.comm.replica_index == 0:
                torch.save(self.diloco.outer.state_dict(), replica_dir / OUTER_STATE_FILE)
            elif not self.comm.sharded and self.args.should_save:
                torch.save(self.diloco.outer.state_dict(), Path(output_dir) / OUTER_STATE_FILE)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        replica_dir = self._replica_dir(checkpoint)
        if (replica_dir / "optimizer.pt").exists():
            # Loaded to CPU; the optimizer moves its state next to the parameters.
            state = torch.load(replica_dir / "optimizer.pt", map_location="cpu", weights_only=True)
            self.optimizer.load_state_dict(state)
            _as_parameter_shards(self.optimizer)
            self.lr_scheduler.load_state_dict(torch.load(replica_dir / "scheduler.pt", weights_only=True))
        else:
            # A checkpoint written by plain Trainer (or by a run with fewer replicas): take what it has.
            super()._load_optimizer_and_scheduler(checkpoint)
        self.diloco.resumed_from = str(checkpoint)
        progress = Path(self.args.output_dir) / PROGRESS_FILE  # the step the interrupted run had reached
        with contextlib.suppress(OSError, ValueError, KeyError):
            self.diloco.reached_before_resume = int(json.loads(progress.read_text())["step"])
        replica_file = replica_dir / REPLICA_STATE_FILE
        self.diloco.saved_replica_state = torch.load(replica_file, weights_only=True) if replica_file.exists() else None
        outer_file = (checkpoints.part_dir(checkpoint, self.comm.member) if self.comm.sharded
                      else Path(checkpoint)) / OUTER_STATE_FILE
        self.diloco.saved_outer_state = torch.load(outer_file, weights_only=True) if outer_file.exists() else None

