"""What DiLoCo costs over training the same replicas alone, with no link limit: throughput and time per sync.

Two replicas on one machine (one process and one CPU thread each), the peer task, interleaved and repeated:
- the replicas alone: two independent plain-Trainer processes that never talk (DESIGN.md §6's reference);
- DiLoCoTrainer under `accelerate launch` (gloo over loopback), one run per variant.
Each repeat runs the pair and then every variant; a variant's ratio is its tokens/s ÷ the pair's of the same
repeat; the table gives the median and [min, max]. Tokens/s: tokens ÷ Trainer's loop wall time for every run (the
pair's two processes are added up). Time per sync is the library's own `sync_seconds` per round.

    python benchmarks/overhead.py [--quick] [--repeats N] [--steps N] [--variants fp32 ...]
        [--variant 'name=--field v ...']
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import (
    Processes,
    RunFailed,
    add_variant_arguments,
    loop_tokens_per_second,
    markdown_table,
    read_run,
    run_training,
    save,
    selected_variants,
    show,
    spread,
    spread_bars,
    train_command,
)


def independent_pair(tmp: Path, overrides: list[str]) -> list[dict]:
    """Two single-process plain-Trainer runs at the same time: the replicas with no DiLoCo at all."""
    commands = [train_command(1, ["--output_dir", str(tmp / f"alone{r}"), "--trainer", "ddp", "--seed", str(r),
                                  *overrides]) for r in range(2)]
    processes = [Processes([c]) for c in commands]  # started together, waited for together
    for p in processes:
        p.wait()
    return [read_run(tmp / f"alone{r}") for r in range(2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="40 steps, H = 20 (under 3 minutes)")
    parser.add_argument("--repeats", type=int, default=3, help="repeats, interleaved (at least 3)")
    parser.add_argument("--steps", type=int, help="inner steps per run (default 50, H = 50; with --quick 40, H = "
                                                  "20); more steps weigh start-up and the first sync as a long run "
                                                  "does")
    add_variant_arguments(parser, default=["fp32"])
    args = parser.parse_args()
    if args.repeats < 3:
        sys.exit("--repeats must be at least 3: a median and a spread need three runs.")
    started = time.time()
    variants = selected_variants(args)
    steps, inner = (40, 20) if args.quick else (50, 50)
    steps = args.steps or steps
    common = ["--max_steps", str(steps), "--eval_strategy", "no", "--eval_on_start", "false", "--save_strategy",
              "no", "--save_every_rounds", "0", "--logging_steps", str(steps)]
    runs = []
    with tempfile.TemporaryDirectory() as tmp_name:
        try:
            for repeat in range(args.repeats):
                tmp = Path(tmp_name) / f"r{repeat}"
                print(f"repeat {repeat + 1}/{args.repeats}: the replicas alone (plain Trainer, no sync) ...",
                      flush=True)
                alone = independent_pair(tmp, common)
                pair = sum(loop_tokens_per_second(r, 1) for r in alone)
                runs.append({"repeat": repeat, "run": "alone", "tokens_per_second": pair})
                for v, (name, extra) in enumerate(variants.items()):
                    print(f"repeat {repeat + 1}/{args.repeats}: DiLoCoTrainer H={inner} {name} ...", flush=True)
                    result = run_training(tmp / f"diloco{v}", 2, [*common, "--inner_steps", str(inner), *extra])
                    tps = loop_tokens_per_second(result, 2)
                    runs.append({"repeat": repeat, "run": name, "overrides": extra, "tokens_per_second": tps,
                                 "ratio": tps / pair, "sync_seconds": [r["sync_seconds"] for r in result["rounds"]],
                                 "peak_rss_mb": result["metrics"].get("peak_rss_mb")})
        except RunFailed as error:
            sys.exit(str(error))
    alone = spread([r["tokens_per_second"] for r in runs if r["run"] == "alone"])
    rows = [["2 independent plain Trainers", show(alone), "100%", "-", "-"]]
    summary = {"alone": alone}
    for name in variants:
        mine = [r for r in runs if r["run"] == name]
        syncs = [s for r in mine for s in r["sync_seconds"]]
        summary[name] = {"tokens_per_second": spread([r["tokens_per_second"] for r in mine]),
                         "ratio": spread([r["ratio"] for r in mine]), "sync_seconds": spread(syncs)}
        rows.append([f"DiLoCoTrainer H={inner} {name}", show(summary[name]["tokens_per_second"]),
                     show(summary[name]["ratio"], "{:.1%}"), f"{statistics.median(syncs):.3f}", f"{max(syncs):.3f}"])
    table = markdown_table(["run (2 replicas, no link limit)", "tokens/s", "vs the replicas alone",
                            "median sync s/round", "max sync s/round"], rows)
    table += (f"\n\n{steps} steps, {args.repeats} repeats interleaved; median [min, max]; each ratio divides by the "
              f"pair of the same repeat.")
    save("overhead", table, {"steps": steps, "inner_steps": inner, "repeats": args.repeats, "variants": variants,
                             "summary": summary, "runs": runs}, plot(summary, variants), quick=args.quick,
         seconds=time.time() - started)


def plot(summary: dict, variants: dict):
    labels = ["replicas alone", *(f"DiLoCo {name}" for name in variants)]
    spreads = [summary["alone"], *(summary[name]["tokens_per_second"] for name in variants)]
    fig, ax = spread_bars(labels, spreads, ["#888", *["#1f77b4"] * len(variants)],
                          "tokens/s, both replicas (median, [min, max])",
                          "DiLoCo vs the same replicas alone, no link limit", size=(7, 3.5))
    ax.axhline(0.98 * spreads[0]["median"], color="#d62728", linestyle="--", label="98% target")
    ax.legend()
    return fig


if __name__ == "__main__":
    main()
