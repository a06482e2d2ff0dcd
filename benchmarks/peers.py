"""The peer task run by hf-diloco's DiLoCoTrainer, torchft's DiLoCo (0.2.0) and accelerate's LocalSGD, and whether
DiLoCoTrainer and torchft end with the same parameters. Every implementation runs under the same `accelerate launch`
(2 processes, one replica each, gloo) with the same recipe and flags; the peers run inside the same
`transformers.Trainer` inner loop (benchmarks/peers/in_trainer.py), so model, batches, loss, optimizer, schedule and
clipping are identical and only the cross-replica algorithm differs. With the paper's outer settings (Nesterov SGD,
lr 0.7, momentum 0.9), DiLoCoTrainer and torchft's DiLoCo compute the same thing: the benchmark hashes both final
models and says whether they match. Tokens/s come from Trainer's loop wall time for every row; the implementations
run interleaved in counterbalanced order (ours, torchft; torchft, ours; ...), `--repeats` times (4 by default), and
the table gives the median and [min, max], and each repeat's ratio to torchft's run of the same repeat.
Needs torchft: pip install -e '.[bench]' (torchft==0.2.0).

    python benchmarks/peers.py [--quick] [--localsgd]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from common import (
    REPO,
    Processes,
    RunFailed,
    free_port,
    loop_tokens_per_second,
    markdown_table,
    parameter_hash,
    pyplot,
    run_training,
    save,
    show,
    skip,
    spread,
    spread_errors,
)

from hf_diloco.files import read_json

PEERS = REPO / "benchmarks" / "peers"
OURS, TORCHFT = "hf-diloco DiLoCoTrainer", "torchft DiLoCo 0.2.0"


def run_peer(peer: str, out: Path, overrides: list[str], lighthouse: str = "-") -> dict:
    """One peer under accelerate launch with 2 processes; its loop numbers and its final model's hash."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
               str(free_port()), str(PEERS / "in_trainer.py"), peer, lighthouse, str(out / "peer.json"),
               "--output_dir", str(out), "--disable_tqdm", "true", *overrides]
    Processes([command]).wait()
    numbers = read_json(out / "peer.json")
    metrics = {"metrics": {"train_runtime": numbers["train_runtime"], "global_step": numbers["global_step"]}}
    return {"tokens_per_second": loop_tokens_per_second(metrics, 2), "eval_loss": numbers["eval_loss"],
            "parameter_hash": parameter_hash(out)}


def run_ours(out: Path, overrides: list[str]) -> dict:
    """DiLoCoTrainer through `hf-diloco train`, under the same launcher and flags as the peers."""
    result = run_training(out, 2, overrides)
    return {"tokens_per_second": loop_tokens_per_second(result, 2), "eval_loss": result["metrics"]["eval_loss"],
            "parameter_hash": parameter_hash(out)}


def run_torchft(out: Path, overrides: list[str]) -> dict:
    """torchft's DiLoCo, with a Lighthouse of its own in this process for the run's two replicas."""
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    try:
        return run_peer("torchft", out, overrides, lighthouse.address())
    finally:
        lighthouse.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="60 steps, H = 20, one repeat (under 3 minutes)")
    parser.add_argument("--repeats", type=int, help="interleaved repeats of every implementation, in counterbalanced "
                                                     "order (default 4; 1 with --quick)")
    parser.add_argument("--localsgd", action=argparse.BooleanOptionalAction,
                        help="also run accelerate's LocalSGD (default: with --quick only; in full mode its 400 steps "
                             "would push the full set past 30 minutes)")
    args = parser.parse_args()
    localsgd = args.quick if args.localsgd is None else args.localsgd
    started = time.time()
    os.environ.setdefault("RUST_LOG", "warn")  # the in-process Lighthouse logs every quorum at info level
    try:
        import torchft._torchft  # noqa: F401
    except ImportError:
        skip("peers", "torchft is not installed (pip install -e '.[bench]' installs torchft==0.2.0).")
    steps, inner = (60, 20) if args.quick else (400, 50)
    overrides = ["--max_steps", str(steps), "--inner_steps", str(inner), "--eval_strategy", "steps", "--eval_steps",
                 str(steps), "--eval_on_start", "false", "--save_strategy", "no", "--save_every_rounds", "0",
                 "--logging_steps", str(steps)]
    repeats = args.repeats or (1 if args.quick else 4)
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        try:
            for repeat in range(repeats):
                tmp = Path(tmp_name) / f"repeat{repeat}"
                # Counterbalanced order (ours, torchft; torchft, ours; ...): a machine that slows down or speeds up
                # during a repeat weighs on both implementations alike instead of always on the one that runs first.
                order = [OURS, TORCHFT] if repeat % 2 == 0 else [TORCHFT, OURS]
                for name in order:
                    print(f"repeat {repeat + 1}/{repeats}: {name} ...", flush=True)
                    runs.setdefault(name, []).append(
                        run_ours(tmp / "ours", overrides) if name == OURS else run_torchft(tmp / "torchft",
                                                                                            overrides))
                if localsgd:
                    print(f"repeat {repeat + 1}/{repeats}: accelerate LocalSGD ...", flush=True)
                    runs.setdefault("accelerate LocalSGD", []).append(run_peer(
                        "localsgd", tmp / "localsgd", [*overrides, "--ddp_broadcast_buffers", "false"]))
        except RunFailed as error:
            sys.exit(str(error))
    results = {name: {"tokens_per_second": spread([r["tokens_per_second"] for r in rs]),
                      "vs_torchft": spread([r["tokens_per_second"] / t["tokens_per_second"]
                                            for r, t in zip(rs, runs[TORCHFT], strict=True)]),
                      "eval_loss": rs[-1]["eval_loss"], "parameter_hash": rs[-1]["parameter_hash"],
                      "same_every_repeat": len({r["parameter_hash"] for r in rs}) == 1, "runs": rs}
               for name, rs in runs.items()}
    ours_hash, torchft_hash = (results[k]["parameter_hash"] for k in (OURS, TORCHFT))
    identical = ours_hash == torchft_hash
    rows = [[name, show(r["tokens_per_second"]), show(r["vs_torchft"], "{:.1%}"), f"{r['eval_loss']:.4f}",
             f"`{r['parameter_hash'][:16]}`" + ("" if r["same_every_repeat"] else " (differs between repeats)")]
            for name, r in results.items()]
    table = markdown_table([f"implementation (2 CPU replicas, H = {inner}, {steps} steps)", "tokens/s",
                            "vs torchft, same repeat", "final eval loss", "parameter SHA-256 (first 16)"], rows)
    table += (f"\n\n{repeats} repeat(s), interleaved in counterbalanced order (ours first in odd repeats, torchft "
              f"first in even ones); median [min, max]. Tokens/s: both replicas' tokens ÷ Trainer's loop wall time.")
    verdict = "the same parameters, bit for bit" if identical else "DIFFERENT parameters"
    table += (f"\n\nIdentity: DiLoCoTrainer and torchft's DiLoCo end with {verdict} "
              f"({ours_hash} vs {torchft_hash}).")
    save("peers", table, {"steps": steps, "inner_steps": inner, "repeats": repeats, "overrides": overrides,
                          "runs": results,
                          "identical_to_torchft": identical}, plot(results), quick=args.quick,
         seconds=time.time() - started)


def plot(results: dict):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, numbers in results.items():
        tps = numbers["tokens_per_second"]
        ax.errorbar(tps["median"], numbers["eval_loss"], xerr=spread_errors([tps]), fmt="o", capsize=3)
        ax.annotate(name, (tps["median"], numbers["eval_loss"]), xytext=(5, 3), textcoords="offset points",
                    fontsize=8)
    ax.set_xlabel("tokens/s (both replicas, loop wall time; median, [min, max])")
    ax.set_ylabel("final held-out loss")
    ax.set_title("Peers on the same task (lower right is better)")
    return fig


if __name__ == "__main__":
    main()
