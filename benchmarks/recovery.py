"""What a dead process costs a fixed-world (`outer_backend: torch`) run under `hf-diloco launch --max-restarts`.

Two replicas on this machine (accelerate_configs/cpu-2proc.yaml), the peer task with round checkpoints
(`save_every_rounds: 1`). Each repeat runs the same launch twice, interleaved: once undisturbed, once with replica
1's training process SIGKILLed in the middle of a round (half-way through round `--kill-round`). Reported per
repeat: the steps the restart lost (the resumed round's `steps_lost`), the seconds from the kill until the
restarted launch finished its first inner step again (its progress.json moves past the checkpoint), and the extra
wall time of the whole launch against the undisturbed one.

    python benchmarks/recovery.py [--quick] [--repeats N]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from common import RECIPE, REPO, markdown_table, run_env, save, show, spread

from hf_diloco.files import read_json
from hf_diloco.metrics import read_syncs
from hf_diloco.runs import PROGRESS_FILE

CONFIG = REPO / "accelerate_configs" / "cpu-2proc.yaml"


def launch(folder: Path, steps: int, inner: int) -> list[str]:
    return [sys.executable, "-m", "hf_diloco.cli", "launch", str(RECIPE), "--accelerate-config", str(CONFIG),
            "--max-restarts", "1", "--output_dir", str(folder), "--max_steps", str(steps), "--inner_steps",
            str(inner), "--eval_strategy", "no", "--eval_on_start", "false", "--save_every_rounds", "1",
            "--disable_tqdm", "true", "--logging_steps", str(inner)]


def progress_step(folder: Path) -> int:
    try:
        return int(read_json(folder / PROGRESS_FILE, {}).get("step", -1))
    except (ValueError, TypeError):  # a damaged file (DamagedFile is a ValueError) or a step that is not a number
        return -1


def rank_pid(folder: Path, rank: int) -> int | None:
    for process in psutil.process_iter(["cmdline"]):
        try:
            argv = process.info["cmdline"] or []
            if "hf_diloco.cli" in argv and "train" in argv and str(folder) in argv and \
                    process.environ().get("RANK") == str(rank):
                return process.pid
        except psutil.Error:
            continue
    return None


def one_launch(folder: Path, steps: int, inner: int, kill_at: int | None) -> dict:
    started = time.perf_counter()
    process = subprocess.Popen(launch(folder, steps, inner), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                               env=run_env(1), cwd=REPO)
    killed_at = resumed_after = None
    while process.poll() is None:
        step = progress_step(folder)
        if kill_at is not None and killed_at is None and step >= kill_at and (pid := rank_pid(folder, 1)):
            os.kill(pid, signal.SIGKILL)
            killed_at, killed_step = time.perf_counter(), step
        elif killed_at is not None and resumed_after is None and 0 <= step < killed_step:
            checkpoint_step = step  # the restarted run's first step after the checkpoint it resumed from
            while progress_step(folder) <= checkpoint_step and process.poll() is None:
                time.sleep(0.05)
            resumed_after = time.perf_counter() - killed_at
        time.sleep(0.05)
    wall = time.perf_counter() - started
    if process.returncode != 0:
        sys.exit(f"recovery: the launch failed (exit {process.returncode}).")
    rounds = read_syncs(folder)
    resumed = [r for r in rounds if r.get("resumed_from")]
    return {"wall_seconds": wall, "killed": killed_at is not None,
            "steps_lost": resumed[0]["steps_lost"] if resumed else None, "resumed_after_seconds": resumed_after}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="60 steps, H = 20")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kill-round", type=int, default=3, help="kill half-way through this round")
    args = parser.parse_args()
    begun = time.time()
    steps, inner = (60, 20) if args.quick else (200, 25)
    kill_round = min(args.kill_round, steps // inner)
    kill_at = (kill_round - 1) * inner + inner // 2
    results = []
    with tempfile.TemporaryDirectory() as tmp_name:
        for repeat in range(args.repeats):
            for kind in ("undisturbed", "killed"):
                print(f"repeat {repeat + 1}/{args.repeats}: {kind} ...", flush=True)
                folder = Path(tmp_name) / f"{kind}{repeat}"
                results.append({"repeat": repeat, "run": kind,
                                **one_launch(folder, steps, inner, kill_at if kind == "killed" else None)})
    killed = [r for r in results if r["run"] == "killed"]
    calm = [r for r in results if r["run"] == "undisturbed"]
    extra = [k["wall_seconds"] - c["wall_seconds"] for k, c in zip(killed, calm, strict=True)]
    rows = [["steps lost by the restart", show(spread([float(r["steps_lost"]) for r in killed]), "{:.0f}")],
            ["seconds from the kill to training again", show(spread([r["resumed_after_seconds"] for r in killed]),
                                                             "{:.1f}")],
            ["extra wall time of the launch (s)", show(spread(extra), "{:.1f}")],
            ["undisturbed launch (s)", show(spread([r["wall_seconds"] for r in calm]), "{:.1f}")]]
    table = markdown_table(["2 replicas, replica 1 SIGKILLed mid-round, --max-restarts 1", "median [min, max]"], rows)
    table += (f"\n\n{steps} steps, H = {inner}, round checkpoints; the kill comes at step {kill_at} (half-way "
              f"through round {kill_round}); {args.repeats} interleaved repeats.")
    save("recovery", table, {"results": results, "steps": steps, "inner_steps": inner, "kill_at": kill_at},
         quick=args.quick, seconds=time.time() - begun)


if __name__ == "__main__":
    os.chdir(REPO)
    main()
