"""Quality on the shared peer task: the DiLoCo paper's comparisons at small scale.

Rows (DESIGN.md §6 task: 400 steps, batch 8 per replica, 256-token blocks, H = 50, outer Nesterov SGD lr 0.7
momentum 0.9; final held-out loss on the last 5% of the blocks):
- single worker: plain Trainer, one process, 400 steps;
- DiLoCo M = 1 against it at equal steps (the scaling-laws paper, arXiv 2503.09799, finds M = 1 DiLoCo ahead of
  plain training at every size);
- DDP M = 2 (gradients all-reduced every step) against DiLoCo M = 2 at equal tokens, one DiLoCo row per variant
  (codecs, streaming: see common.VARIANTS), with the syncs and the bytes each replica sent.
Loss, not speed, is measured here, so one-process runs share the two cores (two at a time).

    python benchmarks/quality.py [--quick] [--variants fp32 ...] [--variant 'name=--field v ...']
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from common import RunFailed, add_variant_arguments, markdown_table, pyplot, run_concurrently, save, selected_variants


def configurations(variants: dict[str, list[str]], inner: int) -> list[dict]:
    configs = [
        {"name": "single worker (plain Trainer)", "trainer": "ddp", "replicas": 1, "compare": None},
        {"name": f"DiLoCo M=1 H={inner}", "trainer": "diloco", "replicas": 1, "compare": 0},
        {"name": "DDP M=2", "trainer": "ddp", "replicas": 2, "compare": None},
    ]
    configs += [{"name": f"DiLoCo M=2 H={inner} {name}", "trainer": "diloco", "replicas": 2, "compare": 2,
                 "variant": name, "overrides": extra} for name, extra in variants.items()]
    return configs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="100 steps, H = 25 (under 3 minutes)")
    add_variant_arguments(parser, default=["fp32"])
    args = parser.parse_args()
    started = time.time()
    variants = selected_variants(args)
    steps, inner = (100, 25) if args.quick else (400, 50)
    common = ["--max_steps", str(steps), "--inner_steps", str(inner), "--eval_strategy", "steps", "--eval_steps",
              str(steps), "--eval_on_start", "false", "--save_strategy", "no", "--save_every_rounds", "0",
              "--logging_steps", str(steps)]
    from hf_diloco.comm import ring_all_reduce_bytes
    from hf_diloco.models import build_preset, byte_tokenizer

    gradient_bytes = sum(p.numel() * 4 for p in build_preset("tiny-llama", byte_tokenizer()).parameters())
    configs = configurations(variants, inner)
    with tempfile.TemporaryDirectory() as tmp:
        jobs = [(Path(tmp) / f"run{i}", c["replicas"], [*common, "--trainer", c["trainer"], *c.get("overrides", [])])
                for i, c in enumerate(configs)]
        try:
            results = run_concurrently(jobs)
        except RunFailed as error:
            sys.exit(str(error))
    raw = []
    for config, result in zip(configs, results, strict=True):
        m = config["replicas"]
        if "summary" in result:
            syncs, sent = result["summary"]["rounds"], result["summary"]["bytes_per_replica"]
        else:  # DDP: one fp32 gradient all-reduce per step
            syncs, sent = (steps if m > 1 else 0), steps * ring_all_reduce_bytes(gradient_bytes, m)
        raw.append({**config, "steps": steps, "tokens": steps * 8 * 256 * m, "eval_loss":
                    result["metrics"]["eval_loss"], "syncs": syncs, "bytes_per_replica": sent})
    rows = []
    for r in raw:
        reference = raw[r["compare"]] if r["compare"] is not None else None
        versus = (f"{r['eval_loss'] / reference['eval_loss'] - 1:+.2%} vs {reference['name']}"
                  if reference else "-")
        rows.append([r["name"], f"{r['tokens']:,}", f"{r['eval_loss']:.4f}", versus, r["syncs"],
                     f"{r['bytes_per_replica'] / 1e6:,.1f}"])
    table = markdown_table(["method", "tokens", "final eval loss", "relative to", "syncs", "MB sent per replica"],
                           rows)
    table += (f"\n\n{steps} steps each, one run each (seed 0). DiLoCo M=1 is compared with the single worker at "
              f"equal steps, DiLoCo M=2 with DDP M=2 at equal tokens. DDP bytes: a ring all-reduce of the fp32 "
              f"gradients per step.")
    save("quality", table, {"steps": steps, "inner_steps": inner, "variants": variants, "runs": raw}, plot(raw),
         quick=args.quick, seconds=time.time() - started)


def plot(raw: list[dict]):
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
    fig.suptitle("Quality on the peer task (tiny Llama, built-in corpus, 256-token blocks)")
    return fig


if __name__ == "__main__":
    main()
