"""Run every benchmark and rebuild benchmarks/README.md from their results.

    .venv/bin/python benchmarks/run_all.py            # full set, as root (wan), torchft installed (peers)
    .venv/bin/python benchmarks/run_all.py --quick    # each benchmark's --quick mode
    .venv/bin/python benchmarks/run_all.py --report-only

Run the full set on an otherwise idle machine (the load average is recorded with every result): the ratios are
measured against same-session baselines, but a neighbour's load still widens their spread.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHMARKS = ["quality", "overhead", "wan", "peers"]  # the timed full set (about 30 minutes)
# Fault benchmarks, run on their own (`--only goodput recovery chaos`, about 25 minutes; chaos needs root): their
# sections are reported too.
FAULT_BENCHMARKS = ["goodput", "recovery", "chaos"]
# Replica layouts, run on their own (`--only sharded`, about 10 minutes).
LAYOUT_BENCHMARKS = ["sharded"]
# Users' trainers, run on their own (`--only sft_quality`, about 24 minutes; needs TRL).
TRAINER_BENCHMARKS = ["sft_quality"]
# Inner optimizers, run on their own (`--only muon`, about 42 minutes).
OPTIMIZER_BENCHMARKS = ["muon"]

INTRO = """# Benchmarks

Side-by-side measurements, not tests: each script prints a markdown table, writes a PNG plot and its raw numbers
as JSON in `results/`, and asserts nothing about time. Every script has `--quick` (fewer steps, the same method,
under 3 minutes on 2 idle cores) and a full mode. `.venv/bin/python benchmarks/run_all.py` (as root) runs all four
in sequence and rebuilds this file from `results/`; `--report-only` rebuilds it without running anything.
Measured on 2 idle CPU cores (2026-11-23): the full set in one invocation took 1,262 s (quality 314 s, overhead
110 s, wan 634 s, peers 205 s), and `--quick` 357 s (quality 97 s, overhead 95 s, wan 98 s, peers 66 s). The first
four tables below are that full run. Codec and streaming variants take longer than the timed set allows and ran
on their own, each a full run with the same method (`--variants ...`): their tables follow, named so. A benchmark
that cannot run here (no root for `wan`, no torchft for `peers`) says so in one sentence and is skipped.

How the numbers are made (issue 13, "benchmarks you can trust"):
- One clock: tokens/s = tokens trained ÷ Trainer's wall time of its training loop (`train_runtime`), for every
  row of every table (DiLoCoTrainer, plain Trainer, the peers).
- A ratio's baseline runs in the same invocation and the same conditions, interleaved with what it divides
  (baseline, run, baseline, run, ...) and repeated at least 3 times; tables give the median and [min, max].
- Every shaped-link figure sits beside its physical bound: a host that sent B bytes on the veth during the loop
  spent at least B · 8 ÷ rate seconds on the wire; a row that beats the bound by more than the noise is marked
  INVALID.
- All runs are the shared peer task of DESIGN.md §6 (recipes/tiny-pretrain.yaml). Variants (codecs, streaming)
  are named lists of CLI overrides in `common.VARIANTS`; `--variants` / `--variant 'name=--field value'` pick them.

Requirements beyond `make setup`: `wan` needs root (network namespaces and `tc`); `peers` needs torchft
(`.venv/bin/pip install -e '.[bench]'`).
"""

SECTIONS = {
    "quality": ("Quality on the peer task", "python benchmarks/quality.py",
                "400 steps, batch 8 per replica, 256-token blocks, H = 50, outer Nesterov SGD lr 0.7 momentum 0.9; "
                "DiLoCo M = 1 against the single worker at equal steps, DiLoCo M = 2 against DDP M = 2 at equal "
                "tokens."),
    "overhead": ("Overhead vs the same replicas alone", "python benchmarks/overhead.py",
                 "Two replicas on two CPU processes, no link limit; the replicas alone (two independent plain "
                 "Trainers) and DiLoCoTrainer interleaved, 3 repeats."),
    "wan": ("Two hosts over a shaped link", "sudo python benchmarks/wan.py",
            "Two network namespaces joined by a veth shaped with tc tbf (no added latency: netem is not available "
            "here), one replica each. Utilisation divides by the same runs with syncs off (inner_steps above "
            "max_steps) in the same namespaces, unshaped, interleaved, 3 repeats; beside it the best utilisation "
            "the link allows for the bytes the veth counted."),
    "peers": ("Peers on the same task", "python benchmarks/peers.py",
              "DiLoCoTrainer, torchft's DiLoCo 0.2.0 and accelerate's LocalSGD inside the same Trainer inner "
              "loop and launcher; the final parameters of DiLoCoTrainer and torchft hashed and compared."),
    "quality-variants": ("Quality of the codecs and streaming on the peer task",
                         "python benchmarks/quality.py --variants fp32 int8 int4+EF SparseLoCo "
                         "'stream F=5 tau=2 int4+EF'",
                         "The same method as the quality table, with the codec and streaming rows (a separate full "
                         "run; its results are kept as results/quality-variants.*)."),
    "wan-variants": ("Codecs and streaming over a shaped link", "sudo python benchmarks/wan.py --variants fp32 "
                     "'stream F=5 tau=2 int4+EF' int8",
                     "The same method as the two-hosts table, with int8 and streaming (F = 5, τ = 2, int4 + error "
                     "feedback) beside fp32, 3 interleaved repeats (a separate full run; results/wan-variants.*)."),
    "goodput": ("Replicas that die or lag: torch against torchft", "python benchmarks/goodput.py",
                "Three replicas on this machine; one replica killed every few rounds and restarted; the torch "
                "backend (barrier, the launch restarted from the newest round checkpoint) against torchft (the "
                "others go on, the restarted one heals). Replicas of unequal speed: \"Replicas of unequal speed "
                "under real CPU quotas\" (benchmarks/speeds.py)."),
    "recovery": ("What a dead process costs a fixed-world launch", "python benchmarks/recovery.py",
                 "Two replicas under `hf-diloco launch --max-restarts 1` with round checkpoints; replica 1 "
                 "SIGKILLed half-way through a round, interleaved with undisturbed launches."),
    "chaos": ("Chaos: kills, a cut link and a slow link at three sites", "sudo python benchmarks/chaos.py",
              "One torchft run of 3 replicas at 3 sites (network namespaces on one switch, the Lighthouse on the "
              "switch), each site started as a user would (`hf-diloco launch ... --max-restarts 5`); replicas killed "
              "at random, site 1's link cut for 30 s, site 2's slowed to 1 Mbit/s; against the same run with no "
              "fault in the same namespaces."),
    "sharded": ("Replicas bigger than one device: FSDP2 inside a replica", "python benchmarks/sharded.py",
                "Two replicas of two CPU processes each on the peer task, FSDP2 inside each replica "
                "(`accelerate_configs/cpu-fsdp-2x2.yaml`) against DDP inside (`--replica_group_size 2`), "
                "interleaved, 3 repeats; bytes per round beside the algorithm's count, and the memory per process "
                "the dry run prints for the tiny model, `paper-150m-c4` and the 7B preset."),
    "sft-quality": ("Fine-tuning with TRL's SFTTrainer: DiLoCo against DDP at equal tokens",
                    "python benchmarks/sft_quality.py",
                    "recipes/sft-lora.yaml (LoRA r 8, built-in chat data, batch 8 per process) on a tiny Llama first "
                    "pretrained 400 steps on the built-in corpus; TRL's own SFTTrainer under DDP (benchmarks/"
                    "sft_ddp.py) against DiLoCoSFTTrainer with 2 replicas, 400 steps each (40 rounds of H = 10), "
                    "seeds 0, 1 and 2 interleaved. A study of DiLoCo fine-tuning at scale (arXiv 2511.13761) found "
                    "it below DDP; here the gap is within about 1% after 40 rounds with outer Nesterov momentum, "
                    "which trails DDP over the first rounds while the momentum builds up."),
    "muon": ("Muon as the inner optimizer: DiLoCo and DDP at equal tokens", "python benchmarks/muon.py",
             "`inner_optimizer: muon` (Muon for the weight matrices, AdamW for embeddings, heads and vectors) against "
             "AdamW, DiLoCo M = 2 and 4 (40 syncs of H = 5, 200 steps per replica, fp32 syncs, outer Nesterov SGD "
             "0.7 / 0.9) and DDP on as many processes with the same optimizer, seeds 0, 1 and 2 interleaved; the "
             "peer task with 64-token blocks, batch 8 per process. MuLoCo (arXiv 2505.23725) reports Muon ahead of "
             "AdamW inside DiLoCo from 150M to 3.1B parameters; this is the comparison at 1M parameters."),
    "gpu": ("One CUDA device: throughput, one outer sync, the codecs and memory", "python benchmarks/gpu.py",
            "The llama-150m preset in bf16 autocast, batch 8 × 1,024 tokens: DiLoCoTrainer (M = 1, H = 50) against "
            "plain Trainer, 3 interleaved repeats; two torchft replicas sharing the device (gloo across them, as "
            "NCCL refuses two ranks on one device); one outer sync with the outer state in pinned host memory and "
            "on the device; int8, int4 + EF and sparse + EF against H steps' compute; peak memory against the dry "
            "run plus one batch's activations. Targets: ≥ 99% of plain Trainer's tokens/s, one sync under 1% of H "
            "steps, peak memory within 10%. No GPU machine could be had so far: `--smoke` runs the same code on "
            "the tiny preset in the tests (tests/test_gpu_benchmark.py)."),
}


def write_report() -> None:
    parts = [INTRO]
    for name, (title, command, about) in SECTIONS.items():
        table = HERE / "results" / f"{name}.md"
        parts.append(f"## {title}\n\n`{command}`. {about}\n")
        parts.append(table.read_text() if table.exists() else "_not run yet_\n")
        if (HERE / "results" / f"{name}.png").exists():
            parts.append(f"![{name}](results/{name}.png)\n")
    targets = HERE / "targets.md"
    if targets.exists():
        parts.append(targets.read_text())
    (HERE / "README.md").write_text("\n".join(parts))
    print(f"wrote {HERE / 'README.md'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", nargs="*",
                        choices=BENCHMARKS + FAULT_BENCHMARKS + LAYOUT_BENCHMARKS + TRAINER_BENCHMARKS
                        + OPTIMIZER_BENCHMARKS,
                        help="run these only (the report uses all results)")
    parser.add_argument("--report-only", action="store_true", help="rebuild README.md from results/ only")
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.2f}", flush=True)
    started = time.time()
    for name in [] if args.report_only else args.only or BENCHMARKS:
        began = time.time()
        print(f"=== {name} ===", flush=True)
        command = [sys.executable, str(HERE / f"{name}.py"), *(["--quick"] if args.quick else [])]
        if subprocess.run(command, cwd=HERE.parent).returncode != 0:
            sys.exit(f"{name} failed")
        print(f"=== {name}: {time.time() - began:.0f} s ===", flush=True)
    print(f"all: {time.time() - started:.0f} s", flush=True)
    write_report()


if __name__ == "__main__":
    main()
