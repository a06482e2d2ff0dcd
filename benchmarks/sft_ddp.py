"""The SFT quality benchmark's baseline: TRL's own SFTTrainer with data parallelism, as a user runs it without
DiLoCo (gradients all-reduced every step). Launched by benchmarks/sft_quality.py with `accelerate launch` on as
many processes as the DiLoCo run has replicas; it reads the same recipe and flags as `hf-diloco train`, builds the
model, LoRA adapters and data with the same functions, and writes trainer_log.jsonl and run_metrics.json as a
DiLoCo run does, so the two compare from the same files.

    accelerate launch --num_processes 2 benchmarks/sft_ddp.py --config recipes/sft-lora.yaml [flags]
"""

from __future__ import annotations

import sys
from dataclasses import fields
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's hf_diloco

from trl import SFTConfig, SFTTrainer  # noqa: E402

from hf_diloco.recipes import parse_train_args  # noqa: E402
from hf_diloco.run_callbacks import RunRecorder, SteadyClock  # noqa: E402
from hf_diloco.train import build_model, tokens_per_step, trl_datasets, write_run_metrics  # noqa: E402


def main(argv: list[str]) -> None:
    if argv[:1] != ["--config"] or len(argv) < 2:
        sys.exit("usage: sft_ddp.py --config RECIPE [flags]")
    run, config = parse_train_args(argv[1], argv[2:])
    if run.trainer != "sft":
        sys.exit(f"sft_ddp.py is the baseline of trainer sft; the recipe names trainer {run.trainer}.")
    # SFTConfig's own fields, with the recipe's values: the DiLoCo fields (rounds, outer optimizer) have no place.
    names = {f.name for f in fields(SFTConfig) if f.init}
    args = SFTConfig(**{f.name: getattr(config, f.name) for f in fields(config) if f.init and f.name in names})
    from transformers import set_seed

    set_seed(args.seed)
    loaded = build_model(run)
    model, tokenizer = loaded.model, loaded.tokenizer
    train_dataset, eval_dataset = trl_datasets(run, tokenizer)
    clock = SteadyClock()
    trainer = SFTTrainer(model=model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=tokenizer, callbacks=[clock, RunRecorder(args.output_dir)])
    output = trainer.train()
    if trainer.is_world_process_zero():
        write_run_metrics(args.output_dir, trainer, {**output.metrics, **clock.metrics(tokens_per_step(run, config))})


if __name__ == "__main__":
    main(sys.argv[1:])
