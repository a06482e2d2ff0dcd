"""Muon inside DiLoCo: the inner optimizer `muon` (Muon for the weight matrices, AdamW for the rest) against AdamW,
at equal tokens, each against DDP with the same optimizer.

Rows: DiLoCo M = 2 and M = 4 (40 syncs of H = 5: 200 steps per replica, outer Nesterov SGD lr 0.7 momentum 0.9,
fp32 syncs) and DDP on as many processes for the same 200 steps (the same tokens: M × batch × block a step), with
`--inner_optimizer adamw` and `--inner_optimizer muon`, seeds 0, 1 and 2 (the model's initialisation and the data
order), interleaved seed by seed. The peer task (recipes/tiny-pretrain.yaml: tiny Llama, the built-in corpus,
learning rate 1e-3 with warm-up and cosine decay, weight decay 0.1) with 64-token blocks, so that the 24 runs fit
about 42 minutes on 2 cores; the final held-out loss is measured once at the end. MuLoCo (arXiv 2505.23725)
reports Muon ahead of AdamW inside DiLoCo from 150M to 3.1B parameters; this is the same comparison at 1M.

    python benchmarks/muon.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import RunFailed, markdown_table, pyplot, run_concurrently, save

STEPS, INNER = 200, 5
QUICK_STEPS, QUICK_INNER = 40, 2
SEEDS = (0, 1, 2)
OPTIMIZERS = ("adamw", "muon")
LAYOUTS = (("DiLoCo", 2), ("DiLoCo", 4), ("DDP", 2), ("DDP", 4))
BLOCK, BATCH = 64, 8


def configurations() -> list[dict]:
    return [{"method": method, "replicas": m, "optimizer": optimizer, "seed": seed}
            for seed in SEEDS for method, m in LAYOUTS for optimizer in OPTIMIZERS]


def overrides(config: dict, steps: int, inner: int) -> list[str]:
    return ["--trainer", "diloco" if config["method"] == "DiLoCo" else "ddp", "--inner_optimizer",
            config["optimizer"], "--seed", str(config["seed"]), "--seed_model", str(config["seed"]),
            "--max_steps", str(steps), "--inner_steps", str(inner), "--block_size", str(BLOCK),
            "--per_device_train_batch_size", str(BATCH), "--eval_strategy", "steps", "--eval_steps", str(steps),
            "--eval_on_start", "false", "--save_strategy", "no", "--save_every_rounds", "0", "--logging_steps",
            str(steps)]


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS} steps, H = {QUICK_INNER}")
    args = parser.parse_args()
    steps, inner = (QUICK_STEPS, QUICK_INNER) if args.quick else (STEPS, INNER)
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
