"""`hf-diloco`: train from a recipe, launch replicas with accelerate, run the demo.

    hf-diloco train --config recipes/tiny-pretrain.yaml [--field value ...]   # this process is one replica
    hf-diloco launch recipes/tiny-pretrain.yaml --accelerate-config accelerate_configs/cpu-2proc.yaml [-- --field v]
    hf-diloco demo                                                              # 2 CPU replicas, tiny model

Design choices:
- Recipes are YAML files whose keys are DiLoCoConfig / RunArguments fields; flags override them. Both go through
  HfArgumentParser, so every field's help text is its `--help` and its documentation.
- Errors a user can cause end in one sentence on stderr and exit status 2, never a traceback.
- `launch` validates the recipe and the accelerate config in this process before starting anything.
- The process group is destroyed before exit: a gloo process that exits with it alive can abort at interpreter
  shutdown, turning a finished run into a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from .errors import ConfigError, first_line
from .runs import accelerate_command

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO_RECIPE = REPO_ROOT / "recipes" / "tiny-pretrain.yaml"
DEMO_ACCELERATE_CONFIG = REPO_ROOT / "accelerate_configs" / "cpu-2proc.yaml"


class CLIError(Exception):
    """Ends the command with its message and exit status 2."""


# --- recipes ------------------------------------------------------------------------------------------------------


def load_recipe(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not path.is_file():
        raise CLIError(f"recipe {str(path)!r} does not exist.")
    try:
        values = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise CLIError(f"recipe {str(path)!r} is not valid YAML ({first_line(error)}).") from None
    if not isinstance(values, dict):
        raise CLIError(f"recipe {str(path)!r} must be a mapping of field names to values.")
    return values


def parse_train_args(recipe: str | None, overrides: list[str]):
    """(RunArguments, DiLoCoConfig) from a recipe plus flag overrides."""

    from transformers import HfArgumentParser

    from .config import DiLoCoConfig, RunArguments

    parser = HfArgumentParser((RunArguments, DiLoCoConfig))
    values = load_recipe(recipe) if recipe else {}
    known = {action.dest for action in parser._actions}
    unknown = sorted(set(values) - known)
    if unknown:
        raise CLIError(
            f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} in recipe {recipe!r}; "
            f"keys must be DiLoCoConfig or RunArguments fields (see `hf-diloco train --help`)."
        )
    if _dry_run_requested(values, overrides):
        import torch

        if not torch.cuda.is_available():
            # A dry run checks a GPU recipe on any machine: mixed precision only matters once training starts.
            values = {**values, "bf16": False, "fp16": False}
            overrides = _drop_flags(overrides, ("--bf16", "--fp16"))
    parser.set_defaults(**{k: str(v) if isinstance(v, float) else v for k, v in values.items()})
    try:
        run, config, rest = parser.parse_args_into_dataclasses(args=overrides, return_remaining_strings=True)
    except ValueError as error:
        raise CLIError(first_line(error) + ".") from None
    if rest:
        raise CLIError(f"unknown option(s) {' '.join(rest)}; see `hf-diloco train --help`.")
    return run, config


def _dry_run_requested(values: dict, overrides: list[str]) -> bool:
    flag = None
    for i, item in enumerate(overrides):
        if item == "--dry_run":
            flag = overrides[i + 1] if i + 1 < len(overrides) and not overrides[i + 1].startswith("--") else "true"
        elif item.startswith("--dry_run="):
            flag = item.split("=", 1)[1]
    value = values.get("dry_run", False) if flag is None else flag
    return str(value).lower() in ("true", "1", "yes")


def _drop_flags(overrides: list[str], flags: tuple[str, ...]) -> list[str]:
    kept, skip = [], False
    for item in overrides:
        if skip:
            skip = False
            continue
        if item in flags:
            skip = True
            continue
        if not item.startswith(tuple(f + "=" for f in flags)):
            kept.append(item)
    return kept


def check_output_dir(config) -> None:
    """Refuse to train into a folder that already holds a run, unless resuming from it."""
    out = Path(config.output_dir)
    if config.resume_from_checkpoint or not out.exists():
        return
    from .metrics import SYNC_ROUNDS_FILE

    if (out / SYNC_ROUNDS_FILE).exists() or any(out.glob("checkpoint-*")):
        raise CLIError(
            f"output_dir {str(out)!r} already holds a run; choose another output_dir or pass "
            f"--resume_from_checkpoint latest to continue it."
        )


def resolve_checkpoint(config) -> str | None:
    value = config.resume_from_checkpoint
    if not value:
        return None
    if value in ("latest", "last", "True", "true"):
        from transformers.trainer_utils import get_last_checkpoint

        found = get_last_checkpoint(config.output_dir) if os.path.isdir(config.output_dir) else None
        if found is None:
            raise CLIError(f"resume_from_checkpoint=latest but {config.output_dir!r} holds no checkpoint-* folder.")
        return found
    if not os.path.isdir(value):
        raise CLIError(f"checkpoint {value!r} does not exist.")
    return value


# --- commands -------------------------------------------------------------------------------------------------------


def cmd_train(args: argparse.Namespace) -> int:
    run, config = parse_train_args(args.config, args.overrides)
    checkpoint = resolve_checkpoint(config)
    if not run.dry_run:
        check_output_dir(config)

    from transformers import Trainer, default_data_collator

    from .callbacks import SteadyClock
    from .data import build_datasets
    from .models import load_model_and_tokenizer
    from .trainer import DiLoCoTrainer

    if not config.should_log:
        import datasets

        datasets.disable_progress_bars()  # one set of progress bars per run, from the main process
    model, tokenizer = load_model_and_tokenizer(run.model_name_or_path, run.block_size, run.seed_model)
    if run.lora_r > 0:
        model = add_lora(model, run)
    if run.dry_run:
        print_plan(run, config, model)
        return 0
    if run.streaming and config.max_steps <= 0:
        raise CLIError("a streamed dataset has no length: set max_steps.")
    train_dataset, eval_dataset = build_datasets(run, tokenizer)
    if eval_dataset is None and config.eval_strategy != "no":
        raise CLIError("eval_strategy asks for evaluation but eval_fraction is 0, so there is nothing to evaluate on.")
    trainer_cls = DiLoCoTrainer if run.trainer == "diloco" else Trainer
    clock = SteadyClock()
    trainer = trainer_cls(
        model=model,
        args=config,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=default_data_collator,
        callbacks=[clock],
    )
    if trainer.is_world_process_zero():
        write_run_config(config.output_dir, run, config)
    if isinstance(trainer, DiLoCoTrainer):
        # `kill -USR1` (what the app's Stop sends): finish the round, save a checkpoint, exit.
        signal.signal(signal.SIGUSR1, lambda *_: trainer.diloco.request_stop())
    output = trainer.train(resume_from_checkpoint=checkpoint)
    trainer.save_model()
    if trainer.is_world_process_zero():
        tokens_per_step = config.per_device_train_batch_size * config.gradient_accumulation_steps * run.block_size
        write_run_metrics(config.output_dir, trainer, {**output.metrics, **clock.metrics(tokens_per_step)})
        if run.lora_r > 0 and run.merge_lora:
            merged = Path(config.output_dir) / "merged"
            model.merge_and_unload().save_pretrained(merged)
            tokenizer.save_pretrained(merged)
        print(f"[diloco] finished: model and metrics in {config.output_dir}", flush=True)
    return 0


def write_run_config(output_dir: str, run, config) -> None:
    """`run_config.json`: the run's model/data arguments and DiLoCo settings, for model cards (no tokens)."""
    from dataclasses import asdict

    from .hub import DILOCO_ROWS, RUN_CONFIG_FILE

    training_keys = ("learning_rate", "weight_decay", "warmup_steps", "max_steps", "per_device_train_batch_size",
                     "gradient_accumulation_steps", "lr_scheduler_type", "seed")
    values = {
        "run": asdict(run),
        "diloco": {key: getattr(config, key) for key, _, _ in DILOCO_ROWS},
        "training": {key: str(getattr(config, key)) if key == "lr_scheduler_type" else getattr(config, key)
                     for key in training_keys},
        "num_processes": config.world_size,
    }
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    (Path(output_dir) / RUN_CONFIG_FILE).write_text(json.dumps(values, indent=2, default=str) + "\n")


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
    (Path(output_dir) / "run_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")


def add_lora(model, run):
    from peft import LoraConfig, get_peft_model

    targets = [name.strip() for name in run.lora_target_modules.split(",") if name.strip()]
    try:
        return get_peft_model(
            model, LoraConfig(r=run.lora_r, lora_alpha=run.lora_alpha, lora_dropout=run.lora_dropout,
                              target_modules=targets, task_type="CAUSAL_LM")
        )
    except ValueError as error:
        raise CLIError(f"cannot add LoRA adapters: {first_line(error)}.") from None


def print_plan(run, config, model) -> None:
    """What a run would do, computed without loading data or training."""
    from .comm import ring_all_reduce_bytes
    from .metrics import format_bytes

    replicas = int(os.environ.get("WORLD_SIZE", "1")) // config.replica_group_size
    shown = replicas if replicas > 1 else 8  # alone, show the paper's M = 8 as the example
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    group = config.replica_group_size
    per_round = ring_all_reduce_bytes(trainable * 4 // group, shown)  # each member syncs a 1/g slice
    tokens_per_step = config.per_device_train_batch_size * config.gradient_accumulation_steps * run.block_size
    optim = getattr(config.optim, "value", config.optim)
    schedule = getattr(config.lr_scheduler_type, "value", config.lr_scheduler_type)
    plan = {
        "trainer": run.trainer,
        "model": f"{run.model_name_or_path} ({total:,} parameters, {trainable:,} trainable and synced)",
        "data": f"{run.dataset_name}" + (f" [{run.dataset_config}]" if run.dataset_config else "")
        + (", streamed" if run.streaming else "") + f", {run.block_size}-token blocks, column {run.text_column!r}",
        "replicas in this launch": f"{replicas} of {group} process(es) each",
        "inner_steps (H)": config.inner_steps,
        "outer optimizer": f"{config.outer_optimizer} lr {config.outer_lr} momentum {config.outer_momentum}"
        + (" Nesterov" if config.outer_nesterov else ""),
        "inner optimizer": f"{optim} lr {config.learning_rate} weight decay {config.weight_decay}, "
        f"warmup {config.warmup_steps}, {schedule}",
        "tokens per inner step per process": f"{tokens_per_step:,}",
        "pseudo-gradient per round": format_bytes(trainable * 4) + " (fp32)",
        f"sent across replicas per process per round, M={shown}": format_bytes(per_round),
        f"DDP for the same {config.inner_steps} steps": format_bytes(
            config.inner_steps * ring_all_reduce_bytes(trainable * 4, shown * group)
        ),
    }
    width = max(map(len, plan))
    print("hf-diloco dry run: nothing was downloaded or trained")
    for key, value in plan.items():
        print(f"  {key:<{width}}  {value}")


def check_accelerate_config(path: str, config) -> dict:
    """The accelerate config exists, is readable, and fits the recipe's replica layout."""
    if not Path(path).is_file():
        raise CLIError(f"accelerate config {path!r} does not exist.")
    try:
        values = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as error:
        raise CLIError(f"accelerate config {path!r} is not valid YAML ({first_line(error)}).") from None
    if not isinstance(values, dict):
        raise CLIError(f"accelerate config {path!r} must be a mapping of accelerate settings.")
    processes = int(values.get("num_processes", 1) or 1)
    if processes % config.replica_group_size:
        raise CLIError(
            f"accelerate config {path!r} starts {processes} processes, which replica_group_size="
            f"{config.replica_group_size} does not divide."
        )
    kind = str(values.get("distributed_type", "NO")).upper()
    if kind in ("FSDP", "DEEPSPEED"):
        raise CLIError(
            f"accelerate config {path!r} uses {kind}, which would shard one model across replicas; use "
            f"MULTI_GPU, with replica_group_size > 1 for DDP inside each replica (FSDP inside a replica is not "
            f"supported yet)."
        )
    return values


def cmd_launch(args: argparse.Namespace) -> int:
    run, config = parse_train_args(args.recipe, args.overrides)  # fail here, before any process starts
    check_accelerate_config(args.accelerate_config, config)
    resolve_checkpoint(config)
    if not run.dry_run:
        check_output_dir(config)
    command = accelerate_command(args.recipe, args.accelerate_config, args.overrides, args.port)
    print(" ".join(command), flush=True)
    if args.dry_run:
        return 0
    return subprocess.run(command).returncode


def cmd_demo(args: argparse.Namespace) -> int:
    for needed in (DEMO_RECIPE, DEMO_ACCELERATE_CONFIG):
        if not needed.is_file():
            raise CLIError(f"the demo needs {needed}, which ships with the repository; run it from a clone.")
    output_dir = Path(args.output_dir or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    if output_dir.exists():
        raise CLIError(f"output directory {str(output_dir)!r} already exists; choose another with --output-dir.")
    overrides = [
        "--output_dir", str(output_dir),
        "--max_steps", str(args.max_steps),
        "--inner_steps", str(args.inner_steps),
        "--eval_steps", str(args.inner_steps),
    ]
    command = accelerate_command(str(DEMO_RECIPE), str(DEMO_ACCELERATE_CONFIG), overrides, args.port)
    print("$ " + " ".join(command), flush=True)
    started = time.time()
    code = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}).returncode
    if code != 0:
        raise CLIError(f"the demo run failed with exit status {code}; its log is above.")
    print_demo_summary(output_dir, time.time() - started)
    return 0


def print_demo_summary(output_dir: Path, seconds: float) -> None:
    from .metrics import SUMMARY_FILE, format_bytes

    summary = json.loads((output_dir / SUMMARY_FILE).read_text())
    before, after = summary["eval_loss_initial"], summary["eval_loss_final"]
    sent, ddp = summary["bytes_per_replica"], summary["ddp_bytes_per_replica"]
    rows = [
        ("replicas x inner steps (H)", f"{summary['num_replicas']} x {summary['inner_steps']}"),
        ("steps / outer rounds", f"{summary['steps']} / {summary['rounds']}"),
        ("eval loss before -> after", f"{before:.4f} -> {after:.4f}" if before and after else "n/a"),
        ("throughput (all replicas)", f"{summary['tokens_per_second']:,.0f} tokens/s"),
        ("outer syncs, incl. waiting", f"{summary['sync_seconds']:.2f} s of {seconds:.0f} s"),
        ("sent per replica (DiLoCo)", format_bytes(sent)),
        ("DDP would have sent", f"{format_bytes(ddp)} ({ddp / sent:.0f}x more)" if sent else format_bytes(ddp)),
    ]
    width = max(len(name) for name, _ in rows)
    print("\nhf-diloco demo: what happened")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    print(f"  rounds: {output_dir / 'sync_rounds.jsonl'}   TensorBoard: tensorboard --logdir {output_dir / 'runs'}")


# --- entry point ----------------------------------------------------------------------------------------------------


def cmd_push(args: argparse.Namespace) -> int:
    from .hub import push

    try:
        push(args.output_dir, args.repo_id, private=args.private, merge_lora=args.merge_lora,
             commit_message=args.commit_message)
    except ConfigError:
        raise
    except Exception as error:  # network and Hub errors: the user needs the reason, not a traceback
        raise CLIError(f"push to {args.repo_id!r} failed: {first_line(error)}.") from None
    return 0


def cmd_app(args: argparse.Namespace) -> int:
    if not (REPO_ROOT / "app" / "server.py").is_file():
        raise CLIError("the app ships with the repository; run `hf-diloco app` from a clone.")
    sys.path.insert(0, str(REPO_ROOT))
    from app.server import serve

    return serve(host=args.host, port=args.port, runs_dir=Path(args.runs_dir), auth=args.auth, share=args.share)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-diloco", description="DiLoCo training for Hugging Face models.")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser(
        "train", help="train in this process (one replica per process under accelerate launch)", add_help=False
    )
    train.add_argument("--config", help="recipe YAML whose keys are DiLoCoConfig/RunArguments fields")
    train.add_argument("-h", "--help", action="store_true", help="list every field")
    train.set_defaults(func=cmd_train)

    launch = sub.add_parser("launch", help="print and run the accelerate launch command for a recipe")
    launch.add_argument("recipe", help="recipe YAML, e.g. recipes/tiny-pretrain.yaml")
    launch.add_argument(
        "--accelerate-config", required=True, help="accelerate YAML, e.g. accelerate_configs/cpu-2proc.yaml"
    )
    launch.add_argument("--port", type=int, help="rendezvous port of the main process (default: the config's)")
    launch.add_argument("--dry-run", action="store_true", help="print the command without running it")
    launch.set_defaults(func=cmd_launch)

    demo = sub.add_parser("demo", help="2-replica DiLoCo run on the built-in tiny model and corpus (CPU)")
    demo.add_argument("--output-dir", help="where the run goes (default: runs/demo-<time>)")
    demo.add_argument("--max-steps", type=int, default=300, help="inner steps per replica (default 300)")
    demo.add_argument("--inner-steps", type=int, default=50, help="H, steps between syncs (default 50)")
    demo.add_argument("--port", type=int, help="rendezvous port (default: the config's)")
    demo.set_defaults(func=cmd_demo)

    push = sub.add_parser("push", help="push a finished run's model to the Hugging Face Hub with a DiLoCo card")
    push.add_argument("output_dir", help="the run's output_dir")
    push.add_argument("--repo-id", required=True, help="'owner/name' or 'name'")
    push.add_argument("--private", action="store_true", help="create the repository as private")
    push.add_argument("--merge-lora", action="store_true", help="push the merged model instead of the LoRA adapter")
    push.add_argument("--commit-message", default="Upload DiLoCo model", help="commit message")
    push.set_defaults(func=cmd_push)

    app = sub.add_parser("app", help="the Gradio app: launch recipes, watch sync rounds, push to the Hub")
    app.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    app.add_argument("--port", type=int, default=7860, help="port (default 7860)")
    app.add_argument("--runs-dir", default="runs", help="where runs live (default runs/)")
    app.add_argument("--auth", default=os.environ.get("HF_DILOCO_APP_AUTH"),
                     help="'user:password' required to use the app (default: $HF_DILOCO_APP_AUTH)")
    app.add_argument("--share", action="store_true", help="also open a public Gradio share link (off by default)")
    app.set_defaults(func=cmd_app)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after the sub-command that argparse does not know is a DiLoCoConfig/RunArguments override.
    parser = build_parser()
    args, overrides = parser.parse_known_args(argv)
    if "--" in overrides:
        overrides.remove("--")
    args.overrides = overrides
    if args.command == "demo" and overrides:
        parser.error(f"unrecognized arguments: {' '.join(overrides)}")
    if args.command == "train" and args.help:
        from transformers import HfArgumentParser

        from .config import DiLoCoConfig, RunArguments

        HfArgumentParser((RunArguments, DiLoCoConfig), prog="hf-diloco train").print_help()
        return 0
    try:
        return args.func(args)
    except (CLIError, ConfigError) as error:
        print(f"hf-diloco: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hf-diloco: interrupted", file=sys.stderr)
        return 130
    finally:
        _destroy_process_group()


def _destroy_process_group() -> None:
    if "torch" not in sys.modules:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
