"""One DiLoCo replica, run under `accelerate launch` by the distributed tests.

Argument: a JSON object with the run's settings, or a list of them: one launch then trains each in turn, in the
same processes, from a new model and Trainer (the interpreters' start-up, most of a tiny launch's time, is paid
once; tests/helpers.py replica_runs). Each run has its own `out` folder. Each rank writes `rank<r>.json` into it:
every torch.distributed collective it made, tagged with the inner step it happened in (0 = before training), a
digest of its parameters after every sync, and the bytes it wrote to its sockets during every sync (from the kernel's
count of bytes written, /proc/self/io `wchar`); rank 0's final parameters go to `final.pt`. The setting
`stop_at_step: N` makes rank 0 alone request a stop after step N (as the app's Stop does), `stop_after_syncs: N`
once N syncs landed; `seed_by_rank: true`
builds each process's model from its own seed (replicas that do not start alike); `slow_sync_seconds: s` makes
every all-reduce across replicas wait s seconds first (a slower link); `cgroup_by_rank: {rank: folder}` moves
that rank's process into a cgroup v1 `cpu` folder the test made (a real CPU quota: a slower replica). Per sync a rank
also records the seconds it spent inside the sync (`sync_seconds`) and the inner steps it took since the sync before
(`steps_between`), and its whole training time (`train_seconds`). `model_folder: path` trains a model saved there
with `save_pretrained` instead of the tiny Llama, and `save_to: path` saves the trained model there at the end with
`Trainer.save_model`, as `hf-diloco train` does; `weights: bfloat16` trains the model's weights in that dtype.
"""

import gc
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import pattern_dataset, tiny_llama  # noqa: E402
from transformers import TrainerCallback, default_data_collator  # noqa: E402

from hf_diloco import DiLoCoConfig, DiLoCoTrainer, launch  # noqa: E402

# --- count every collective, whoever calls it (Trainer, accelerate, hf_diloco); DDP gradient all-reduces
# inside a replica of several processes run in C++ and are not seen here ---
COLLECTIVES = ["all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
               "broadcast", "broadcast_object_list", "barrier", "monitored_barrier", "reduce", "reduce_scatter",
               "reduce_scatter_tensor", "gather", "gather_object", "scatter", "all_to_all", "all_to_all_single",
               "send", "recv", "isend", "irecv"]
calls: list[tuple[int, str]] = []  # this run's collectives (emptied when the next run begins)
current_step = [0]


def counting(name, original):
    def wrapper(*args, **kwargs):
        calls.append((current_step[0], name))
        return original(*args, **kwargs)

    return wrapper


for name in COLLECTIVES:
    original = getattr(dist.distributed_c10d, name, None)
    if original is not None:
        wrapped = counting(name, original)
        setattr(dist.distributed_c10d, name, wrapped)
        setattr(dist, name, wrapped)


def bytes_written() -> int:
    """Bytes this process (all its threads) has passed to write-like system calls, sockets included."""
    import psutil

    return psutil.Process().io_counters().write_chars  # /proc/self/io wchar


def local(tensor):
    """This process's part of a tensor: the local shard of a DTensor (sharded replicas), else the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def digest(model) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(local(p).detach().float().cpu().contiguous().numpy().tobytes())  # bfloat16 exactly, as float32
    return h.hexdigest()


def held_bytes(trainer) -> dict:
    """Bytes of the tensors this process holds for training: parameters, inner optimizer state, outer state."""
    def size(tensors):
        return sum(local(t).numel() * t.element_size() for t in tensors if torch.is_tensor(t))

    outer = trainer.diloco.outer
    moments = [v for state in trainer.optimizer.state.values() for v in state.values()]
    outer_moments = [v for state in outer.optimizer.state.values() for v in state.values()]
    return {"parameters": size(trainer.model.parameters()), "inner_optimizer": size(moments),
            "outer": size(outer.global_params) + size(outer_moments)}


class Probe(TrainerCallback):
    """Counts this replica's own inner steps, tags collectives with the step, and requests the stops asked for."""

    def __init__(self, stop_at_step, stop_after_syncs):
        self.stop_at_step, self.stop_after_syncs = stop_at_step, stop_after_syncs
        self.trainer = None
        self.own_steps = 0  # inner steps this replica took (its Trainer step may jump ahead at a time-budget sync)

    def on_step_begin(self, args, state, control, **kwargs):
        current_step[0] = state.global_step + 1
        self.own_steps += 1

    def on_step_end(self, args, state, control, **kwargs):
        engine = self.trainer.diloco.engine
        if dist.get_rank() == 0 and (state.global_step == self.stop_at_step or self.stop_after_syncs is not None
                                     and engine.tuner.syncs_landed > self.stop_after_syncs):
            self.trainer.diloco.request_stop()


def run(settings: dict) -> None:
    """Train one run of `settings` in this process and write what it recorded into its `out` folder."""
    settings = dict(settings)
    calls.clear()
    current_step[0] = 0
    out = Path(settings.pop("out"))
    probe = Probe(settings.pop("stop_at_step", None), settings.pop("stop_after_syncs", None))
    seed_by_rank = settings.pop("seed_by_rank", False)  # each process builds its model from another seed
    model_folder = settings.pop("model_folder", None)  # train this saved model instead of the tiny Llama
    weights = settings.pop("weights", None)  # "bfloat16": the model's weights in that dtype
    save_to = settings.pop("save_to", None)  # then save it there with Trainer.save_model, as hf-diloco train does
    slow_sync_seconds = settings.pop("slow_sync_seconds", 0)  # every all-reduce between replicas takes this longer
    cgroup = settings.pop("cgroup_by_rank", {}).get(os.environ.get("RANK", "0"))
    if cgroup:  # every thread of this process, and any it starts, runs under the group's CPU quota
        Path(cgroup, "cgroup.procs").write_text(str(os.getpid()))

    config = DiLoCoConfig(
        output_dir=str(out / "run"),
        per_device_train_batch_size=2,
        learning_rate=settings.pop("learning_rate", 3e-3),
        lr_scheduler_type="constant",
        optim="adamw_torch",
        weight_decay=0.0,
        max_grad_norm=0.0,
        logging_steps=1,  # Trainer logs every step: proves the logged loss needs no gather
        save_strategy="no",
        eval_strategy="no",
        report_to=settings.pop("report_to", "none"),
        disable_tqdm=True,
        seed=0,
        **settings,
    )
    if model_folder:  # a user's own model, saved with save_pretrained (tests/helpers.py tiny_model_folder)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_folder)
    else:
        model = tiny_llama(seed=int(os.environ.get("RANK", "0")) if seed_by_rank else 0)
    if weights:
        model = model.to(getattr(torch, weights))
    trainer = DiLoCoTrainer(model=model, args=config, train_dataset=pattern_dataset(),
                            data_collator=default_data_collator, callbacks=[probe])
    probe.trainer = trainer
    if slow_sync_seconds:  # a slower link: each all-reduce across replicas waits before it runs
        all_reduce = trainer.comm._all_reduce

        def slow_all_reduce(buffer):
            time.sleep(slow_sync_seconds)
            all_reduce(buffer)

        trainer.comm._all_reduce = slow_all_reduce
    original_sync = trainer.diloco.sync
    sync_digests, sync_wire_bytes, sync_seconds, steps_between, last_sync_steps = [], [], [], [], [0]

    def sync_and_record(step, max_steps):
        before, began = bytes_written(), time.perf_counter()
        outcome = original_sync(step, max_steps)
        if outcome.synced:  # a sync landed or was launched at this step
            sync_seconds.append(time.perf_counter() - began)
            steps_between.append(probe.own_steps - last_sync_steps[0])
            last_sync_steps[0] = probe.own_steps
            sync_wire_bytes.append((step, bytes_written() - before))
            sync_digests.append((trainer.state.global_step, digest(trainer.model)))
        return outcome  # the trainer acts on it

    trainer.diloco.sync = sync_and_record
    seen_blocks = []  # which pattern blocks this replica trained on, identified by their first token
    original_training_step = trainer.training_step

    def recording_training_step(model, inputs, *args, **kwargs):
        seen_blocks.extend((inputs["input_ids"][:, 0] * 55 % 64).tolist())  # 55 = 7^-1 mod 64
        return original_training_step(model, inputs, *args, **kwargs)

    trainer.training_step = recording_training_step
    train_began = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - train_began
    rank = dist.get_rank()
    world = dist.get_world_size()
    (out / f"rank{rank}.json").write_text(json.dumps({
        "calls": calls, "digests": sync_digests, "seen": seen_blocks, "wire_bytes": sync_wire_bytes,
        "world_size": world, "held_bytes": held_bytes(trainer), "total_flos": trainer.state.total_flos,
        "sync_seconds": sync_seconds, "steps_between": steps_between, "train_seconds": train_seconds,
        "own_steps": probe.own_steps}))
    if config.sharded_replica or config.tensor_parallel:  # the whole model, gathered from replica 0 (every rank)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        final = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True,
                                                                             cpu_offload=True))
    else:
        final = trainer.model.state_dict()
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in final.items()}, out / "final.pt")
    if save_to:
        trainer.save_model(save_to)
    if cgroup:  # the next run of this launch is not held to this one's quota
        Path(cgroup).parent.joinpath("cgroup.procs").write_text(str(os.getpid()))
    dist.barrier()  # every rank done with this run before any begins the next


payload = json.loads(sys.argv[1])
launched_with = dict(os.environ)
for one in payload if isinstance(payload, list) else [payload]:
    run(one)
    # Each run starts from the launch's environment: Trainer's FSDP2 set-up sets ACCELERATE_USE_FSDP for the process,
    # which would make the next run's replicas read as sharded.
    os.environ.clear()
    os.environ.update(launched_with)
    gc.collect()  # the run's Trainer and model, held in reference cycles, go now, not during the next run's syncs
# Leave as a launched hf-diloco worker does: gloo and FSDP2 threads torn down at interpreter exit can abort a
# finished process (SIGABRT, "terminate called without an active exception").
launch.destroy_process_groups()
launch.exit_process(0)
