"""A 2-replica run whose sync is deliberately slow, to see whether the inner loop waits for it.

Argument: a JSON object {"out": folder, "sync_delay": τ, "comm_sleep": seconds, "step_sleep": seconds} and
optionally "final_sync", or a list of them, trained in turn by the same processes (as replica_run.py). Every
call of ReplicaComm.sum_replicas sleeps `comm_sleep` first (a slow link), every inner step sleeps `step_sleep`
(a slow model). Each rank writes `rank<r>.json`: the (start, end) of every sum_replicas call and the end time of
every step, all from one perf_counter clock.
"""

import json
import sys
import time
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import pattern_dataset, tiny_llama  # noqa: E402
from transformers import TrainerCallback, default_data_collator  # noqa: E402

from hf_diloco import DiLoCoConfig, DiLoCoTrainer, launch  # noqa: E402
from hf_diloco.comm import ReplicaComm  # noqa: E402


class SlowSteps(TrainerCallback):
    def __init__(self, seconds: float, step_ends: list):
        self.seconds, self.step_ends = seconds, step_ends

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(self.seconds)
        self.step_ends.append((state.global_step, time.perf_counter()))


def run(settings: dict) -> None:
    out = Path(settings["out"])
    exchanges: list[tuple[float, float]] = []
    step_ends: list[tuple[int, float]] = []
    original_average = ReplicaComm.sum_replicas

    def slow_average(self, *args, **kwargs):
        started = time.perf_counter()
        time.sleep(settings["comm_sleep"])
        result = original_average(self, *args, **kwargs)
        exchanges.append((started, time.perf_counter()))
        return result

    ReplicaComm.sum_replicas = slow_average
    config = DiLoCoConfig(
        output_dir=str(out / "run"), per_device_train_batch_size=2, learning_rate=3e-3, lr_scheduler_type="constant",
        max_steps=12, inner_steps=6, sync_delay=settings["sync_delay"], final_sync=settings.get("final_sync", "auto"),
        save_strategy="no", eval_strategy="no",
        report_to="none", disable_tqdm=True, seed=0,
    )
    # SlowSteps goes first so that its sleep is part of the step the DiLoCo callback times.
    trainer = DiLoCoTrainer(model=tiny_llama(seed=0), args=config, train_dataset=pattern_dataset(),
                            data_collator=default_data_collator)
    trainer.add_callback(SlowSteps(settings["step_sleep"], step_ends))
    trainer.callback_handler.callbacks.sort(key=lambda c: not isinstance(c, SlowSteps))
    try:
        trainer.train()
    finally:
        ReplicaComm.sum_replicas = original_average
    rank = dist.get_rank()
    (out / f"rank{rank}.json").write_text(json.dumps({"exchanges": exchanges, "step_ends": step_ends}))
    dist.barrier()  # every rank done with this run before any begins the next


payload = json.loads(sys.argv[1])
for one in payload if isinstance(payload, list) else [payload]:
    run(one)
# Leave as a launched hf-diloco worker does: gloo and FSDP2 threads torn down at interpreter exit can abort a
# finished process (SIGABRT, "terminate called without an active exception").
launch.destroy_process_groups()
launch.exit_process(0)
