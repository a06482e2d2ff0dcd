"""A 2-replica FedAvg run (outer SGD lr 1, no momentum, H = 4, 12 steps) in which replicas go bad.

Argument: a JSON object {"out": folder, "poison": {"<rank>": [steps...]}, "sleep": {"<rank>": [step, seconds]},
"max_bad_rounds": n, "sync_timeout": s}, or a list of them trained in turn by the same processes. At each poisoned step,
after the inner optimizer step and before the sync, that rank's first parameter becomes NaN; at its sleep step a rank
sleeps before the sync. Each rank writes `rank<r>.json` (whether its parameters were finite after every sync) and
`params<r>-<step>.pt`: its parameters just before the sync at step 4 and just after it.
"""

import json
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import pattern_dataset, tiny_llama  # noqa: E402
from transformers import TrainerCallback, default_data_collator  # noqa: E402

from hf_diloco import DiLoCoConfig, DiLoCoTrainer, launch  # noqa: E402

out = Path()
poison: dict[int, list[int]] = {}
sleep: dict[int, list[float]] = {}


def snapshot(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


class Poison(TrainerCallback):
    """Runs before the DiLoCo callback (callbacks given to the trainer come first)."""

    def __init__(self):
        self.finite_after_sync = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        rank = dist.get_rank()
        if state.global_step == 4:
            torch.save(snapshot(model), out / f"params{rank}-before.pt")
        if rank in sleep and state.global_step == sleep[rank][0]:
            # A stalled process that the launcher's SIGTERM ends (the run's own handler would keep it to the round
            # end, and the launcher would wait 30 s before its SIGKILL).
            previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
            time.sleep(sleep[rank][1])
            signal.signal(signal.SIGTERM, previous)
        if state.global_step in poison.get(rank, []):
            with torch.no_grad():
                next(model.parameters()).fill_(float("nan"))

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step == 4:  # the sync at step 4 is done
            torch.save(snapshot(model), out / f"params{dist.get_rank()}-after.pt")
        if state.global_step and state.global_step % 4 == 0:
            self.finite_after_sync.append(all(bool(torch.isfinite(p).all()) for p in model.parameters()))


def run(settings: dict) -> None:
    global out, poison, sleep
    out = Path(settings["out"])
    poison = {int(rank): steps for rank, steps in settings.get("poison", {}).items()}
    sleep = {int(rank): pause for rank, pause in settings.get("sleep", {}).items()}
    config = DiLoCoConfig(
        output_dir=str(out / "run"), per_device_train_batch_size=2, learning_rate=3e-3, lr_scheduler_type="constant",
        max_steps=12, inner_steps=4, outer_lr=1.0, outer_momentum=0.0,
        max_bad_rounds=settings.get("max_bad_rounds", 3), sync_timeout=settings.get("sync_timeout", 600),
        save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True, seed=0,
    )
    probe = Poison()
    trainer = DiLoCoTrainer(model=tiny_llama(seed=0), args=config, train_dataset=pattern_dataset(),
                            data_collator=default_data_collator, callbacks=[probe])
    trainer.train()
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps({"finite_after_sync": probe.finite_after_sync}))


given = json.loads(sys.argv[1])
for settings in given if isinstance(given, list) else [given]:
    run(settings)
# Leave as a launched hf-diloco worker does: gloo and FSDP2 threads torn down at interpreter exit can abort a
# finished process (SIGABRT, "terminate called without an active exception").
launch.destroy_process_groups()
launch.exit_process(0)
