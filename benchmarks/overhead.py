"""What DiLoCo costs over training the same replicas alone: throughput, outer-step time, memory.

Compares, on the peer task with 2 replicas (one CPU process each, one thread each), steady tokens/s (the steps
after the first tenth, so start-up is not counted):
- DiLoCoTrainer, H = 50, with and without offload_outer_state;
- the same two replicas as two independent plain-Trainer processes that never sync.
Also times the outer step alone (pseudo-gradient, averaging, Nesterov step, copy back) for the presets, in process.

    python benchmarks/overhead.py [--quick]
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

from common import REPO, markdown_table, read_run, run_env, run_training, save, tokens_per_second, train_command


def independent_pair(tmp: Path, overrides: list[str]) -> list[dict]:
    """Two single-process plain-Trainer runs at the same time: the replicas with no DiLoCo at all."""
    procs = []
    for r in range(2):
        command = train_command(1, ["--output_dir", str(tmp / f"alone{r}"), "--trainer", "ddp", "--seed", str(r),
                                    *overrides])
        procs.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                      env=run_env(1), cwd=REPO))
    for p in procs:
        _, err = p.communicate()
        if p.returncode != 0:
            raise SystemExit(f"independent run failed:\n{err[-3000:]}")
    return [read_run(tmp / f"alone{r}") for r in range(2)]


def outer_step_seconds(preset: str, repeats: int = 5) -> float:
    """Median wall time of one outer step for one replica (no communication: M = 1)."""
    import torch

    from hf_diloco.comm import ReplicaComm
    from hf_diloco.models import build_preset, byte_tokenizer
    from hf_diloco.outer import OuterLoop

    model = build_preset(preset, byte_tokenizer())
    outer = OuterLoop(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    comm = ReplicaComm()
    times = []
    for _ in range(repeats):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-3)
        started = time.perf_counter()
        deltas = outer.pseudo_gradient(comm.device)
        comm.all_reduce_round(deltas, torch.zeros(5))
        outer.apply(deltas)
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer steps (under 2 minutes)")
    args = parser.parse_args()
    steps = 100 if args.quick else 400
    overrides = ["--max_steps", str(steps), "--eval_strategy", "no", "--eval_on_start", "false",
                 "--save_strategy", "no", "--logging_steps", "50"]
    rows, raw = [], {"steps": steps}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        print("independent replicas (plain Trainer, no sync) ...", flush=True)
        alone = independent_pair(tmp, overrides)
        alone_tps = sum(tokens_per_second(r, 1) for r in alone)
        rows.append(["2 independent plain Trainers", f"{alone_tps:,.0f}", "100.0%", "-", "-",
                     f"{max(r['metrics']['peak_rss_mb'] for r in alone):.0f}"])
        raw["independent"] = {"tokens_per_second": alone_tps, "runs": [r["metrics"] for r in alone]}
        for offload in ("true", "false"):
            print(f"DiLoCoTrainer H=50, offload_outer_state={offload} ...", flush=True)
            result = run_training(tmp / f"diloco-{offload}", 2, [*overrides, "--inner_steps", "50",
                                                                  "--offload_outer_state", offload])
            tps = tokens_per_second(result, 2)
            sync = [r["sync_seconds"] for r in result["rounds"]]
            rows.append([f"DiLoCoTrainer, offload_outer_state={offload}", f"{tps:,.0f}", f"{tps / alone_tps:.1%}",
                         f"{sum(sync) / len(sync):.3f}", f"{max(sync):.3f}", f"{result['metrics']['peak_rss_mb']:.0f}"])
            raw[f"diloco_offload_{offload}"] = {"tokens_per_second": tps, "ratio": tps / alone_tps,
                                                "sync_seconds": sync, "metrics": result["metrics"]}
    table = markdown_table(["run (2 replicas)", "tokens/s", "vs independent", "mean sync s/round",
                            "max sync s/round", "peak RSS MB (main)"], rows)
    presets = ["tiny-llama"] if args.quick else ["tiny-llama", "llama-20m"]
    step_rows = [[p, f"{outer_step_seconds(p) * 1000:.1f}"] for p in presets]
    raw["outer_step_ms"] = {row[0]: float(row[1]) for row in step_rows}
    table += "\n\nOuter step alone (pseudo-gradient, Nesterov SGD, copy back; one replica, CPU):\n\n"
    table += markdown_table(["preset", "ms per outer step"], step_rows)
    save("overhead", table, raw, plot(raw))


def plot(raw: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = ["independent", "DiLoCo offload", "DiLoCo on device"]
    values = [raw["independent"]["tokens_per_second"], raw["diloco_offload_true"]["tokens_per_second"],
              raw["diloco_offload_false"]["tokens_per_second"]]
    ax.bar(labels, values, color=["#888", "#1f77b4", "#1f77b4"])
    ax.axhline(0.98 * values[0], color="#d62728", linestyle="--", label="98% target")
    ax.set_ylabel("tokens/s, both replicas")
    ax.legend()
    ax.set_title(f"Throughput over {raw['steps']} steps, 2 CPU replicas")
    return fig


if __name__ == "__main__":
    main()
