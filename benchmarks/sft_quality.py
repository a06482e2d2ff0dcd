"""SFT quality: TRL's SFTTrainer with DiLoCo (M = 2) against plain SFT with data parallelism, at equal tokens.

Task: recipes/sft-lora.yaml (LoRA r 8 on the attention's query and value projections, built-in chat data, the last
5% held out, batch 8 per process, AdamW lr 2e-3, 10 warmup steps then cosine), fine-tuning a tiny Llama first
pretrained on the built-in corpus (recipes/tiny-pretrain.yaml as the plain Trainer, one process, 400 steps), so the
SFT starts from a model that knows the text, as a user's does.
Rows (2 processes each, run one after another, the same starting model and seed):
- DDP M = 2: TRL's own SFTTrainer under `accelerate launch`, gradients all-reduced every step (benchmarks/sft_ddp.py);
- DiLoCo M = 2, H = 10, outer Nesterov SGD lr 0.7, momentum 0.9 (the recipe's outer settings);
- DiLoCo M = 2, H = 10, outer SGD lr 1.0, no momentum (plain averaging of the replicas, as accelerate's LocalSGD);
400 steps each: 40 rounds for the DiLoCo rows, 6,400 conversations for every row. Eval loss (all tokens of the
held-out conversations, as SFTTrainer computes it) every 40 steps and at the start. Each row runs once per seed
(`--seeds`, default 0 1 2: the LoRA adapters' initial values and the data order), interleaved; the table gives the
median and [min, max] of the final eval loss, and of each seed's gap to DDP with the same seed.

    python benchmarks/sft_quality.py [--quick] [--seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, RunFailed, free_port, markdown_table, pyplot, save, show, spread, train_command

SFT_RECIPE = REPO / "recipes" / "sft-lora.yaml"
REPLICAS, BATCH = 2, 8
ROWS = [  # name (H filled in), how it trains, extra flags
    ("DDP M=2 (TRL SFTTrainer)", "ddp", []),
    ("DiLoCo M=2 H={H}, outer Nesterov 0.7 / 0.9", "diloco", ["--outer_lr", "0.7", "--outer_momentum", "0.9"]),
    ("DiLoCo M=2 H={H}, averaging (outer lr 1, no momentum)", "diloco",
     ["--outer_lr", "1.0", "--outer_momentum", "0.0", "--outer_nesterov", "false"]),
]


def launch(script: list[str], overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(REPLICAS),
            "--num_machines", "1", "--main_process_port", str(free_port()), "--mixed_precision", "no",
            "--dynamo_backend", "no", *script, "--config", str(SFT_RECIPE), "--disable_tqdm", "true", *overrides]


def eval_curve(folder: Path) -> list[tuple[int, float]]:
    """(step, eval loss) from the run's trainer_log.jsonl."""
    lines = (folder / "trainer_log.jsonl").read_text().splitlines()
    return [(r["step"], r["eval_loss"]) for r in map(json.loads, lines) if "eval_loss" in r]


def main() -> None:
    from common import Processes

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="100 pretraining and 80 SFT steps (H = 4, 20 rounds)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="one run of every row per seed")
    args = parser.parse_args()
    started = time.time()
    pretrain_steps, steps, inner = (100, 80, 4) if args.quick else (400, 400, 10)
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "pretrained"
        print(f"pretraining the tiny Llama ({pretrain_steps} steps, one process)", flush=True)
        try:
            Processes([train_command(1, ["--output_dir", str(base), "--trainer", "ddp", "--max_steps",
                                         str(pretrain_steps), "--eval_strategy", "no", "--report_to", "none",
                                         "--save_every_rounds", "0"])]).wait()
            common = ["--model_name_or_path", str(base), "--max_steps", str(steps), "--inner_steps", str(inner),
                      "--eval_strategy", "steps", "--eval_steps", str(steps // 10), "--eval_on_start", "true",
                      "--save_every_rounds", "0", "--report_to", "none", "--logging_steps", str(steps // 10)]
            raw = []
            for seed, (index, (name, kind, extra)) in ((s, r) for s in args.seeds for r in enumerate(ROWS)):
                name = name.format(H=inner)
                out = Path(tmp) / f"run{index}-seed{seed}"
                print(f"  {name}, seed {seed}", flush=True)
                script = ([str(REPO / "benchmarks" / "sft_ddp.py")] if kind == "ddp"
                          else ["-m", "hf_diloco.cli", "train"])
                Processes([launch(script, ["--output_dir", str(out), "--seed", str(seed), *common, *extra])]).wait(
                    timeout=3600)
                metrics = json.loads((out / "run_metrics.json").read_text())
                raw.append({"name": name, "kind": kind, "seed": seed, "steps": steps, "inner_steps": inner,
                            "conversations": steps * BATCH * REPLICAS, "eval_loss": metrics["eval_loss"],
                            "eval_loss_initial": metrics["eval_loss_initial"], "curve": eval_curve(out)})
        except RunFailed as error:
            sys.exit(str(error))
    save("sft-quality", table(raw, steps, inner, pretrain_steps),
         {"steps": steps, "inner_steps": inner, "pretrain_steps": pretrain_steps, "seeds": args.seeds, "runs": raw},
         plot(raw),
         quick=args.quick, seconds=time.time() - started)


def table(raw: list[dict], steps: int, inner: int, pretrain_steps: int) -> str:
    ddp = {r["seed"]: r["eval_loss"] for r in raw if r["kind"] == "ddp"}
    rows = []
    for name in dict.fromkeys(r["name"] for r in raw):
        runs = [r for r in raw if r["name"] == name]
        final = spread([r["eval_loss"] for r in runs])
        gap = spread([100 * (r["eval_loss"] / ddp[r["seed"]] - 1) for r in runs])
        rows.append([name, f"{runs[0]['conversations']:,}", len(runs), f"{runs[0]['eval_loss_initial']:.4f}",
                     show(final, "{:.4f}"), "-" if runs[0]["kind"] == "ddp" else show(gap, "{:+.2f}%"),
                     "-" if runs[0]["kind"] == "ddp" else steps // inner])
    return markdown_table(["method", "conversations", "seeds", "eval loss at start", "final eval loss",
                           "vs DDP (same seed)", "syncs"], rows) + (
        f"\n\n{steps} steps each ({steps // inner} rounds of H = {inner} for DiLoCo), LoRA SFT of a tiny Llama "
        f"pretrained {pretrain_steps} steps; median [min, max] over the seeds, 2 processes on this machine's 2 "
        f"cores.")


def plot(raw: list[dict]):
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(7, 4))
    colors = {}
    for r in raw:  # every seed's curve, one colour per method
        steps, losses = zip(*r["curve"], strict=True)
        first = r["name"] not in colors
        line = axis.plot([s * BATCH * REPLICAS for s in steps], losses, marker="o", markersize=2, linewidth=1,
                         color=colors.get(r["name"]), label=r["name"] if first else None)[0]
        colors.setdefault(r["name"], line.get_color())
    axis.set_xlabel("conversations trained on (both processes)")
    axis.set_ylabel("held-out eval loss")
    axis.set_title("LoRA SFT on the built-in chat data: DiLoCo vs DDP at equal tokens (each seed a line)")
    axis.legend(fontsize=8)
    axis.grid(alpha=0.3)
    return figure


if __name__ == "__main__":
    main()
