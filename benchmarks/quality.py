"""Quality at equal tokens: the shape of the DiLoCo paper's main table, at small scale.

Single worker (same number of steps, so M x fewer tokens), DDP with M replicas, DiLoCo with M replicas and several
H, FedAvg (outer lr 1, no momentum). All multi-replica runs see the same total tokens. Reports the final held-out
loss, the number of syncs and the bytes each replica sent.

    python benchmarks/quality.py [--quick]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from common import markdown_table, run_training, save


def configurations(quick: bool) -> list[dict]:
    replicas = [2] if quick else [2, 4]
    inner = [10, 50] if quick else [10, 50, 200]
    configs = [{"name": "single worker", "trainer": "ddp", "replicas": 1}]
    configs += [{"name": f"DDP M={m}", "trainer": "ddp", "replicas": m} for m in replicas]
    configs += [{"name": f"DiLoCo M={m} H={h}", "trainer": "diloco", "replicas": m, "H": h}
                for m in replicas for h in inner]
    configs += [{"name": "FedAvg M=2 H=50", "trainer": "diloco", "replicas": 2, "H": 50, "outer": ["--outer_lr", "1",
                 "--outer_momentum", "0", "--outer_nesterov", "false"]}]
    return configs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer steps and configurations (under 2 minutes)")
    args = parser.parse_args()
    steps = 100 if args.quick else 400
    block = 64
    common = ["--max_steps", str(steps), "--block_size", str(block), "--eval_strategy", "steps",
              "--eval_steps", str(steps), "--eval_on_start", "false", "--save_strategy", "no"]
    from hf_diloco.models import build_preset, byte_tokenizer

    params = sum(p.numel() for p in build_preset("tiny-llama", byte_tokenizer()).parameters())
    rows, raw = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i, config in enumerate(configurations(args.quick)):
            overrides = [*common, "--trainer", config["trainer"], *config.get("outer", [])]
            if "H" in config:
                overrides += ["--inner_steps", str(config["H"])]
            print(f"[{i + 1}] {config['name']} ...", flush=True)
            result = run_training(Path(tmp) / f"run{i}", config["replicas"], overrides)
            m = config["replicas"]
            if "summary" in result:
                syncs = result["summary"]["rounds"]
                sent = result["summary"]["bytes_per_replica"]
            else:  # DDP: one fp32 gradient all-reduce per step, 2 (M-1)/M of the payload per replica
                syncs = steps if m > 1 else 0
                sent = steps * 2 * (m - 1) * params * 4 // m
            tokens = steps * 8 * block * m
            loss = result["metrics"]["eval_loss"]
            rows.append([config["name"], f"{tokens:,}", f"{loss:.4f}", syncs, f"{sent / 1e6:,.1f}",
                         f"{result['wall_seconds']:.0f}"])
            raw.append({**config, "steps": steps, "tokens": tokens, "eval_loss": loss, "syncs": syncs,
                        "bytes_per_replica": sent, "wall_seconds": result["wall_seconds"]})
    table = markdown_table(["method", "tokens", "final eval loss", "syncs", "MB sent per replica", "wall s"], rows)
    save("quality", table, {"steps": steps, "block_size": block, "runs": raw}, plot(raw))


def plot(raw: list[dict]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r["name"] for r in raw]
    colors = ["#888" if r["trainer"] == "ddp" else "#d62728" if "FedAvg" in r["name"] else "#1f77b4" for r in raw]
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
    right.set_xlabel("MB sent per replica (log)")
    right.set_ylabel("final held-out loss")
    fig.suptitle("Quality at equal tokens (tiny-llama, built-in corpus)")
    return fig


if __name__ == "__main__":
    main()
