"""Replicas bigger than one device: 2 replicas x 2 processes, FSDP2 or tensor parallel inside each replica against
DDP inside.

The peer task (recipes/tiny-pretrain.yaml, DESIGN.md §6) on 4 CPU processes (gloo over loopback, one thread
each), interleaved and repeated: each repeat runs the DDP-inside layout (`--replica_group_size 2`), the FSDP2
layout (`accelerate_configs/cpu-fsdp-2x2.yaml`) and the tensor-parallel layout (`cpu-tp-2x2.yaml`). Reported per
layout:
- tokens/s of all four processes (tokens ÷ Trainer's loop wall time), median [min, max] of the repeats, and the
  ratio to DDP inside of each repeat. With DDP or FSDP2 inside, each process trains on its own batches; with
  tensor parallel the two processes of a replica compute on the same batch, so four processes train two batches a
  step;
- bytes each process sends across replicas per round, and inside its replica per round, from the round records,
  beside the algorithm's count (ring all-reduce: 2 (M − 1)/M × 4 bytes × the values a process syncs: 1/g of the
  model, or with tensor parallel half of each projection and the rest whole); a record above or below it is a bug;
- peak resident memory per process (the largest of the four), and the memory per process the dry run prints
  for the tiny model, for `paper-150m-c4` and for the 7B preset on `fsdp-nodes.yaml` against `hybrid.yaml`, and
  on the tensor-parallel configs (`tp-nodes.yaml`; with FSDP2 beside it, `fsdp-tp-nodes.yaml` and
  `cpu-fsdp-tp-2x4.yaml`, whose 8 processes are not timed here: on 2 cores they measure oversubscription).

    python benchmarks/sharded.py [--quick] [--repeats N]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import (
    REPO,
    RESULTS,
    Processes,
    RunFailed,
    free_port,
    loop_tokens_per_second,
    markdown_table,
    read_run,
    save,
    show,
    spread,
    spread_bars,
    train_command,
)

FSDP_CONFIG = REPO / "accelerate_configs" / "cpu-fsdp-2x2.yaml"
TP_CONFIG = REPO / "accelerate_configs" / "cpu-tp-2x2.yaml"
LAYOUTS = {
    "DDP inside": (["--multi_gpu", "--num_processes", "4", "--num_machines", "1"], ["--replica_group_size", "2"]),
    "FSDP2 inside": (["--config_file", str(FSDP_CONFIG)], []),
    "tensor parallel inside": (["--config_file", str(TP_CONFIG)], []),
}
# Batches trained per step by the four processes: one each, or one per replica with tensor parallel.
BATCHES = {"DDP inside": 4, "FSDP2 inside": 4, "tensor parallel inside": 2}
PROCESSES, REPLICAS, GROUP = 4, 2, 2


def run_layout(output_dir: Path, layout: str, common: list[str]) -> dict:
    launch, extra = LAYOUTS[layout]
    command = train_command(PROCESSES, ["--output_dir", str(output_dir), *common, *extra],
                            launch=[*launch, "--main_process_port", str(free_port())])
    output_dir.mkdir(parents=True, exist_ok=True)
    with (output_dir.parent / f"{output_dir.name}.log").open("w") as log:  # every process's output, kept whole
        Processes([command], on_line=log.write).wait()
    return read_run(output_dir)


def tensor_parallel_values(tp: int) -> float:
    """Values a tensor-parallel process of the peer model syncs: 1/tp of each attention and MLP projection (counted
    by name here) and every other parameter whole."""
    from hf_diloco.models import build_preset, byte_tokenizer

    model = build_preset("tiny-llama", byte_tokenizer())
    split = sum(p.numel() for name, p in model.named_parameters() if name.endswith("_proj.weight"))
    return split / tp + sum(p.numel() for p in model.parameters()) - split


def dry_run_memory(recipe: str, config: str, *extra: str) -> str:
    """The dry run's "memory per process" row for a recipe under an accelerate config."""
    command = [sys.executable, "-m", "hf_diloco.cli", "launch", str(REPO / "recipes" / recipe), "--accelerate-config",
               str(REPO / "accelerate_configs" / config), "--dry-run", "--", *extra]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, check=True)
    row = next(line for line in result.stdout.splitlines() if line.strip().startswith("memory per process"))
    return re.split(r"\s{2,}", row.strip(), maxsplit=1)[1].split(";")[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="40 steps, H = 20 (about 3 minutes)")
    parser.add_argument("--repeats", type=int, default=3, help="repeats, interleaved (at least 3)")
    args = parser.parse_args()
    if args.repeats < 3:
        sys.exit("--repeats must be at least 3: a median and a spread need three runs.")
    started = time.time()
    steps, inner = (40, 20) if args.quick else (100, 50)
    common = ["--max_steps", str(steps), "--inner_steps", str(inner), "--eval_strategy", "no", "--eval_on_start",
              "false", "--save_strategy", "no", "--save_every_rounds", "0", "--logging_steps", str(steps),
              "--report_to", "none"]
    runs = []
    with tempfile.TemporaryDirectory() as tmp_name:
        logs = Path(tmp_name)
        try:
            for repeat in range(args.repeats):
                for layout in LAYOUTS:
                    print(f"repeat {repeat + 1}/{args.repeats}: 2 x 2, {layout} ...", flush=True)
                    result = run_layout(Path(tmp_name) / f"r{repeat}-{layout.split()[0]}", layout, common)
                    rounds = result["rounds"]
                    runs.append({"repeat": repeat, "layout": layout,
                                 "tokens_per_second": loop_tokens_per_second(result, BATCHES[layout]),
                                 "bytes_per_round": max(r["bytes_per_replica"] for r in rounds),
                                 "intra_replica_bytes": max(r["intra_replica_bytes"] for r in rounds),
                                 "synced_parameters": rounds[0]["synced_parameters"],
                                 "peak_rss_mb": result["metrics"].get("peak_rss_mb")})
        except RunFailed as error:
            kept = RESULTS / "sharded-failed-runs"
            kept.mkdir(parents=True, exist_ok=True)
            for log in logs.glob("*.log"):
                (kept / log.name).write_text(log.read_text())
            sys.exit(f"{error}\n(the runs' whole output is kept in {kept})")
    numel = runs[0]["synced_parameters"]
    ring = 2 * (REPLICAS - 1) / REPLICAS * 4  # bytes an fp32 ring all-reduce sends per value a process syncs
    bounds = {layout: ring * numel / GROUP for layout in LAYOUTS}
    bounds["tensor parallel inside"] = ring * tensor_parallel_values(GROUP)
    summary, rows = {}, []
    for layout in LAYOUTS:
        mine = [r for r in runs if r["layout"] == layout]
        sent, bound = max(r["bytes_per_round"] for r in mine), bounds[layout]
        # The statistics riding with the sync add a few dozen values; FSDP2's row padding a few rows.
        if not 0.99 * bound <= sent <= 1.01 * bound:
            sys.exit(f"{layout}: {sent} bytes per round, but the algorithm sends {bound:.0f}: a miscount.")
        summary[layout] = {"tokens_per_second": spread([r["tokens_per_second"] for r in mine]),
                           "bytes_per_round": sent, "intra_replica_bytes": max(r["intra_replica_bytes"] for r in mine),
                           "peak_rss_mb": spread([r["peak_rss_mb"] for r in mine if r["peak_rss_mb"] is not None]
                                                 or [float("nan")])}
    ratio = {layout: spread([f["tokens_per_second"] / d["tokens_per_second"] for f, d in zip(
        [r for r in runs if r["layout"] == layout], [r for r in runs if r["layout"] == "DDP inside"], strict=True)])
        for layout in LAYOUTS}
    for layout, s in summary.items():
        rows.append([f"2 x 2, {layout}", show(s["tokens_per_second"]),
                     show(ratio[layout], "{:.1%}") if layout != "DDP inside" else "100%",
                     f"{s['bytes_per_round'] / 1e6:.3f} MB", f"{bounds[layout] / 1e6:.3f} MB",
                     f"{s['intra_replica_bytes'] / 1e6:.6f} MB", show(s["peak_rss_mb"], "{:.0f}")])
    table = markdown_table(["layout (peer task, 4 CPU processes)", "tokens/s", "vs DDP inside",
                            "sent across replicas per process per round", "algorithm's count (fp32 ring)",
                            "sent inside the replica per round", "peak RSS MB (largest process)"], rows)
    table += (f"\n\n{steps} steps, H = {inner}, {args.repeats} repeats interleaved; median [min, max]; the ratio "
              f"divides each run by the DDP-inside run of the same repeat. Tensor parallel: the four processes "
              f"train one batch per replica each step, two in all.")
    print("dry runs of the memory per process ...", flush=True)
    memory = {
        "tiny-llama, 2 x 2, DDP inside": dry_run_memory("tiny-pretrain.yaml", "cpu-4proc.yaml",
                                                        "--replica_group_size", "2"),
        "tiny-llama, 2 x 2, FSDP2": dry_run_memory("fsdp-replicas.yaml", "cpu-fsdp-2x2.yaml"),
        "paper-150m-c4, 2 nodes x 8 GPUs, DDP inside": dry_run_memory("paper-150m-c4.yaml", "hybrid.yaml",
                                                                      "--replica_group_size", "8"),
        "paper-150m-c4, 2 nodes x 8 GPUs, FSDP2": dry_run_memory("paper-150m-c4.yaml", "fsdp-nodes.yaml"),
        "llama-7b, 2 nodes x 8 GPUs, DDP inside": dry_run_memory("paper-150m-c4.yaml", "hybrid.yaml",
                                                                 "--replica_group_size", "8", "--model_name_or_path",
                                                                 "llama-7b"),
        "llama-7b, 2 nodes x 8 GPUs, FSDP2": dry_run_memory("paper-150m-c4.yaml", "fsdp-nodes.yaml",
                                                            "--model_name_or_path", "llama-7b"),
        "tiny-llama, 2 x 2, tensor parallel": dry_run_memory("tp-replicas.yaml", "cpu-tp-2x2.yaml"),
        "llama-7b, 2 nodes x 8 GPUs, tensor parallel": dry_run_memory("paper-150m-c4.yaml", "tp-nodes.yaml",
                                                                      "--model_name_or_path", "llama-7b"),
        "tiny-llama, 2 x (2 x 2), tensor parallel + FSDP2": dry_run_memory("fsdp-tp-replicas.yaml",
                                                                           "cpu-fsdp-tp-2x4.yaml"),
        "llama-7b, 2 nodes x 8 GPUs, tensor parallel 4 + FSDP2 2": dry_run_memory(
            "paper-150m-c4.yaml", "fsdp-tp-nodes.yaml", "--model_name_or_path", "llama-7b"),
    }
    table += "\n\n" + markdown_table(["model, layout", "memory per process (dry run; activations not counted)"],
                                     [[name, row] for name, row in memory.items()])
    save("sharded", table, {"steps": steps, "inner_steps": inner, "repeats": args.repeats, "bound_bytes": bounds,
                            "summary": summary, "ratio": ratio, "memory": memory, "runs": runs},
         plot(summary), quick=args.quick, seconds=time.time() - started)


def plot(summary: dict):
    labels = list(summary)
    fig, _ = spread_bars(labels, [summary[name]["tokens_per_second"] for name in labels],
                         ["#888", "#1f77b4", "#ff7f0e"][: len(labels)], "tokens/s, 4 processes (median, [min, max])",
                         "2 replicas x 2 processes: FSDP2 and tensor parallel against DDP inside", size=(8, 3.5))
    return fig


if __name__ == "__main__":
    main()
