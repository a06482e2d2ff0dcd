"""Muon inside DiLoCo: the inner optimizer `muon` (Muon for the weight matrices, AdamW for the rest) against AdamW,
at equal tokens, each against DDP with the same optimizer.

Rows: DiLoCo M = 2 and M = 4 (40 syncs of H = 5: 200 steps per replica, outer Nesterov SGD lr 0.7 momentum 0.9,
fp32 syncs) and DDP on as many processes for the same 200 steps (the same tokens: M × batch × block a step), with
`--inner_optimizer adamw` and `--inner_optimizer muon`, seeds 0, 1 and 2 (the model's initialisation and the data
order), interleaved seed by seed. The peer task (recipes/tiny-pretrain.yaml: tiny Llama, the built-in corpus,
learning rate 1e-3 with warm-up and cosine decay, weight decay 0.1) with 64-token blocks, so that the 24 runs fit
about 42 minutes on 2 cores; the final held-out loss is measured once at the end. MuLoCo (arXiv 2505.23725)
reports Muon ahead of AdamW inside DiLoCo from 150M to 3.1B parameters; this is the same comparison at 1M.

With `--tasks`: Muon inside on every other task Trainer trains (seq2seq, masked LM, text and image
classification): each task's recipe as two DiLoCo replicas, 40 syncs of H = 5 (200 steps per replica), inner
AdamW against inner Muon, seed 0, the task's metric (held-out loss, or accuracy for the classifiers) at the start
and at the end.

With `--step-seconds`: one inner optimizer step on this machine's CPU for each task's preset, AdamW against Muon
with its orthogonalization in float32 (what runs on the CPU) and in torch's bfloat16, 5 interleaved repeats of 10
steps each from a fixed gradient.

    python benchmarks/muon.py [--quick] [--tasks | --step-seconds]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, RunFailed, markdown_table, pyplot, run_concurrently, save

from hf_diloco.files import read_jsonl

STEPS, INNER = 200, 5
QUICK_STEPS, QUICK_INNER = 40, 2
SEEDS = (0, 1, 2)
OPTIMIZERS = ("adamw", "muon")
LAYOUTS = (("DiLoCo", 2), ("DiLoCo", 4), ("DDP", 2), ("DDP", 4))
BLOCK, BATCH = 64, 8
TASKS = ("seq2seq", "masked-lm", "sequence-classification", "image-classification")


def configurations() -> list[dict]:
    return [{"method": method, "replicas": m, "optimizer": optimizer, "seed": seed}
            for seed in SEEDS for method, m in LAYOUTS for optimizer in OPTIMIZERS]


def run_flags(optimizer: str, steps: int, inner: int, eval_on_start: bool) -> list[str]:
    """Every run's length, H and inner optimizer; one evaluation at the end (and one before the first step if
    asked), nothing saved."""
    return ["--inner_optimizer", optimizer, "--max_steps", str(steps), "--inner_steps", str(inner),
            "--eval_strategy", "steps", "--eval_steps", str(steps), "--eval_on_start", str(eval_on_start).lower(),
            "--save_strategy", "no", "--save_every_rounds", "0", "--logging_steps", str(steps)]


def overrides(config: dict, steps: int, inner: int) -> list[str]:
    return ["--trainer", "diloco" if config["method"] == "DiLoCo" else "ddp", "--seed", str(config["seed"]),
            "--seed_model", str(config["seed"]), "--block_size", str(BLOCK), "--per_device_train_batch_size",
            str(BATCH), *run_flags(config["optimizer"], steps, inner, eval_on_start=False)]


def key(row: dict) -> tuple[str, int, str]:
    return row["method"], row["replicas"], row["optimizer"]


def summarize(raw: list[dict]) -> dict[tuple[str, int, str], list[float]]:
    losses: dict[tuple[str, int, str], list[float]] = {}
    for row in raw:
        losses.setdefault(key(row), []).append(row["eval_loss"])
    return losses


def table(raw: list[dict], steps: int, inner: int) -> str:
    losses = summarize(raw)
    by_seed = {(key(r), r["seed"]): r["eval_loss"] for r in raw}
    rows = []
    for method, m in LAYOUTS:
        for optimizer in OPTIMIZERS:
            values = losses[(method, m, optimizer)]
            versus_adamw = "-" if optimizer == "adamw" else _paired(by_seed, (method, m, "muon"),
                                                                    (method, m, "adamw"))
            versus_ddp = "-" if method == "DDP" else _paired(by_seed, (method, m, optimizer), ("DDP", m, optimizer))
            rows.append([f"{method} M={m}", optimizer, f"{m * steps * BATCH * BLOCK:,}",
                         f"{statistics.median(values):.4f} [{min(values):.4f}, {max(values):.4f}]", versus_adamw,
                         versus_ddp, steps // inner if method == "DiLoCo" else steps])
    text = markdown_table(["method", "inner optimizer", "tokens", "final eval loss, median [min, max] of 3 seeds",
                           "muon against adamw (median [min, max] of the seeds' differences)",
                           "DiLoCo against DDP, same optimizer", "syncs"], rows)
    return text + (f"\n\n{steps} steps per replica, H = {inner} ({steps // inner} syncs for DiLoCo; DDP all-reduces "
                   f"gradients at every step), batch {BATCH} × {BLOCK}-token blocks per process, seeds "
                   f"{', '.join(map(str, SEEDS))} (model and data order). Relative differences are paired by seed.")


def _paired(by_seed: dict, row: tuple, reference: tuple) -> str:
    gaps = [by_seed[(row, s)] / by_seed[(reference, s)] - 1 for s in SEEDS if (row, s) in by_seed]
    return f"{statistics.median(gaps):+.2%} [{min(gaps):+.2%}, {max(gaps):+.2%}]"


def plot(raw: list[dict]):
    plt = pyplot()
    losses = summarize(raw)
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{method} M={m}" for method, m in LAYOUTS]
    width = 0.38
    for i, (optimizer, color) in enumerate(zip(OPTIMIZERS, ("#4c72b0", "#dd8452"), strict=True)):
        values = [losses[(method, m, optimizer)] for method, m in LAYOUTS]
        medians = [statistics.median(v) for v in values]
        errors = [[md - min(v) for md, v in zip(medians, values, strict=True)],
                  [max(v) - md for md, v in zip(medians, values, strict=True)]]
        ax.bar([x + (i - 0.5) * width for x in range(len(labels))], medians, width, yerr=errors, capsize=3,
               color=color, label=f"inner {optimizer}")
    ax.set_xticks(range(len(labels)), labels)
    low = min(min(v) for v in losses.values())
    ax.set_ylim(low * 0.95, max(max(v) for v in losses.values()) * 1.02)
    ax.set_ylabel("final held-out loss (median, min-max of 3 seeds)")
    ax.set_title("Muon against AdamW as the inner optimizer, at equal tokens")
    ax.legend()
    return fig


def task_row(task: str, optimizer: str, output_dir: Path) -> dict:
    """A task run's metric at its first and last evaluation: accuracy for classifiers, else the held-out loss."""
    evaluations = [e for e in read_jsonl(output_dir / "trainer_log.jsonl") if "eval_loss" in e]
    metric = "eval_accuracy" if "eval_accuracy" in evaluations[0] else "eval_loss"
    return {"task": task, "optimizer": optimizer, "metric": metric, "start": evaluations[0][metric],
            "end": evaluations[-1][metric], "eval_loss_end": evaluations[-1]["eval_loss"]}


def task_table(raw: list[dict], steps: int, inner: int) -> str:
    rows = []
    for task in TASKS:
        by_optimizer = {r["optimizer"]: r for r in raw if r["task"] == task}
        adamw, muon = by_optimizer["adamw"], by_optimizer["muon"]
        for row in (adamw, muon):
            shown = "{:.1%}" if row["metric"] == "eval_accuracy" else "{:.4f}"
            rows.append([task, row["optimizer"], row["metric"].removeprefix("eval_"), shown.format(row["start"]),
                         shown.format(row["end"]), f"{row['eval_loss_end']:.4f}",
                         "-" if row is adamw else f"{muon['eval_loss_end'] / adamw['eval_loss_end'] - 1:+.2%}"])
    return markdown_table(["task", "inner optimizer", "metric", "at the start", "at the end", "final eval loss",
                           "muon against adamw, final eval loss"], rows) + (
        f"\n\nEach task's recipe (recipes/<task>.yaml) as two DiLoCo replicas of one process, {steps} steps per "
        f"replica, H = {inner} ({steps // inner} syncs), seed 0; the start is the evaluation before the first step.")


def run_tasks(steps: int, inner: int) -> None:
    started = time.time()
    configs = [(task, optimizer) for task in TASKS for optimizer in OPTIMIZERS]
    with tempfile.TemporaryDirectory() as tmp:
        jobs = [(Path(tmp) / f"{task}-{optimizer}", 2, run_flags(optimizer, steps, inner, eval_on_start=True))
                for task, optimizer in configs]
        try:
            run_concurrently(jobs, recipes=[REPO / "recipes" / f"{task}.yaml" for task, _ in configs])
        except RunFailed as error:
            sys.exit(str(error))
        raw = [task_row(task, optimizer, out) for (task, optimizer), (out, _, _) in zip(configs, jobs, strict=True)]
    save("muon-tasks", task_table(raw, steps, inner), {"steps": steps, "inner_steps": inner, "runs": raw},
         quick=steps != STEPS, seconds=time.time() - started)


STEP_VARIANTS = ("adamw", "muon, float32 orthogonalization", "muon, torch's bfloat16 orthogonalization")


def one_optimizer_step(model, variant: str):
    """A function that takes one step of `variant` on `model` (its gradients set once, fixed)."""
    import torch

    from hf_diloco.inner import muon_with_adamw

    matrices = [n for n, p in model.named_parameters() if p.dim() > 1]
    if variant == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        return optimizer.step
    optimizer = muon_with_adamw(model, matrices, lr=1e-3, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8)
    if variant.endswith("float32 orthogonalization"):
        return optimizer.step

    def torch_bfloat16_step():  # the two parts stepped as torch ships them, without the float32 iteration
        optimizer.muon.step()
        optimizer.adamw.step()
    return torch_bfloat16_step


def step_seconds(repeats: int, steps: int) -> None:
    import torch

    from hf_diloco.models import load_model_and_tokenizer
    from hf_diloco.tasks import TASKS as ALL_TASKS

    started = time.time()
    torch.set_num_threads(1)
    raw = []
    for task in ALL_TASKS.values():
        model = load_model_and_tokenizer(task.preset, BLOCK, task=task.name)[0]
        torch.manual_seed(0)
        for param in model.parameters():
            param.grad = torch.randn_like(param) * 1e-3
        stepping = {variant: one_optimizer_step(model, variant) for variant in STEP_VARIANTS}
        for step in stepping.values():
            step()  # state made, kernels warm
        times = {variant: [] for variant in STEP_VARIANTS}
        for _ in range(repeats):
            for variant, step in stepping.items():
                began = time.perf_counter()
                for _ in range(steps):
                    step()
                times[variant].append((time.perf_counter() - began) / steps)
        raw.append({"task": task.name, "preset": task.preset,
                    "parameters": sum(p.numel() for p in model.parameters()), "seconds": times})
        print(f"  {task.name}: " + ", ".join(f"{v} {statistics.median(t) * 1e3:.1f} ms" for v, t in times.items()),
              flush=True)
    rows = []
    for row in raw:
        medians = {v: statistics.median(t) for v, t in row["seconds"].items()}
        rows.append([row["task"], row["preset"], f"{row['parameters']:,}",
                     *(f"{statistics.median(t) * 1e3:.1f} [{min(t) * 1e3:.1f}, {max(t) * 1e3:.1f}]"
                       for t in row["seconds"].values()),
                     f"{medians[STEP_VARIANTS[2]] / medians[STEP_VARIANTS[1]]:.1f}x"])
    text = markdown_table(["task", "preset", "parameters", *(f"{v}, ms a step" for v in STEP_VARIANTS),
                           "bfloat16 ÷ float32"], rows) + (
        f"\n\nOne thread, {repeats} interleaved repeats of {steps} steps each (median [min, max] of the repeats' "
        "means), from a fixed gradient; Muon's part steps the body's weight matrices, AdamW the rest "
        "(inner_optimizer muon).")
    save("muon-step-seconds", text, {"repeats": repeats, "steps": steps, "runs": raw},
         seconds=time.time() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS} steps, H = {QUICK_INNER}")
    parser.add_argument("--tasks", action="store_true", help="Muon against AdamW inside on each other task's recipe")
    parser.add_argument("--step-seconds", action="store_true",
                        help="one optimizer step's time on the CPU: AdamW, Muon in float32 and in bfloat16")
    args = parser.parse_args()
    if args.step_seconds:
        step_seconds(repeats=3 if args.quick else 5, steps=3 if args.quick else 10)
        return
    steps, inner = (QUICK_STEPS, QUICK_INNER) if args.quick else (STEPS, INNER)
    if args.tasks:
        run_tasks(steps, inner)
        return
    started = time.time()
    configs = configurations()
    with tempfile.TemporaryDirectory() as tmp:
        jobs = [(Path(tmp) / f"run{i}", c["replicas"], overrides(c, steps, inner)) for i, c in enumerate(configs)]
        try:
            results = run_concurrently(jobs)
        except RunFailed as error:
            sys.exit(str(error))
    raw = [{**c, "steps": steps, "inner_steps": inner, "tokens": steps * BATCH * BLOCK * c["replicas"],
            "eval_loss": r["metrics"]["eval_loss"]} for c, r in zip(configs, results, strict=True)]
    save("muon", table(raw, steps, inner), {"steps": steps, "inner_steps": inner, "runs": raw}, plot(raw),
         quick=args.quick, seconds=time.time() - started)


if __name__ == "__main__":
    main()
