"""Replicas of unequal speed under real CPU quotas: rounds of H steps against time-budget rounds (`round_seconds`).

Three replicas, one process each, in one `accelerate launch` of the peer task (torch backend, fp32, built-in tiny
Llama and corpus, 128-token blocks, batch 4, so that a run fits the time). Each training process is put, before
its first step, into a cgroup v1 `cpu` group of its own with a quota of 60%, 60% and 20% of a core (ranks 0, 1, 2;
1.4 cores of this machine's 2): the benchmark polls the launcher's children, reads each training process's RANK
from /proc/<pid>/environ and writes its pid into that rank's group (its threads go with it). Needs root and the
cgroup v1 cpu controller at /sys/fs/cgroup/cpu; without them it says so and exits.

Configurations, the same max_steps each, interleaved (fixed, budget, fixed, budget, ...), 3 repeats:
- fixed H: a sync every H = 20 steps; the 60% replicas wait for the 20% one at every sync;
- time budget: `round_seconds` T, each replica syncs after T seconds of inner steps, the merge weights replicas
  by their tokens, and the run ends when the fastest reaches max_steps. T = H × a 60%-quota replica's seconds per
  step, measured by its solo run below, so a full-speed replica takes about H steps per round.

Capacity = the sum over replicas of each one's solo rate under its own quota: each distinct quota (60%, 20%) runs
once alone first (1 process, the same task and flags, M = 1), rate = its tokens ÷ its loop time over the rounds
after the first (the first step's warm-up left out: capacity is what a replica sustains). Per run:
- goodput = tokens trained by all replicas (Σ `tokens` of sync_rounds.jsonl) ÷ (loop time × capacity). Loop time
  is replica 0's time in the training loop, Σ (its inner-step seconds + its blocked seconds) over the records:
  the final evaluation and start-up are left out of it, as they are of the solo rates. Physics bounds it by 100%;
  a row above 103% is flagged.
- blocked share of replica 0: its measured blocked seconds ÷ its loop time. Replica 2's is not in the records
  (only the main process's blocked time is); it is estimated as 1 − its inner-step seconds
  (`replica_compute_seconds`) ÷ replica 0's loop time, the replicas leaving each sync together.
- eval loss at the end (held-out blocks), tokens trained, syncs.

    python benchmarks/speeds.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psutil
from common import Processes, markdown_table, read_run, save, show, skip, spread, spread_bars, train_command

CPU_CGROUP = Path("/sys/fs/cgroup/cpu")
QUOTAS = (0.6, 0.6, 0.2)  # of one core, for ranks 0, 1, 2
INNER_STEPS = 20
REPEATS = 3
FLAGGED = 1.03  # goodput above this is beyond physics plus measurement noise
TASK = ["--block_size", "128", "--per_device_train_batch_size", "4", "--save_strategy", "no",
        "--save_every_rounds", "0", "--eval_strategy", "steps", "--eval_on_start", "false", "--sync_timeout", "300"]


class QuotaGroups:
    """One cgroup v1 `cpu` group per rank with its quota; `close` moves what is left back to the root group and
    removes them."""

    def __init__(self, quotas: tuple[float, ...]):
        self.folders: list[Path] = []
        tag = uuid.uuid4().hex[:8]
        try:
            for rank, quota in enumerate(quotas):
                folder = CPU_CGROUP / f"hf-diloco-speeds-{tag}-rank{rank}"
                folder.mkdir()
                self.folders.append(folder)
                (folder / "cpu.cfs_period_us").write_text("100000")
                (folder / "cpu.cfs_quota_us").write_text(str(int(quota * 100000)))
        except OSError:
            self.close()
            raise

    def put(self, pid: int, rank: int) -> None:
        (self.folders[rank] / "cgroup.procs").write_text(str(pid))

    def close(self) -> None:
        for folder in self.folders:
            for pid in (folder / "cgroup.procs").read_text().split():
                try:
                    (CPU_CGROUP / "cgroup.procs").write_text(pid)
                except OSError:  # it ended meanwhile
                    pass
            os.rmdir(folder)
        self.folders = []


class Placer(threading.Thread):
    """Moves each training process under `launcher` into its rank's group as soon as it appears."""

    def __init__(self, launcher: int, groups: QuotaGroups, ranks: int):
        super().__init__(daemon=True)
        self.launcher, self.groups, self.ranks = launcher, groups, ranks
        self.placed: dict[int, int] = {}  # rank -> pid
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set() and len(self.placed) < self.ranks:
            try:
                children = psutil.Process(self.launcher).children(recursive=True)
            except psutil.Error:
                return
            for child in children:
                try:
                    argv = child.cmdline()
                    if "hf_diloco.cli" not in argv or "accelerate.commands.launch" in argv:
                        continue
                    rank = child.environ().get("RANK")
                except psutil.Error:
                    continue
                if rank is not None and int(rank) not in self.placed:
                    self.groups.put(child.pid, int(rank))
                    self.placed[int(rank)] = child.pid
            time.sleep(0.05)


def launch(folder: Path, processes: int, overrides: list[str], groups: QuotaGroups, solo_rank: int = 0) -> dict:
    """One run with its processes under their quotas (a solo run under rank `solo_rank`'s); what it left behind."""
    run = Processes([train_command(processes, ["--output_dir", str(folder), *overrides])])
    pid = run.procs[0].pid
    if processes == 1:
        groups.put(pid, solo_rank)
        placer = None
    else:
        placer = Placer(pid, groups, processes)
        placer.start()
    try:
        run.wait()
    finally:
        if placer is not None:
            placer.done.set()
    if placer is not None and len(placer.placed) < processes:
        sys.exit(f"speeds: only ranks {sorted(placer.placed)} were put under a quota; the run does not count.")
    return read_run(folder)


def loop_seconds(records: list[dict]) -> float:
    """Replica 0's seconds in the training loop: its inner steps and its waits, evaluations left out."""
    return sum(r["replica_compute_seconds"][0] + r["blocked_seconds"] for r in records)


def measure(result: dict, capacity: float) -> dict:
    records = result["rounds"]
    loop = loop_seconds(records)
    tokens = sum(r["tokens"] for r in records)
    slow_compute = sum(r["replica_compute_seconds"][2] for r in records)
    return {"tokens": tokens, "loop_seconds": loop, "goodput": tokens / (loop * capacity),
            "blocked_share_0": sum(r["blocked_seconds"] for r in records) / loop,
            "blocked_share_2_estimated": 1 - slow_compute / loop,
            "eval_loss": result["summary"].get("eval_loss_final"), "syncs": len(records),
            "train_seconds": result["summary"]["train_seconds"],
            "replica_steps": [r.get("replica_steps") for r in records]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="80 steps instead of 200 (about 5 minutes)")
    args = parser.parse_args()
    try:
        groups = QuotaGroups(QUOTAS)
    except OSError as error:
        skip("speeds", f"a CPU quota needs root and the cgroup v1 cpu controller at {CPU_CGROUP} ({error}).")
    begun = time.time()
    steps, solo_steps = (80, 60) if args.quick else (200, 100)
    try:
        with tempfile.TemporaryDirectory() as tmp_name:
            tmp = Path(tmp_name)
            # Each distinct quota alone: its tokens/s and seconds per step without anyone to wait for.
            solo: dict[float, dict] = {}
            for rank, quota in enumerate(QUOTAS):
                if quota in solo:
                    continue
                print(f"solo run under {quota:.0%} of a core ...", flush=True)
                result = launch(tmp / f"solo-{rank}", 1, [*TASK, "--max_steps", str(solo_steps), "--inner_steps",
                                                          str(INNER_STEPS), "--eval_steps", str(solo_steps)],
                                groups, solo_rank=rank)
                records = result["rounds"][1:]  # the first round holds the first step's warm-up
                loop = loop_seconds(records)
                solo[quota] = {"tokens_per_second": sum(r["tokens"] for r in records) / loop,
                               "seconds_per_step": loop / sum(r["sync_steps"] for r in records)}
            capacity = sum(solo[q]["tokens_per_second"] for q in QUOTAS)
            round_seconds = round(INNER_STEPS * solo[QUOTAS[0]]["seconds_per_step"], 2)
            configurations = {
                f"fixed H = {INNER_STEPS}": ["--inner_steps", str(INNER_STEPS)],
                f"time budget {round_seconds:g} s": ["--inner_steps", str(INNER_STEPS), "--round_seconds",
                                                     str(round_seconds)],
            }
            runs: dict[str, list[dict]] = {name: [] for name in configurations}
            for repeat in range(REPEATS):
                for name, extra in configurations.items():
                    print(f"[{repeat + 1}/{REPEATS}] {name} ...", flush=True)
                    folder = tmp / f"{name.split()[0]}-{repeat}"
                    result = launch(folder, len(QUOTAS), [*TASK, "--max_steps", str(steps), "--eval_steps",
                                                          str(steps), *extra], groups)
                    runs[name].append(measure(result, capacity))
                    print(f"  goodput {runs[name][-1]['goodput']:.1%}, {runs[name][-1]['tokens']:,} tokens", flush=True)
    finally:
        groups.close()

    rows, spreads = [], {}
    for name, measured in runs.items():
        s = {key: spread([m[key] for m in measured]) for key in ("goodput", "blocked_share_0",
                                                                 "blocked_share_2_estimated", "eval_loss", "tokens",
                                                                 "syncs", "loop_seconds")}
        spreads[name] = s
        flag = " FLAGGED: above 100%" if s["goodput"]["max"] > FLAGGED else ""
        rows.append([name, show({k: 100 * v for k, v in s["goodput"].items() if k != "values"}, "{:.1f}%") + flag,
                     show({k: 100 * v for k, v in s["blocked_share_0"].items() if k != "values"}, "{:.1f}%"),
                     show({k: 100 * v for k, v in s["blocked_share_2_estimated"].items() if k != "values"},
                          "{:.1f}%"),
                     show(s["eval_loss"], "{:.4f}"), show(s["tokens"]), show(s["syncs"], "{:.0f}"),
                     show(s["loop_seconds"], "{:.1f}")])
    table = markdown_table(["rounds (3 replicas at 60%, 60%, 20% of a core)", "goodput", "replica 0 blocked",
                            "replica 2 blocked (estimated)", "eval loss", "tokens", "syncs", "loop s"], rows)
    rates = ", ".join(f"{q:.0%}: {v['tokens_per_second']:,.0f} tokens/s ({v['seconds_per_step']:.3f} s/step)"
                      for q, v in solo.items())
    table += (f"\n\n{steps} steps (max_steps; the time-budget run ends when its fastest replica gets there), "
              f"128-token blocks, batch 4, fp32, torch backend, {REPEATS} repeats interleaved; median [min, max]. "
              f"Solo rates under each quota: {rates}; capacity = {capacity:,.0f} tokens/s (their sum over the 3 "
              f"replicas). round_seconds = {INNER_STEPS} × the 60% replica's solo seconds per step. Goodput = tokens "
              f"÷ (replica 0's loop seconds × capacity); replica 2's blocked share is 1 − its inner-step seconds ÷ "
              f"replica 0's loop seconds.")
    labels = list(spreads)
    figure, _ = spread_bars(labels, [{k: 100 * v for k, v in spreads[n]["goodput"].items() if k != "values"}
                                     for n in labels], ["#2563eb", "#ea580c"], "goodput (%)",
                            "3 replicas at 60%, 60%, 20% of a core: goodput", (6, 3.2))
    save("speeds", table, {"quotas": QUOTAS, "steps": steps, "inner_steps": INNER_STEPS,
                           "round_seconds": round_seconds, "solo": {str(q): v for q, v in solo.items()},
                           "capacity_tokens_per_second": capacity, "runs": runs, "spreads": spreads},
         figure, quick=args.quick, seconds=time.time() - begun)


if __name__ == "__main__":
    os.chdir(Path(__file__).resolve().parents[1])
    main()
