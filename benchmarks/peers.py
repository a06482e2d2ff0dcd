"""The peer task run by hf-diloco, torchft's DiLoCo (0.2.0, CPU + gloo) and accelerate's LocalSGD.

Same tiny Llama, data, inner optimizer, batch, H and steps for all (benchmarks/peers/task.py holds the shared
parts; hf-diloco runs through its CLI with recipes/tiny-pretrain.yaml, which encodes the same task). Reports
steady tokens/s over both replicas (steps after the first tenth) and the final held-out loss.
torchft must be installed: pip install -e '.[bench]' (torchft==0.2.0).

    python benchmarks/peers.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from common import REPO, free_port, markdown_table, run_env, run_training, save, tokens_per_second

PEERS = REPO / "benchmarks" / "peers"


def run_accelerate(out: Path, steps: int, inner: int) -> dict:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
               str(free_port()), str(PEERS / "accelerate_localsgd.py"), str(steps), str(inner), str(out)]
    return _run([command], out)


def run_torchft(out: Path, steps: int, inner: int) -> dict | None:
    try:
        from torchft._torchft import LighthouseServer
    except ImportError:
        print("torchft is not installed (pip install torchft==0.2.0); its row is left out.", file=sys.stderr)
        return None
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    try:
        commands = [[sys.executable, str(PEERS / "torchft_diloco.py"), str(r), "2", lighthouse.address(), str(steps),
                     str(inner), str(out)] for r in range(2)]
        return _run(commands, out)
    finally:
        lighthouse.shutdown()


def _run(commands: list[list[str]], out: Path) -> dict:
    procs = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=run_env(1),
                              cwd=PEERS) for c in commands]
    for p in procs:
        _, err = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise SystemExit(f"peer run failed:\n{err[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer steps (under 2 minutes)")
    args = parser.parse_args()
    steps, inner = (60, 20) if args.quick else (400, 50)
    rows, raw = [], {"steps": steps, "inner_steps": inner, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        print("hf-diloco ...", flush=True)
        ours = run_training(tmp / "ours", 2, ["--max_steps", str(steps), "--inner_steps", str(inner),
                                              "--eval_strategy", "steps", "--eval_steps", str(steps),
                                              "--eval_on_start", "false", "--save_strategy", "no"])
        results = {"hf-diloco DiLoCoTrainer": {
            "tokens_per_second": tokens_per_second(ours, 2),
            "eval_loss": ours["metrics"]["eval_loss"]}}
        print("accelerate LocalSGD ...", flush=True)
        results["accelerate LocalSGD"] = run_accelerate(tmp / "accelerate.json", steps, inner)
        print("torchft DiLoCo ...", flush=True)
        torchft = run_torchft(tmp / "torchft.json", steps, inner)
        if torchft is not None:
            results["torchft DiLoCo 0.2.0"] = torchft
    for name, numbers in results.items():
        rows.append([name, f"{numbers['tokens_per_second']:,.0f}", numbers["eval_loss"]])
    raw["runs"] = results
    table = markdown_table([f"implementation (2 CPU replicas, H = {inner}, {steps} steps)", "tokens/s",
                            "final eval loss"], rows)
    save("peers", table, raw, plot(results))


def plot(results: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, numbers in results.items():
        ax.scatter(numbers["tokens_per_second"], numbers["eval_loss"], s=60)
        ax.annotate(name, (numbers["tokens_per_second"], numbers["eval_loss"]), xytext=(5, 3),
                    textcoords="offset points", fontsize=8)
    ax.set_xlabel("tokens/s (both replicas)")
    ax.set_ylabel("final held-out loss")
    ax.set_title("Peers on the same task (lower right is better)")
    return fig


if __name__ == "__main__":
    main()
