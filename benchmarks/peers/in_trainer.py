"""A peer's cross-replica algorithm inside the same `transformers.Trainer` inner loop that DiLoCoTrainer runs.

    accelerate launch --multi_gpu --num_processes 2 ... in_trainer.py PEER LIGHTHOUSE OUT.json --field value ...

PEER is `torchft` (torchft 0.2.0's DiLoCo, coordinated by the Lighthouse at LIGHTHOUSE) or `localsgd`
(accelerate's LocalSGD: parameter averaging every H steps; LIGHTHOUSE is ignored). The remaining arguments are
`hf-diloco train` flags, parsed with hf-diloco's recipe parser into the very DiLoCoConfig a DiLoCoTrainer run gets
(a DiLoCoConfig is a TrainingArguments), and hf-diloco builds the model and the data. So the model, the batches
each replica reads (Trainer shards them over the launched processes as for DiLoCoTrainer), the loss, the AdamW
parameter groups, the schedule and the clipping are identical; only what happens between replicas differs. A
DiLoCo peer with the paper's outer settings must therefore end with the same parameters as DiLoCoTrainer.

The main process saves the model to `output_dir` and writes OUT.json: the loop's wall time and steps (the same
clock as every benchmark row) and the final held-out loss.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback, default_data_collator

from hf_diloco.data import build_datasets
from hf_diloco.models import load_model_and_tokenizer
from hf_diloco.recipes import parse_train_args

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny-pretrain.yaml"


class ReplicaTrainer(Trainer):
    """Plain Trainer whose model is not wrapped in DDP, so replicas train alone between the peer's syncs."""

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        prepare_model = self.accelerator.prepare_model
        self.accelerator.prepare_model = lambda model, device_placement=None, evaluation_mode=False: prepare_model(
            model, device_placement=device_placement, evaluation_mode=True)


class TorchftDiLoCo(TrainerCallback):
    """Wraps the inner optimizer in torchft's DiLoCo once Trainer has built it; one replica per process."""

    def __init__(self, lighthouse: str, config):
        self.lighthouse, self.config = lighthouse, config
        self.manager = self.diloco = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        from torchft import Manager, ProcessGroupGloo
        from torchft.local_sgd import DiLoCo

        inner = getattr(optimizer, "optimizer", optimizer)  # the torch optimizer inside accelerate's wrapper
        store = dist.TCPStore(host_name="localhost", port=0, is_master=True, wait_for_workers=False)
        self.store = store
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timedelta(seconds=120)),
            min_replica_size=args.world_size,
            use_async_quorum=False,  # DiLoCo needs a synchronous quorum
            init_sync=False,  # the replicas are built from the same seed, as DiLoCoTrainer's are
            load_state_dict=lambda s: (model.load_state_dict(s["model"]), inner.load_state_dict(s["optim"])),
            state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
            replica_id=str(args.process_index),
            store_addr="localhost",
            store_port=store.port,
            rank=0,
            world_size=1,
            lighthouse_addr=self.lighthouse,
            timeout=timedelta(seconds=120),
        )
        outer = torch.optim.SGD(model.parameters(), lr=self.config.outer_lr, momentum=self.config.outer_momentum,
                                nesterov=self.config.outer_nesterov)
        self.diloco = DiLoCo(self.manager, [model], inner, outer, sync_every=self.config.inner_steps,
                             backup_device=torch.device("cpu"), pin_memory=False)
        self.diloco.__enter__()

    def on_train_end(self, args, state, control, **kwargs):
        self.diloco.__exit__(None, None, None)
        self.manager.shutdown(wait=False)


class AccelerateLocalSGD(TrainerCallback):
    """accelerate's LocalSGD around Trainer's DDP model: no gradient sync, parameters averaged every H steps."""

    def __init__(self, trainer: Trainer, inner_steps: int):
        self.trainer, self.inner_steps = trainer, inner_steps
        self.local_sgd = None

    def on_train_begin(self, args, state, control, **kwargs):
        from accelerate.local_sgd import LocalSGD

        self.local_sgd = LocalSGD(accelerator=self.trainer.accelerator, model=self.trainer.model_wrapped,
                                  local_sgd_steps=self.inner_steps, enabled=True)
        self.local_sgd.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        self.local_sgd.step()

    def on_train_end(self, args, state, control, **kwargs):
        self.local_sgd.__exit__(None, None, None)


def main() -> None:
    peer, lighthouse, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    run, config = parse_train_args(str(RECIPE), sys.argv[4:])
    model, tokenizer = load_model_and_tokenizer(run.model_name_or_path, run.block_size, run.seed_model)
    train_dataset, eval_dataset = build_datasets(run, tokenizer)
    trainer_cls = ReplicaTrainer if peer == "torchft" else Trainer
    trainer = trainer_cls(model=model, args=config, train_dataset=train_dataset, eval_dataset=eval_dataset,
                          processing_class=tokenizer, data_collator=default_data_collator)
    if peer == "torchft":
        trainer.add_callback(TorchftDiLoCo(lighthouse, config))
    elif peer == "localsgd":
        trainer.add_callback(AccelerateLocalSGD(trainer, config.inner_steps))
    else:
        sys.exit(f"unknown peer {peer!r}: use torchft or localsgd.")
    output = trainer.train()
    trainer.save_model()
    if trainer.is_world_process_zero():
        evals = [entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry]
        out.write_text(json.dumps({"train_runtime": output.metrics["train_runtime"],
                                   "global_step": trainer.state.global_step,
                                   "eval_loss": evals[-1] if evals else None}) + "\n")
    if dist.is_initialized():
        dist.destroy_process_group()  # a gloo process that exits with its group alive can abort at shutdown


if __name__ == "__main__":
    main()
