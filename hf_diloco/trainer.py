"""DiLoCoTrainer: `transformers.Trainer` glue for the DiLoCo outer loop.

Each process is one replica (or one member of a replica group). Trainer runs the inner loop untouched (its
optimizer, scheduler, gradient accumulation, clipping, mixed precision); this module adapts Trainer where DiLoCo
needs it, and the outer loop itself is hf_diloco.diloco_callback's (Trainer glue) over hf_diloco.engine's sync
engine.

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
- A stop is graceful wherever the trainer is used from: SIGTERM, SIGINT, SIGUSR1 (during `train()`) and the stop
  file (`<output_dir>/stop.request`) end training at a round boundary, all replicas together, with a checkpoint.
- A replica of several processes (DDP, FSDP2, tensor parallel inside it) is laid out by hf_diloco.parallel; every
  patch of a transformers or accelerate API that this needs is in hf_diloco.compat.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, Trainer
from transformers.trainer_utils import HubStrategy

from . import checkpoints, compat, parallel
from .comm import ReplicaComm
from .config import ConfigError, DiLoCoConfig
from .data import ReplicaSliceSampler, split_stream
from .diloco_callback import DiLoCoCallback
from .errors import RunError
from .files import read_json, write_json
from .inner import InnerOptimizer, check_resumable
from .run_callbacks import StopOnRequest
from .runs import PROGRESS_FILE

logger = logging.getLogger(__name__)


# A second SIGTERM/SIGINT this many seconds or more after the first ends the process at once; sooner, it is the
# same request arriving twice (a scheduler signals every process of a job, and the launcher passes its copy on).
REPEAT_STOPS_AFTER = 5.0


@contextlib.contextmanager
def graceful_stop_signals(request: Callable[[], None]) -> Iterator[None]:
    """Within the block, SIGUSR1, and SIGTERM/SIGINT (what SLURM and other schedulers send before a preemption, and
    Ctrl-C), call `request` for a graceful stop: the run finishes its round, saves a checkpoint and ends. The same
    SIGTERM/SIGINT again, from `REPEAT_STOPS_AFTER` seconds on, ends the process at once. The handlers that were
    there before come back after the block. Only the main thread can install handlers; elsewhere this does nothing
    (the stop file still works)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    first: dict[int, float] = {}

    def graceful(signum, _frame) -> None:
        if signum in first and signum != signal.SIGUSR1:
            if time.monotonic() - first[signum] >= REPEAT_STOPS_AFTER:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
            return
        first[signum] = time.monotonic()
        request()
        if signum != signal.SIGUSR1:
            print(f"[diloco] {signal.Signals(signum).name}: stopping at the end of this round with a checkpoint "
                  f"(send it again to stop at once)", flush=True)

    previous = {signum: signal.signal(signum, graceful) for signum in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            if handler is not None:  # None: installed by C code, which Python cannot put back
                signal.signal(signum, handler)


def data_shard(args: DiLoCoConfig) -> tuple[int, int]:
    """(this process's shard, number of shards): its place in the launch, or with torchft (one launch per replica
    of g processes) member j of replica_id r takes shard r·g + j of num_replicas·g, the shard the same process has
    in a torch launch of num_replicas·g processes. Tensor parallel: the processes of a replica compute on the same
    batches: the tp_size processes of one piece-set take one shard (replica r of a tensor-parallel replica takes
    shard r of the replicas; with FSDP2 beside it, shard r·dp_shard + d)."""
    tp = args.tp_size
    if args.outer_backend == "torchft":
        g = args.replica_group_size // tp
        return args.replica_id * g + args.process_index // tp, args.num_replicas * g
    return args.process_index // tp, args.world_size // tp


def _is_stream(dataset) -> bool:
    from datasets import IterableDataset

    return isinstance(dataset, IterableDataset)


class DiLoCoMixin(InnerOptimizer):
    """DiLoCo for a `Trainer` subclass you already have: `class MyTrainer(DiLoCoMixin, SomeTrainer)`, first among the
    bases, trains each process as a DiLoCo replica of SomeTrainer and averages replicas every `inner_steps` steps.

    Its `args` must be a DiLoCoConfig; for a trainer with a config class of its own, a dataclass with both,
    theirs first so its defaults stand: `@dataclass class MyConfig(SomeConfig, DiLoCoConfig)` (`config_class`
    names it; hf_diloco.trl has them for TRL's SFTTrainer and DPOTrainer). Arguments are passed on by keyword, so
    a trainer whose own parameters come in another order than Trainer's is served alike; positional ones after
    (model, args) follow Trainer's order. During `train()`, SIGTERM, SIGINT and SIGUSR1 (unless
    `stop_signals=False`) and the file `<output_dir>/stop.request` stop training at the end of the round, every
    replica at the same step, with a checkpoint (see `request_stop`). Nothing crosses replicas between syncs: the
    trainer's per-step metric gathers (`accelerator.gather`, `gather_for_metrics` inside `training_step`, as
    TRL's trainers do) stay on each replica (compat.replica_local_metric_gathers).
    """

    config_class = DiLoCoConfig

    def __init__(self, model=None, args: DiLoCoConfig | None = None, *pargs, stop_signals: bool = True, **kwargs):
        if args is None:
            args = self.config_class(output_dir="trainer_output")
        if not isinstance(args, self.config_class):
            raise TypeError(f"{type(self).__name__} needs a {self.config_class.__name__} as args, got "
                            f"{type(args).__name__}.")
        if pargs:  # by name from here on: the trainer after this mixin may order its parameters otherwise
            import inspect

            names = list(inspect.signature(Trainer.__init__).parameters)[3:]
            kwargs.update(zip(names, pargs, strict=False))
        if args.sharded_replica:
            args.parallelism_config = parallel.replica_sharding(args)
        if args.tensor_parallel:
            if model is None:
                raise ConfigError("tensor parallel (tp_size > 1) splits the model DiLoCoTrainer is given, so pass "
                                  "model=...; a model_init is not supported with it.")
            model = parallel.apply_tensor_parallel(model, args)
        super().__init__(model=model, args=args, **kwargs)
        if _is_stream(self.train_dataset):
            self.train_dataset = split_stream(self.train_dataset, *self.data_shard)
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
        self.stop_signals = stop_signals
        self.marking = checkpoints.Marking()  # the newest checkpoint's marker, written once every part is there
        # Before the outer loop's callback, so that a stop file found at a round's last step rides that round.
        self.stopper = StopOnRequest(args.output_dir)
        self.add_callback(self.stopper)
        self.diloco = DiLoCoCallback(self)
        self.add_callback(self.diloco)
        # DiLoCo stops at a round boundary, all replicas together, whichever replica was asked.
        self.stopper.attach(self.diloco.request_stop, lambda: self.diloco.stopped_at)
        if args.push_to_hub and args.hub_strategy in (HubStrategy.CHECKPOINT, HubStrategy.ALL_CHECKPOINTS):
            logger.warning(f"hub_strategy {args.hub_strategy.value}: DiLoCoTrainer pushes each checkpoint's model, "
                           f"never the checkpoint folder (its optimizer and outer state stay local).")

    # --- no DDP: a replica trains alone between syncs ---------------------------------------------------------

    def create_accelerator_and_postprocess(self) -> None:
        sharding = self.args.parallelism_config if self.args.sharded_replica else None
        on_cpu = sharding is not None and self.args.device.type == "cpu"
        # Accelerate takes a parallelism config on accelerators only (FSDP2 on CPU: handed over below); tensor
        # parallel is applied by DiLoCoTrainer inside each replica, so accelerate sees none (an accelerate
        # config's would make it build a mesh over every process).
        hide = on_cpu or (self.args.tensor_parallel and sharding is None)
        with compat.parallelism_config_hidden(self.args) if hide else contextlib.nullcontext():
            super().create_accelerator_and_postprocess()
        if on_cpu:
            compat.fsdp2_over_gloo(self, sharding)
        if self.args.sharded_replica:
            parallel.set_fsdp_units(getattr(self.accelerator.state, "fsdp_plugin", None), self.model)
        compat.prepare_models_without_ddp(self.accelerator, self._inside_replica)

    def _inside_replica(self, model):
        """A model prepared for training: DDP over the replica's own processes where a replica has several and
        neither tensor parallel nor FSDP2 splits it (FSDP2 preparation does not come here); else as it is."""
        if self.comm.replica_group is None or self.args.tensor_parallel:
            return model
        return parallel.ddp_inside_replica(model, self.comm.replica_group, self.args.device)

    @property
    def data_shard(self) -> tuple[int, int]:
        """(this process's shard, number of shards): see `data_shard`."""
        return data_shard(self.args)

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
        if _is_stream(self.train_dataset):  # already this replica's part (split_stream): accelerate passes it on
            with compat.data_loader_shard(0, 1):
                loader = super().get_train_dataloader()
        elif self.args.outer_backend == "torchft" or self.args.tensor_parallel:
            loader = self._one_shard_of_several(super().get_train_dataloader)
        else:
            loader = super().get_train_dataloader()
        # A ReplicaSliceSampler already picks this replica's examples: accelerate's batch sharding passes them on.
        shard = getattr(loader, "batch_sampler", None)
        if isinstance(getattr(getattr(shard, "batch_sampler", None), "sampler", None), ReplicaSliceSampler):
            compat.pass_through_batch_sharding(loader)
        return loader

    def get_eval_dataloader(self, eval_dataset=None):
        if self.args.tensor_parallel:  # the processes of a replica evaluate the same batches together
            return self._one_shard_of_several(lambda: super(DiLoCoMixin, self).get_eval_dataloader(eval_dataset))
        return super().get_eval_dataloader(eval_dataset)

    def _one_shard_of_several(self, make_loader):
        """The loader `make_loader` builds, cut into `data_shard`'s shards instead of one per process. torchft: one
        launch per replica, so Accelerate sees one process; shard the batches as it would for num_replicas
        processes (replica r takes batches r, r + M, ...), exactly as the torch backend does. Tensor parallel: the
        tp_size processes of a replica take the same shard."""
        with compat.data_loader_shard(*self.data_shard):
            return make_loader()

    def training_step(self, model, inputs, num_items_in_batch=None):
        with compat.replica_local_metric_gathers(self.accelerator):
            loss = super().training_step(model, inputs, num_items_in_batch)
        self.diloco.observe_micro_batch(loss, inputs)
        return loss

    def _maybe_log_save_evaluate(self, *args, **kwargs):
        with compat.replica_local_loss_logging():
            return super()._maybe_log_save_evaluate(*args, **kwargs)

    def get_tp_size(self) -> int:
        """1, whatever the replica's tensor-parallel size (see compat.trainer_tp_size)."""
        return compat.trainer_tp_size()

    def get_total_train_batch_size(self, args) -> int:
        """Sequences per inner step over all replicas: the processes of one tensor-parallel piece-set share a batch."""
        return self._train_batch_size * args.gradient_accumulation_steps * (args.world_size // args.tp_size)

    def store_flos(self) -> None:
        # Trainer all-gathers the operations count at every log; replicas take the same steps on batches of one
        # shape, so no collective is needed (tensor parallel: a replica's processes count one batch together).
        self.state.total_flos += self.current_flos * (self.args.world_size // self.args.tp_size)
        self.current_flos = 0

    def train(self, *args, **kwargs):
        """Trainer.train, after writing `<output_dir>/run_config.json` (main process) unless `hf-diloco train` wrote a
        fuller one (push and the app describe any run folder from it), under store keys of its own. Stop signals ask
        for a graceful stop while it runs (unless `stop_signals=False`); the handlers from before come back after."""
        if self.is_world_process_zero():
            from .hub import RUN_CONFIG_FILE, trainer_settings

            path = Path(self.args.output_dir) / RUN_CONFIG_FILE
            if not path.exists():
                write_json(path, trainer_settings(self))
        self.comm.rendezvous.begin_training()
        try:
            with graceful_stop_signals(self.request_stop) if self.stop_signals else contextlib.nullcontext():
                return super().train(*args, **kwargs)
        finally:
            self.marking.join()  # the last checkpoint's marker is written before train() returns

    def request_stop(self) -> None:
        """Stop at the round's end, every replica after the same step, with a checkpoint (as SIGTERM; signal-safe)."""
        self.stopper.request()

    def continue_at_step(self, step: int) -> None:
        """The one way a backend moves Trainer's step: a replica that joins a run late (torchft) continues at the
        others' step, with its learning-rate schedule at the same point, so its rounds and its end match theirs."""
        self.state.global_step = step
        if self.lr_scheduler is not None:
            self.lr_scheduler.last_epoch = step - 1
            with warnings.catch_warnings():  # "step() before optimizer.step()": on purpose, to jump ahead
                warnings.simplefilter("ignore", UserWarning)
                self.lr_scheduler.step()

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True,
                    token: str | None = None, revision: str | None = None, private: bool | None = None,
                    allow_unfinished: bool = True, **kwargs):
        """Save the model and push what `hf-diloco push` pushes (hf_diloco.pushing.push_trained, which says what
        is and is not pushed); arguments as `Trainer.push_to_hub`, and `allow_unfinished=False` refuses a run that
        did not finish. The main process returns huggingface_hub's CommitInfo (a Future of it when not
        `blocking`); the others return None. For example, after `trainer.train()`:
        `trainer.push_to_hub(commit_message="DiLoCo, H = 50").commit_url` (tests/test_hub.py, against a local Hub)."""
        from .pushing import push_trained

        return push_trained(self, commit_message, blocking=blocking, token=token, revision=revision,
                            private=private, allow_unfinished=allow_unfinished, unused=kwargs)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """The push at a save during training (`args.push_to_hub`, unless `hub_strategy` is "end"):
        hf_diloco.pushing.push_checkpoint."""
        from .pushing import push_checkpoint

        push_checkpoint(self, checkpoint_folder)

    def create_model_card(self, *args, **kwargs) -> None:
        """The DiLoCo card of hf_diloco.hub (settings table, metrics, curve), as `hf-diloco push` writes it, with
        the settings from this trainer's own args."""
        from .pushing import write_card

        write_card(self)

    # --- checkpoints: every replica's inner state plus the outer state ----------------------------------------

    def _save_checkpoint(self, model, trial) -> None:
        """Trainer's checkpoint, named and written by Trainer (`checkpoint-<step>`), marked complete only when whole.

        The process that saves for its filesystem clears the folder and leaves a note before any other process
        writes (they wait for it through the rendezvous store); every process writes its part and says so (the store
        again); once every process has, the saving process writes the marker, then rotates, in the background
        (checkpoints.Marking), so that no replica waits at a save for a slower one to write. A process killed at
        any instant leaves a folder without the marker, which resume and rotation ignore (see hf_diloco.checkpoints).
        """
        step = self.state.global_step
        run_dir = Path(self._get_output_dir(trial=trial))
        folder = run_dir / f"{checkpoints.CHECKPOINT_PREFIX}{step}"
        if self.diloco.outer is not None and not self.diloco.engine.global_is_finite():
            # Every process asks (θ_global is alike everywhere), so all skip: the last good checkpoint stays the
            # newest, and rotation, which runs only after a save, deletes nothing.
            if self.args.should_save:
                print(f"[diloco] no checkpoint at step {step}: θ_global is not finite; the newest checkpoint stays "
                      f"the one to resume from", flush=True)
            return
        self.marking.join()  # the checkpoint before is marked (and rotated) first
        # One process per filesystem, as Trainer saves: the main process, or each machine's with save_on_each_node
        # (machines without a shared filesystem). The others write once it has cleared the folder.
        rendezvous = self.comm.rendezvous
        if self.args.should_save:
            checkpoints.begin(folder)
            rendezvous.written(f"{folder.name}/begun")
        else:
            saver = self.args.process_index - self.args.local_process_index if self.args.save_on_each_node else 0
            if not rendezvous.wait_for(f"{folder.name}/begun", [saver], self.args.sync_timeout):
                raise RunError(f"process {saver}, which saves {folder.name}, did not begin it within sync_timeout "
                               f"({self.args.sync_timeout:g} s).")
        # Trainer would rotate before the marker exists (see compat.trainer_rotation_off); checkpoints.rotate runs
        # once the checkpoint is whole.
        with compat.trainer_rotation_off(self.args) as limit:
            super()._save_checkpoint(model, trial)
        checkpoints.finish_part(self._replica_dir(str(folder)))
        rendezvous.written(folder.name)
        if self.args.should_save:
            best = self.state.best_model_checkpoint
            self.marking.start(folder, step, self.args.world_size,
                               lambda: rendezvous.wait_for(folder.name, None, self.args.sync_timeout),
                               lambda: limit and checkpoints.rotate(run_dir, limit, best))

    def _replica_dir(self, checkpoint: str) -> Path:
        return checkpoints.part_dir(checkpoint, self.args.process_index)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Tensor parallel: every process gathers its replica's full weights (a collective inside the replica only),
        then the saving process writes an ordinary consolidated model. A gathered state dict (FSDP2, tensor
        parallel) holds a tied weight twice, as two tensors that no longer share memory: the tied copy is left to
        the model's tie, so the file holds each tensor once, as `save_pretrained` of the plain model writes it."""
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        if self.args.tensor_parallel and state_dict is None:
            state_dict = parallel.full_state_dict(model)
            if not self.args.should_save:
                return
        if state_dict is not None:
            tied = getattr(model, "all_tied_weights_keys", None) or {}
            state_dict = {key: value for key, value in state_dict.items()
                          if not (key in tied and tied[key] in state_dict)}
        return super()._save(output_dir, state_dict)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        """Sharded replicas: every process reads the checkpoint's consolidated weights and keeps its shards (the
        round's θ_global and the replica's own parameters are then restored from the DiLoCo state on top)."""
        if not (self.args.sharded_replica or self.args.tensor_parallel):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        parallel.load_full_weights(model if model is not None else self.model_wrapped, resume_from_checkpoint)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        replica_dir = self._replica_dir(output_dir)
        replica_dir.mkdir(parents=True, exist_ok=True)
        # A sharded replica's optimizer holds DTensors: each process writes its own shards as plain tensors.
        torch.save(parallel.local_shards(self.optimizer.state_dict()), replica_dir / "optimizer.pt")
        torch.save(self.lr_scheduler.state_dict(), replica_dir / "scheduler.pt")
        checkpoints.save_diloco_state(output_dir, replica_dir, self.diloco.replica_state(),
                                      None if self.diloco.outer is None else self.diloco.outer.state_dict,
                                      sharded=self.comm.sharded, first_replica=self.comm.replica_index == 0,
                                      should_save=self.args.should_save)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        replica_dir = self._replica_dir(checkpoint)
        if (replica_dir / "optimizer.pt").exists():
            state = torch.load(replica_dir / "optimizer.pt", map_location="cpu", weights_only=True)  # moved on load
            check_resumable(self.optimizer, state)
            self.optimizer.load_state_dict(state)
            parallel.as_parameter_shards(self.optimizer)
            self.lr_scheduler.load_state_dict(torch.load(replica_dir / "scheduler.pt", weights_only=True))
        else:
            # A checkpoint written by plain Trainer (or by a run with fewer replicas): take what it has.
            super()._load_optimizer_and_scheduler(checkpoint)
        progress = Path(self.args.output_dir) / PROGRESS_FILE  # the step the interrupted run had reached
        reached = 0
        with contextlib.suppress(OSError, ValueError, KeyError):  # missing or damaged (DamagedFile): not known
            reached = int(read_json(progress)["step"])
        self.diloco.resume(str(checkpoint), reached, *checkpoints.load_diloco_state(
            checkpoint, replica_dir, member=self.comm.member, sharded=self.comm.sharded))



class DiLoCoTrainer(DiLoCoMixin, Trainer):
    """`Trainer` that trains each process as a DiLoCo replica and averages replicas every `inner_steps` steps.

    Takes what `Trainer` takes; `args` must be a `DiLoCoConfig`. During `train()`, SIGTERM, SIGINT and SIGUSR1
    (unless `stop_signals=False`) and the file `<output_dir>/stop.request` stop training at the end of the round,
    every replica at the same step, with a checkpoint (see `request_stop`). DiLoCo for another Trainer subclass:
    `DiLoCoMixin`.

    Example (a runnable version is the README's "Python" section)::

        trainer = DiLoCoTrainer(model=model, args=DiLoCoConfig(output_dir="out", inner_steps=50),
                                train_dataset=train, eval_dataset=held_out)
        trainer.train()
    """


@dataclass
class DiLoCoSeq2SeqConfig(Seq2SeqTrainingArguments, DiLoCoConfig):
    """Seq2SeqTrainingArguments' fields and defaults (generation settings, predict_with_generate), with
    DiLoCoConfig's fields and checks: the arguments of DiLoCoSeq2SeqTrainer and of `task: seq2seq` recipes."""


class DiLoCoSeq2SeqTrainer(DiLoCoMixin, Seq2SeqTrainer):
    """transformers' Seq2SeqTrainer (translation, summarization: encoder-decoder models), each process a DiLoCo
    replica (args: DiLoCoSeq2SeqConfig). `DiLoCoMixin` does the same for any other Trainer subclass."""

    config_class = DiLoCoSeq2SeqConfig
