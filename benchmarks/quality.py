"""Quality on the shared peer task: the DiLoCo paper's comparisons at small scale, in two regimes.

Tasks (DESIGN.md §6 model, corpus and inner optimizer; final held-out loss on the last 5% of the blocks):
- short (`--task short`, results/quality*): 400 steps, H = 50, i.e. 8 rounds. It measures the first rounds, where
  outer momentum and error feedback are still warming up: the short-run regime, not a codec's worth.
- many rounds (`--task many-rounds`, results/quality-rounds*): 1,200 steps, H = 15, i.e. 80 rounds. The codec
  targets (int8 within 0.5%, int4 + EF within 1%, sparse + EF within 2% of fp32 DiLoCo) are judged here.
Rows:
- single worker: plain Trainer, one process;
- DiLoCo M = 1 against it at equal steps (the scaling-laws paper, arXiv 2503.09799, finds M = 1 DiLoCo at or
  below plain training with a well-chosen outer lr);
- DDP M = 2 (gradients all-reduced every step) against DiLoCo M = 2 at equal tokens, one DiLoCo row per variant
  (codecs, streaming: see common.VARIANTS), with the syncs and the bytes each replica sent;
- `--sweep`: the outer lr × outer momentum grid at M = 1 and M = 2 (fp32, Nesterov where momentum > 0), written
  to results/<task>-sweep*; it reuses the task's single-worker and DDP rows when results/ holds them for the same
  steps and H, and runs them otherwise.
Loss, not speed, is measured here, so one-process runs share the two cores (two at a time).

    python benchmarks/quality.py [--task short|many-rounds] [--sweep] [--quick] [--variants fp32 ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from common import (
    RESULTS,
    RunFailed,
    add_variant_arguments,
    markdown_table,
    pyplot,
    run_concurrently,
    save,
    selected_variants,
)

# task -> (steps, H, steps with --quick, H with --quick, result name, default variants)
TASKS = {
    "short": (400, 50, 100, 25, "quality", ["fp32"]),
    "many-rounds": (1200, 15, 120, 3, "quality-rounds",
                    ["fp32", "int8", "int4+EF", "SparseLoCo", "stream F=5 tau=2 int4+EF"]),
}
# Outer SGD settings of the sweep, (lr, momentum) per M (Nesterov where momentum > 0). M = 1: lr 0.4 / 0.7 / 1.0 ×
# momentum 0 / 0.9, and lr 0.1 at 0.9 (lr / (1 − momentum) = 1, plain training's step). M = 2 takes both cores a
# run, so it sweeps lr along momentum 0.9 and adds FedAvg (1.0, 0).
# The recipe's 0.7 / 0.9 is a row of the main table and is read from there.
SWEEP = {1: [(0.4, 0.0), (0.7, 0.0), (1.0, 0.0), (0.1, 0.9), (0.4, 0.9), (1.0, 0.9)],
         2: [(0.4, 0.9), (1.0, 0.9), (1.0, 0.0)]}
# Codec targets, judged on the many-rounds task: variant -> largest loss above fp32 DiLoCo M = 2.
CODEC_TARGETS = {"int8": 0.005, "int4+EF": 0.01, "SparseLoCo": 0.02}
BASELINES = ("single worker (plain Trainer)", "DDP M=2")


def configurations(variants: dict[str, list[str]], inner: int) -> list[dict]:
    configs = [
        {"name": BASELINES[0], "trainer": "ddp", "replicas": 1, "compare": BASELINES[0]},
        {"name": f"DiLoCo M=1 H={inner}", "trainer": "diloco", "replicas": 1, "compare": BASELINES[0]},
        {"name": BASELINES[1], "trainer": "ddp", "replicas": 2, "compare": BASELINES[1]},
    ]
    configs += [{"name": f"DiLoCo M=2 H={inner} {name}", "trainer": "diloco", "replicas": 2, "compare": BASELINES[1],
                 "variant": name, "overrides": extra} for name, extra in variants.items()]
    return configs


def sweep_configurations(inner: int) -> list[dict]:
    return [{"name": f"DiLoCo M={m} H={inner} outer lr {lr} momentum {momentum}", "trainer": "diloco",
             "replicas": m, "compare": reference, "outer_lr": lr, "outer_momentum": momentum,
             "overrides": ["--outer_lr", str(lr), "--outer_momentum", str(momentum),
                           "--outer_nesterov", str(momentum > 0).lower()]}
            for m, reference in ((1, BASELINES[0]), (2, BASELINES[1])) for lr, momentum in SWEEP[m]]


def stored_runs(name: str, steps: int, inner: int) -> list[dict]:
    """The rows of an earlier full run of the same task, if results/ holds one."""
    path = RESULTS / f"{name}.json"
    if not path.exists():
        return []
    raw = json.loads(path.read_text())
    if raw.get("quick") or raw.get("steps") != steps or raw.get("inner_steps") != inner:
        return []
    return raw["runs"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=list(TASKS), default="short",
                        help="short: 400 steps, H = 50 (8 rounds); many-rounds: 1,200 steps, H = 15 (80 rounds)")
    parser.add_argument("--sweep", action="store_true",
                        help="run the outer lr × momentum sweep (M = 1: lr 0.4, 0.7, 1.0 × momentum 0, 0.9, and "
                             "0.1 at 0.9; M = 2: lr 0.4, 0.7, 1.0 at momentum 0.9, and 1.0 at 0) instead of the "
                             "codec rows")
    parser.add_argument("--quick", action="store_true", help="a tenth of the steps (under 3 minutes for short)")
    add_variant_arguments(parser, default=None)
    args = parser.parse_args()
    started = time.time()
    full_steps, full_inner, quick_steps, quick_inner, name, default_variants = TASKS[args.task]
    steps, inner = (quick_steps, quick_inner) if args.quick else (full_steps, full_inner)
    if args.variants is None:
        args.variants = default_variants
    variants = selected_variants(args)
    if args.sweep:
        reused = [r for r in stored_runs(name, steps, inner) if r["name"] in BASELINES or
                  r["name"] == f"DiLoCo M=1 H={inner}" or r.get("variant") == "fp32"] if not args.quick else []
        configs = [c for c in configurations({}, inner) if c["name"] in BASELINES
                   and c["name"] not in {r["name"] for r in reused}] + sweep_configurations(inner)
        name += "-sweep"
    else:
        reused, configs = [], configurations(variants, inner)
    common = ["--max_steps", str(steps), "--inner_steps", str(inner), "--eval_strategy", "steps", "--eval_steps",
              str(steps), "--eval_on_start", "false", "--save_strategy", "no", "--save_every_rounds", "0",
              "--logging_steps", str(steps)]
    from hf_diloco.comm import ring_all_reduce_bytes
    from hf_diloco.models import build_preset, byte_tokenizer

    gradient_bytes = sum(p.numel() * 4 for p in build_preset("tiny-llama", byte_tokenizer()).parameters())
    with tempfile.TemporaryDirectory() as tmp:
        jobs = [(Path(tmp) / f"run{i}", c["replicas"], [*common, "--trainer", c["trainer"], *c.get("overrides", [])])
                for i, c in enumerate(configs)]
        try:
            results = run_concurrently(jobs)
        except RunFailed as error:
            sys.exit(str(error))
    raw = list(reused)
    for config, result in zip(configs, results, strict=True):
        m = config["replicas"]
        if "summary" in result:
            summary = result["summary"]
            syncs, sent = summary.get("syncs", summary["rounds"]), summary["bytes_per_replica"]
        else:  # DDP: one fp32 gradient all-reduce per step
            syncs, sent = (steps if m > 1 else 0), steps * ring_all_reduce_bytes(gradient_bytes, m)
        raw.append({**config, "steps": steps, "tokens": steps * 8 * 256 * m, "eval_loss":
                    result["metrics"]["eval_loss"], "syncs": syncs, "bytes_per_replica": sent})
    if args.sweep:
        table = sweep_table(raw, inner)
    else:
        table = main_table(raw, steps, inner, args.task)
    figure = (sweep_plot if args.sweep else plot)(raw, steps, inner)
    save(name, table, {"task": args.task, "steps": steps, "inner_steps": inner, "variants": variants, "runs": raw},
         figure, quick=args.quick, seconds=time.time() - started)


def by_name(raw: list[dict]) -> dict[str, dict]:
    return {r["name"]: r for r in raw}


def relative(row: dict, reference: dict) -> float:
    return row["eval_loss"] / reference["eval_loss"] - 1


def main_table(raw: list[dict], steps: int, inner: int, task: str) -> str:
    rows_by_name = by_name(raw)
    fp32 = next((r for r in raw if r.get("variant") == "fp32"), None)
    rows = []
    for r in raw:
        reference = rows_by_name[r["compare"]]
        versus = f"{relative(r, reference):+.2%} vs {reference['name']}" if reference is not r else "-"
        target = "-"
        if fp32 is not None and r.get("variant") in CODEC_TARGETS:
            gap, limit = relative(r, fp32), CODEC_TARGETS[r["variant"]]
            target = f"{gap:+.2%} vs fp32 (target ≤ +{limit:.1%}): {'met' if gap <= limit else 'missed'}"
        rows.append([r["name"], f"{r['tokens']:,}", f"{r['eval_loss']:.4f}", versus, target, r["syncs"],
                     f"{r['bytes_per_replica'] / 1e6:,.2f}"])
    table = markdown_table(["method", "tokens", "final eval loss", "relative to", "codec target", "syncs",
                            "MB sent per replica"], rows)
    regime = ("the short-run regime: 8 rounds measure how fast outer momentum and error feedback warm up, not what "
              "a codec costs over a run; the codec targets are judged on the many-rounds task"
              if task == "short" else f"{steps // inner} rounds; the codec targets are judged here")
    return table + (f"\n\n{steps} steps each, H = {inner} ({regime}). One run each (seed 0). DiLoCo M=1 is compared "
                    f"with the single worker at equal steps, DiLoCo M=2 with DDP M=2 at equal tokens. DDP bytes: a "
                    f"ring all-reduce of the fp32 gradients per step.")


def sweep_table(raw: list[dict], inner: int) -> str:
    rows_by_name = by_name(raw)
    rows = []
    for r in raw:
        if r["name"] in BASELINES:
            continue
        if "outer_lr" not in r:  # the main table's 0.7 / 0.9 row, reused
            r = {**r, "outer_lr": 0.7, "outer_momentum": 0.9}
        reference = rows_by_name[r["compare"]]
        rows.append([r["replicas"], f"{r['outer_lr']:g}", f"{r['outer_momentum']:g}", f"{r['eval_loss']:.4f}",
                     f"{reference['eval_loss']:.4f}", f"{relative(r, reference):+.2%}",
                     "yes" if r["eval_loss"] <= reference["eval_loss"] else "no"])
    rows.sort(key=lambda row: (row[0], row[1], row[2]))
    table = markdown_table(["M", "outer lr", "outer momentum (Nesterov)", "final eval loss", "plain training",
                            "relative", "at or below plain training"], rows)
    return table + (f"\n\nH = {inner}, fp32 syncs; plain training is the single worker for M = 1 and DDP M = 2 at "
                    f"equal tokens for M = 2. One run each (seed 0). Momentum 0 is plain outer SGD; outer lr 1 with "
                    f"momentum 0 at M = 1 replaces θ_global by the replica's parameters each round: plain training up "
                    f"to fp32 rounding (θ_g − (θ_g − θ_i)), an independent check of the row.")


def sweep_plot(raw: list[dict], steps: int, inner: int):
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    rows_by_name = by_name(raw)
    for axis, m, reference in zip(axes, (1, 2), BASELINES, strict=True):
        points = [({"outer_lr": 0.7, "outer_momentum": 0.9} | r) for r in raw
                  if r["replicas"] == m and r["trainer"] == "diloco" and ("outer_lr" in r or r.get("variant") in
                                                                           (None, "fp32"))]
        for momentum in sorted({p["outer_momentum"] for p in points}):
            line = sorted((p["outer_lr"], p["eval_loss"]) for p in points if p["outer_momentum"] == momentum)
            axis.plot([x for x, _ in line], [y for _, y in line], marker="o", label=f"outer momentum {momentum}")
        if reference in rows_by_name:
            axis.axhline(rows_by_name[reference]["eval_loss"], color="#888", linestyle="--", label=reference)
        axis.set_xlabel("outer lr")
        axis.set_ylabel("final held-out loss")
        axis.set_title(f"M = {m}")
        axis.legend(fontsize=8)
    fig.suptitle(f"Outer lr × momentum, {steps} steps, H = {inner} ({steps // inner} rounds), fp32 syncs")
    return fig


def plot(raw: list[dict], steps: int, inner: int):
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r["name"] for r in raw]
    colors = ["#888" if r["trainer"] == "ddp" else "#1f77b4" for r in raw]
    left.barh(names, [r["eval_loss"] for r in raw], color=colors)
    left.invert_yaxis()
    left.set_xlabel("final held-out loss (lower is better)")
    left.set_xlim(min(r["eval_loss"] for r in raw) * 0.95, max(r["eval_loss"] for r in raw) * 1.02)
    for r in raw:
        if r["bytes_per_replica"]:
            right.scatter(r["bytes_per_replica"] / 1e6, r["eval_loss"], color="#888" if r["trainer"] == "ddp"
                          else "#1f77b4")
            right.annotate(r["name"], (r["bytes_per_replica"] / 1e6, r["eval_loss"]), fontsize=8,
                           xytext=(4, 2), textcoords="offset points")
    right.set_xscale("log")
    from matplotlib.ticker import NullFormatter

    right.xaxis.set_minor_formatter(NullFormatter())  # the minor labels of a short log axis overlap
    right.set_xlabel("MB sent per replica (log)")
    right.set_ylabel("final held-out loss")
    fig.suptitle(f"Quality on the peer task (tiny Llama, built-in corpus, 256-token blocks), {steps} steps, "
                 f"H = {inner} ({steps // inner} rounds)")
    return fig


if __name__ == "__main__":
    main()
