"""Every remaining patch of an upstream API (transformers 5.24, accelerate 1.15, torchft 0.2.0), in one place.

DiLoCo needs Trainer, accelerate and torchft to do a few things they have no option for: keep a replica's processes
apart from the other replicas' between syncs, leave checkpoint rotation to a saver that knows when a checkpoint is
whole, and listen only on the address a run was given. Each function here patches one upstream API for that, and
its docstring says what it patches, why, and which upstream change would let it go. tests/test_compat.py has one
test per patch that fails when upstream no longer behaves as the patch assumes: then the patch is either broken or
no longer needed. Nothing else in hf_diloco writes to transformers', accelerate's or torchft's modules, objects or
state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def replica_local_loss_logging() -> Iterator[None]:
    """While Trainer logs: this process's training loss, not its mean over every process of the launch.

    Patches `transformers.trainer.nested_gather`, the module-level name Trainer's `_maybe_log_save_evaluate` calls
    to all-gather the loss at every logging step, with the identity (nothing else in Trainer calls it).
    Why: that all-gather is a collective across replicas between syncs; each replica logs its own loss, and the
    mean over replicas is reported once per round with the sync.
    Waits for: Trainer logging a process-local loss when asked (no argument or method for it in transformers 5.24).
    """
    import transformers.trainer as trainer_module

    original = trainer_module.nested_gather
    trainer_module.nested_gather = lambda tensors, parallel_mode, name=None: tensors
    try:
        yield
    finally:
        trainer_module.nested_gather = original


@contextlib.contextmanager
def replica_local_metric_gathers(accelerator) -> Iterator[None]:
    """While a training step runs: `accelerator.gather` and `accelerator.gather_for_metrics` give back this
    process's own values, as they do in a launch of one process.

    Patches the two methods on this trainer's `Accelerator` instance (its attributes, removed afterwards), which
    trainers built on Trainer call inside `compute_loss` to average their logged metrics over every process at every
    micro-batch (TRL 1.16's SFTTrainer: token counts, entropy and accuracy, 4 all-gathers a step; DPOTrainer: its
    rewards, log-probabilities and accuracies, 15).
    Why: those gathers are collectives across replicas between syncs; each replica logs its own metrics.
    Evaluation, and what a trainer gathers once while it is built (DPO's reference log-probabilities), are left as
    they are.
    Waits for: an option of those trainers to log process-local metrics (none in TRL 1.16).
    """
    accelerator.gather = lambda tensor: tensor
    accelerator.gather_for_metrics = lambda data, use_gather_object=False: data
    try:
        yield
    finally:
        del accelerator.gather, accelerator.gather_for_metrics


@contextlib.contextmanager
def data_loader_shard(index: int, count: int) -> Iterator[None]:
    """While data loaders are prepared: cut each into `count` shards of batches and give this process shard `index`
    (shard r holds batches r, r + count, ...), whatever processes accelerate sees.

    Patches `accelerate.accelerator.prepare_data_loader`, the module-level function `Accelerator.prepare_data_loader`
    calls, with one that overrides its `num_processes`, `process_index` and `torch_device_mesh` (with a mesh it
    would count the processes again from the mesh).
    Why: accelerate shards by its own processes. With torchft each replica is a launch of its own, so accelerate
    sees one replica where DiLoCo needs one shard per replica; with tensor parallel the processes of a replica
    compute on the same batches. A stream DiLoCo already split between replicas (datasets' `split_dataset_by_node`)
    is prepared as shard 0 of 1, so accelerate neither shards it again nor reads every batch on each process.
    Waits for: `Accelerator.prepare_data_loader` taking the shard to read (accelerate 1.15 takes none).
    """
    import accelerate.accelerator as accelerator_module

    prepare = accelerator_module.prepare_data_loader

    def sharded(*args, **kwargs):
        return prepare(*args, **{**kwargs, "num_processes": count, "process_index": index, "torch_device_mesh": None})

    accelerator_module.prepare_data_loader = sharded
    try:
        yield
    finally:
        accelerator_module.prepare_data_loader = prepare


def node_split(dataset) -> tuple[int, int] | None:
    """(rank, world size) a `datasets.IterableDataset` was split for by `split_dataset_by_node`, or None.

    Reads the stream's private `_distributed` (datasets 5.2). Why: DiLoCo splits a stream between replicas itself
    and must neither split one twice nor keep one split for another layout.
    Waits for: a public accessor in datasets.
    """
    distributed = getattr(dataset, "_distributed", None)
    return None if distributed is None else (distributed.rank, distributed.world_size)


def pass_through_batch_sharding(loader) -> None:
    """Make the batch sharding accelerate put around `loader`'s batch sampler hand on every batch.

    Patches the `num_processes` and `process_index` of accelerate's `BatchSamplerShard` (read at each iteration)
    to 1 and 0. Why: a sampler that already picks this process's examples (hf_diloco.data.ReplicaSliceSampler, one
    contiguous slice per replica) would otherwise keep only every M-th of its batches.
    Waits for: a way to tell accelerate that a sampler is already sharded (none in accelerate 1.15).
    """
    loader.batch_sampler.num_processes, loader.batch_sampler.process_index = 1, 0


@contextlib.contextmanager
def parallelism_config_hidden(args) -> Iterator[None]:
    """While Trainer creates its Accelerator: no parallelism config, neither `args.parallelism_config` nor the one
    `accelerate launch` announces through the environment (ACCELERATE_USE_PARALLELISM_CONFIG).

    Patches what Trainer and accelerate read to build the launch's device mesh. Why: accelerate 1.15 accepts a
    parallelism config on accelerators only (FSDP2 on CPU processes is handed over by `fsdp2_over_gloo`), and with
    tensor parallel alone it would build its mesh over every process of the launch, while DiLoCoTrainer splits each
    replica on a mesh of its own (hf_diloco.parallel).
    Waits for: accelerate taking a parallelism config on CPU processes (gloo), and one whose tensor-parallel mesh is
    a replica's processes rather than the launch's.
    """
    config, args.parallelism_config = args.parallelism_config, None
    from_env = os.environ.pop("ACCELERATE_USE_PARALLELISM_CONFIG", None)
    try:
        yield
    finally:
        args.parallelism_config = config
        if from_env is not None:
            os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"] = from_env


def fsdp2_over_gloo(trainer, sharding) -> None:
    """Turn the trainer's accelerator, made for CPU processes (MULTI_CPU), into an FSDP2 one over `sharding`'s mesh.

    Patches the accelerator's state: its FSDP plugin (from the training arguments, or from the accelerate config's
    environment), `distributed_type` (and `PartialState._shared_state`'s, which a state made again copies), the
    parallelism config and its CPU device mesh; and Trainer's `is_fsdp_enabled`, read from the state before.
    Why: accelerate enables FSDP only on accelerators, although FSDP2 itself runs over gloo; with this Trainer and
    accelerate prepare, save and load a sharded replica on CPU exactly as on GPUs (tests, and CPU-only machines).
    Waits for: accelerate enabling FSDP on MULTI_CPU processes (accelerate 1.15 does on accelerator types only).
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    state.fsdp_plugin = FullyShardedDataParallelPlugin(**(trainer.args.fsdp_plugin_args or {}))
    state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    state.parallelism_config = sharding
    state.device_mesh = sharding.get_device_mesh("cpu")
    trainer.is_fsdp_enabled = True


def prepare_models_without_ddp(accelerator, wrap: Callable) -> None:
    """Make `accelerator` prepare every model as it prepares one for evaluation (device placement, mixed precision
    and compilation), then hand a model prepared for training to `wrap(model)` (e.g. DDP inside the replica).

    Patches `accelerator.prepare_model` (an instance attribute over the method, which `Accelerator.prepare` and
    Trainer call through the instance). Why: prepared for training, accelerate wraps the model in DDP over every
    process of the launch, an all-reduce of the gradients across replicas at every step and a broadcast of the
    buffers. FSDP2 preparation does not go through `prepare_model` and is unaffected.
    Waits for: a way to prepare a model for training without DDP, or with DDP over a given process group (none in
    accelerate 1.15 or Trainer 5.24).
    """
    prepare_model = accelerator.prepare_model

    def prepare_replica(model, device_placement=None, evaluation_mode=False):
        model = prepare_model(model, device_placement=device_placement, evaluation_mode=True)
        return model if evaluation_mode else wrap(model)

    accelerator.prepare_model = prepare_replica


@contextlib.contextmanager
def trainer_rotation_off(args) -> Iterator[int | None]:
    """While Trainer saves a checkpoint: no `save_total_limit`, so Trainer removes no checkpoint. Yields the limit,
    for the caller to rotate by once the checkpoint is whole (hf_diloco.checkpoints.rotate).

    Patches `args.save_total_limit`. Why: Trainer 5.x rotates at the end of `_save_checkpoint` by calling
    `trainer_utils.rotate_checkpoints`, a module function (4.x had the method `Trainer._rotate_checkpoints`): it
    would run before the checkpoint's completion marker exists, count the folder being saved and unfinished ones,
    order folders by mtime and delete a complete checkpoint.
    Waits for: a rotation hook in Trainer (a method to override, or a predicate for which folders count).
    """
    limit, args.save_total_limit = args.save_total_limit, None
    try:
        yield limit
    finally:
        args.save_total_limit = limit


def trainer_tp_size() -> int:
    """What DiLoCoTrainer answers to Trainer's `get_tp_size()`: 1, whatever the replica's tensor-parallel size.

    Patches `Trainer.get_tp_size`. Why: Trainer 5.24 divides each batch's token count (`num_items_in_batch`, by
    which the loss is normalized) by `get_tp_size()` in `_get_num_items_in_batch` even when the count is this
    process's own, not all-gathered (`average_tokens_across_devices`, which DiLoCoConfig turns off); the processes
    of a tensor-parallel replica each compute their batch's whole loss, which must not be scaled. Trainer also
    reads it for the total batch size, which DiLoCoTrainer therefore counts itself.
    Waits for: Trainer dividing by the tensor-parallel size only the counts it gathered across processes.
    """
    return 1


def dispatch_log(trainer, logs: dict, step: int, skip: tuple[type, ...] = ()) -> None:
    """Hand `logs` to the `on_log` of the trainer's callbacks as if Trainer had logged them at `step`: every
    tracker of `report_to` (TensorBoard, trackio, W&B, MLflow, ...) records them at that step. Left out: Trainer's
    console printers and flow callback, and the callbacks of the classes in `skip`. Trainer's own state, control
    and log history are not touched.

    Patches `CallbackHandler`'s dispatch: it calls each callback's `on_log` itself, with the arguments
    `CallbackHandler.call_event` passes (the trainer's current model, optimizer and scheduler). Why: `Trainer.log`
    and `CallbackHandler.on_log` reach every callback, printers included, at the trainer's current step, and reset
    `control.should_log`; a round's metrics belong to the round's step and are printed already.
    Waits for: Trainer logging metrics to its trackers at a given step without printing them (none in 5.24).
    """
    from transformers.trainer_callback import DefaultFlowCallback, PrinterCallback, ProgressCallback

    handler = trainer.callback_handler
    at_step = dataclasses.replace(trainer.state, global_step=step)
    left_out = (DefaultFlowCallback, PrinterCallback, ProgressCallback, *skip)
    for callback in handler.callbacks:
        if not isinstance(callback, left_out):
            callback.on_log(trainer.args, at_step, trainer.control, logs=dict(logs), model=trainer.model,
                            processing_class=trainer.processing_class, optimizer=trainer.optimizer,
                            lr_scheduler=trainer.lr_scheduler, train_dataloader=handler.train_dataloader,
                            eval_dataloader=handler.eval_dataloader)


def bound_address(host: str, port: int | str) -> str:
    """`host:port` as torchft's Rust servers and gRPC take it (an IPv6 address in brackets).

    >>> bound_address("127.0.0.1", 0), bound_address("::1", 7)
    ('127.0.0.1:0', '[::1]:7')
    """
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@contextlib.contextmanager
def torchft_listeners_on(host: str) -> Iterator[None]:
    """While a torchft Manager and its checkpoint transport are built: their servers listen on `host` only.

    Patches two module-level names torchft 0.2.0 binds through: `torchft.manager.ManagerServer`, which
    `Manager.__init__` hands `bind="[::]:PORT"` (every interface, no argument to change it), with one that keeps the
    port and binds `host`; and `torchft.checkpointing.http_transport._IPv6HTTPServer`, which `HTTPTransport.__init__`
    builds on `("", 0)` (every interface) and starts serving, with a server of `host`'s address family bound to
    `(host, PORT)`.
    Why: a replica's manager takes unauthenticated gRPC calls (`Kill` ends the replica) and its transport serves the
    model; on a shared network neither may be reachable beyond the address the run was given.
    Waits for: `Manager` and `HTTPTransport` taking a bind address (torchft 0.2.0 takes none).
    """
    import socket
    from http.server import ThreadingHTTPServer

    import torchft.checkpointing.http_transport as transport_module
    import torchft.manager as manager_module

    manager_server, http_server = manager_module.ManagerServer, transport_module._IPv6HTTPServer

    def bound_manager_server(*args, bind: str, **kwargs):
        return manager_server(*args, bind=bound_address(host, bind.rsplit(":", 1)[1]), **kwargs)

    class BoundHTTPServer(ThreadingHTTPServer):
        address_family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
        request_queue_size = http_server.request_queue_size

        def __init__(self, server_address, handler, *args, **kwargs):
            super().__init__((host, server_address[1]), handler, *args, **kwargs)

    manager_module.ManagerServer, transport_module._IPv6HTTPServer = bound_manager_server, BoundHTTPServer
    try:
        yield
    finally:
        manager_module.ManagerServer, transport_module._IPv6HTTPServer = manager_server, http_server


@contextlib.contextmanager
def rendezvous_store_on_its_address() -> Iterator[None]:
    """While `accelerate launch` runs torchrun's agent in this process: the static rendezvous store listens on the
    address the processes meet at (`main_process_ip`, else 127.0.0.1) only.

    Patches `torch.distributed.elastic.rendezvous.static_tcp_rendezvous.TCPStore`, the name the static rendezvous
    (every shipped accelerate config's `rdzv_backend`) builds its store through, with one that hands the machine of
    rank 0's store a socket already bound to that address and listening (`master_listen_fd`); other machines'
    agents connect as before.
    Why: a TCPStore server binds every interface unless handed a socket, and its keys steer the launch's processes.
    Waits for: torchrun's rendezvous taking a bind address (torch 2.13 takes none).
    """
    import torch.distributed.elastic.rendezvous.static_tcp_rendezvous as static_module

    store_class = static_module.TCPStore
    static_module.TCPStore = store_bound_to_its_host(store_class)
    try:
        yield
    finally:
        static_module.TCPStore = store_class


def env_rendezvous_store_on_its_address() -> None:
    """For this process: a TCPStore that rank 0 serves for an `env://` rendezvous without torchrun's agent (MPI's
    launch: accelerate's mpirun path sets MASTER_ADDR and MASTER_PORT and each process initialises from them)
    listens on MASTER_ADDR only, instead of every interface.

    Patches `torch.distributed.rendezvous.TCPStore`, the name `_create_c10d_store` builds it through, as
    `rendezvous_store_on_its_address` does the agent's; under torchrun the agent serves the store and every process
    is a client, which this leaves as it is. Idempotent.
    Waits for: TCPStore or the env rendezvous taking a bind address (torch 2.13 takes none).
    """
    import importlib

    # (the package torch.distributed exports a function of the module's name: import the module itself)
    rendezvous_module = importlib.import_module("torch.distributed.rendezvous")
    store_class = rendezvous_module.TCPStore
    if not getattr(store_class, "binds_its_address", False):
        rendezvous_module.TCPStore = store_bound_to_its_host(store_class)


def store_bound_to_its_host(store_class):
    """`store_class` (TCPStore) as the server side of a store builds it, handed a socket already bound to the
    store's host and listening (`master_listen_fd`), instead of binding every interface; clients are unchanged."""
    def bound_store(host_name, port, world_size=None, is_master=False, *args, **kwargs):
        if is_master and "master_listen_fd" not in kwargs:
            kwargs["master_listen_fd"], _ = listening_socket(host_name, port)
        return store_class(host_name, port, world_size, is_master, *args, **kwargs)

    bound_store.binds_its_address = True
    return bound_store


def listening_socket(host: str, port: int = 0) -> tuple[int, int]:
    """The file descriptor and port of a TCP socket bound to `host`:`port` (0: a free port) and listening, for a
    TCPStore's `master_listen_fd`: the store owns it from then on (it closes it), so Python lets go of it here."""
    import socket

    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(socket.SOMAXCONN)
    port = listener.getsockname()[1]
    return listener.detach(), port
