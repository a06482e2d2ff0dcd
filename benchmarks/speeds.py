"""Replicas of unequal speed under real CPU quotas: rounds of H steps against time-budget rounds (`round_seconds`),
on the torch backend and on torchft.

Three replicas, one process each, of the peer task (fp32, built-in tiny Llama and corpus, 128-token blocks, batch
4, so that a run fits the time): torch, one `accelerate launch`; torchft, three processes and a Lighthouse (min
replicas 2, grace 5 s), as `hf-diloco launch` starts them. Each training process is put, before its first step,
into a cgroup v1 `cpu` group of its own with a quota of 60%, 60% and 20% of a core (replicas 0, 1, 2; 1.4 cores of
this machine's 2): the benchmark polls the processes whose command names the run's folder, takes the replica from
`--replica_id` (torchft) or the RANK accelerate gave it (torch), and writes its pid into that replica's group (its
threads go with it; a torchft replica once its training begins, so that a slow replica's start-up does not leave
it out of the first syncs: a torch launch's replicas wait for each other before the first step anyway). Needs root
and the cgroup v1 cpu controller at /sys/fs/cgroup/cpu; without them it says so and exits.

Configurations, the same max_steps each, interleaved, 3 repeats:
- fixed H: a sync every H = 20 steps; the 60% replicas wait for the 20% one at every sync (torchft's own DiLoCo,
  whose outer loop the torchft backend's is bit-identical to, waits the same way: a quorum of all three);
- time budget: `round_seconds` T, each replica syncs after T seconds of inner steps, the merge weights replicas
  by their tokens. T = H × replica 0's seconds per step, measured as below (training alone), so a full-speed
  replica takes about H steps per round. On both backends the run ends when the fastest replica reaches
  max_steps;
- time budget with a quota drop: the same, and replica 1's quota falls from 60% to 20% of a core once replica 0 is a
  third of the way to max_steps, and comes back at two thirds; nothing in the run's settings changes. Its capacity
  is lowered by (replica 1's rate − replica 2's, measured as below) for the share of replica 0's loop window the
  drop lasted.

`--methods` puts streamed int4 + error feedback with τ auto and the delayed outer Nesterov in place of the quota
drop. `--overlap` runs the time-budget rounds blocking (`sync_delay 0`) and as the defaults run them (`sync_delay`
unset: τ 1), both with the recipe's round checkpoint after every sync (`save_every_rounds: 1`; the other tables
turn saves off), nothing else. `--quality`
compares eval loss at equal tokens with the same replicas at equal speed: time-budget rounds of H = 8 nominal steps,
400 steps (about 50 syncs, 45 or so overlapped), plain and with the delayed outer Nesterov, under 60%, 60%, 20% and
under three quotas of 46.67% each (the same 1.4 cores), the equal-speed runs' max_steps sized from the rates below
so that they train about as many tokens in about as many syncs (the same budget); and at unequal speeds overlapped
(sync_delay 1) with each landing, mixed (α 0: the steps taken in flight dropped) and eager (kept). Each row runs 3
seeds (`--seed` 0, 1, 2), interleaved, and the learning rate is constant after a 20-step warmup: a run's length is
max_steps of its fastest replica, so equal tokens at unequal and at equal speeds are different step counts, which a
decaying schedule would turn into different schedules. `--period-ms` sets the CFS period the quotas are enforced
over.

Capacity = the sum over replicas of each one's rate under its own quota while the run's other replicas train on the
machine at the same time, each alone (one process each, no syncs between them: what the machine sustains when nobody
waits for anybody, its caches and memory shared as in a run, rather than one replica on an idle machine). Replica r
trains 150 steps × its quota's share of the fastest quota, so that they end together; rate = its tokens ÷ its loop
time over the syncs after the first (the warm-up left out). Measured before the runs and again after them; each
replica's faster rate counts. Per run, from replica 0's own records (syncs.jsonl of the run, or of replica-0 on
torchft):
- loop seconds: replica 0's time in the training loop, Σ (its inner-step seconds, from its row of `replicas`, + its
  blocked seconds); start-up and the final evaluation are left out, as they are of the rates;
- goodput = tokens merged into the final model (Σ `tokens` of the committed syncs, less the tokens of the steps a
  mix landing dropped: `in_flight_steps`) ÷ (loop seconds × capacity). Physics bounds it by 100%; a row above 103%
  is flagged;
- replica 0 blocked: its blocked seconds (all the time its loop waited for syncs: arrival of the others, the
  exchange, the outer step; torchft: the quorum too) ÷ its loop seconds; and of which the last sync (which blocks
  on every backend: the run's end waits for the slowest replica's last step and the exchange, once per run);
- waited, worst replica: the largest over replicas of Σ `waited_seconds` of its rows of `replicas` (torch: how long
  before the last replica it arrived at each sync; torchft: the time it spent forming the quorum) ÷ replica 0's
  loop seconds;
- eval loss at the end (held-out blocks), tokens, syncs.

    python benchmarks/speeds.py [--quick] [--backends torch,torchft] [--methods | --quality | --overlap]
        [--period-ms 100]
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
from common import (
    Processes,
    dropped_tokens,
    markdown_table,
    run_env,
    save,
    show,
    skip,
    spread,
    spread_bars,
    train_command,
)

from hf_diloco.files import read_json
from hf_diloco.metrics import read_summary, read_syncs, run_syncs

CPU_CGROUP = Path("/sys/fs/cgroup/cpu")
QUOTAS = (0.6, 0.6, 0.2)  # of one core, for ranks 0, 1, 2
DELAY = 2  # outer_momentum_delay of the --methods row
DROP_REPLICA, DROP_QUOTA = 1, 0.2  # the quota-drop rows: replica 1 at 20% for the middle third of the run
EQUAL = round(sum(QUOTAS) / len(QUOTAS), 4)  # --quality: each replica's quota at equal speed, the same sum
INNER_STEPS = 20
QUALITY_INNER_STEPS, QUALITY_STEPS = 8, 400  # --quality: about 50 syncs (overlapped ones land later: 45 or so)
REPEATS = 3
FLAGGED = 1.03  # goodput above this is beyond physics plus measurement noise
# --overlap: the recipe's own saves (save_every_rounds 1: a round checkpoint after every sync), as a user runs it
DEFAULT_SAVES_TASK = ["--block_size", "128", "--per_device_train_batch_size", "4", "--save_strategy", "no",
                      "--eval_strategy", "steps", "--eval_on_start", "false", "--sync_timeout", "300"]
TASK = [*DEFAULT_SAVES_TASK, "--save_every_rounds", "0"]


class QuotaGroups:
    """One cgroup v1 `cpu` group per rank with its quota, enforced per period of `period_us` microseconds; `close`
    moves what is left back to the root group and removes them."""

    def __init__(self, quotas: tuple[float, ...], period_us: int = 100_000):
        self.folders: list[Path] = []
        self.period_us = period_us
        tag = uuid.uuid4().hex[:8]
        try:
            for rank, quota in enumerate(quotas):
                folder = CPU_CGROUP / f"hf-diloco-speeds-{tag}-rank{rank}"
                folder.mkdir()
                self.folders.append(folder)
                (folder / "cpu.cfs_period_us").write_text(str(period_us))
                self.set_quota(rank, quota)
        except OSError:
            self.close()
            raise

    def set_quota(self, rank: int, quota: float) -> None:
        (self.folders[rank] / "cpu.cfs_quota_us").write_text(str(int(quota * self.period_us)))

    def set_quotas(self, quotas: tuple[float, ...]) -> None:
        for rank, quota in enumerate(quotas):
            self.set_quota(rank, quota)

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
    """Moves each training process of the run in `folder` into its replica's group: as soon as it appears, or with
    `at_train_begin` once its replica folder's progress.json does (a torchft replica starts up at full speed, as the
    replicas of a torch launch in effect do: they wait for each other before the first step)."""

    def __init__(self, folder: Path, groups: QuotaGroups, replicas: int, at_train_begin: bool = False):
        super().__init__(daemon=True)
        self.folder, self.groups, self.replicas = str(folder), groups, replicas
        self.at_train_begin = at_train_begin
        self.placed: dict[int, int] = {}  # replica -> pid
        self.done = threading.Event()

    def replica_of(self, process: psutil.Process) -> int | None:
        argv = process.cmdline()
        if "hf_diloco.cli" not in argv or "accelerate.commands.launch" in argv or not any(
                a == self.folder or a.startswith(self.folder + "/") for a in argv):
            return None
        if "--replica_id" in argv:
            return int(argv[argv.index("--replica_id") + 1])
        rank = process.environ().get("RANK")
        return None if rank is None else int(rank)

    def run(self) -> None:
        while not self.done.is_set() and len(self.placed) < self.replicas:
            for process in psutil.process_iter():
                try:
                    replica = self.replica_of(process)
                except psutil.Error:
                    continue
                if self.at_train_begin and replica is not None and \
                        not Path(self.folder, f"replica-{replica}", "progress.json").exists():
                    continue
                if replica is not None and replica not in self.placed:
                    self.groups.put(process.pid, replica)
                    self.placed[replica] = process.pid
            time.sleep(0.05)


class QuotaDrop(threading.Thread):
    """Replica DROP_REPLICA's quota falls from its own to DROP_QUOTA once replica 0 is a third of the way to
    `steps` (its progress.json) and comes back at two thirds; `window` is when (Unix time), for the capacity."""

    def __init__(self, folder: Path, backend: str, groups: QuotaGroups, steps: int):
        super().__init__(daemon=True)
        self.progress = (folder if backend == "torch" else folder / "replica-0") / "progress.json"
        self.groups, self.steps = groups, steps
        self.window: list[float] = []
        self.done = threading.Event()

    def run(self) -> None:
        for fraction, quota in ((1 / 3, DROP_QUOTA), (2 / 3, QUOTAS[DROP_REPLICA])):
            while not self.done.is_set() and read_json(self.progress, {}).get("step", 0) < fraction * self.steps:
                time.sleep(0.05)
            if self.done.is_set():
                break
            self.groups.set_quota(DROP_REPLICA, quota)
            self.window.append(time.time())
        if len(self.window) == 1:  # the run ended inside the slow phase
            self.window.append(time.time())
        self.groups.set_quota(DROP_REPLICA, QUOTAS[DROP_REPLICA])


def independent_rates(folder: Path, quotas: tuple[float, ...], groups: QuotaGroups, steps: int, inner: int
                      ) -> list[dict]:
    """Each replica's tokens/s and seconds per step under its quota, the replicas of `quotas` training at the same
    time on this machine but each alone (one process, no syncs): what they sustain when nobody waits for anybody,
    sharing the machine's caches and memory as a run's replicas do. Replica r takes `steps` × its share of the
    fastest quota, so that they end together; its first sync's steps are left out (the warm-up)."""
    print(f"independent replicas under {', '.join(f'{q:.0%}' for q in quotas)} of a core ...", flush=True)
    groups.set_quotas(quotas)
    commands = []
    for rank, quota in enumerate(quotas):
        own = max(2 * inner + 1, round(steps * quota / max(quotas)))
        commands.append(train_command(1, ["--output_dir", str(folder / f"replica-{rank}"), *TASK, "--max_steps",
                                          str(own), "--inner_steps", str(inner), "--eval_steps", str(own)]))
    run = Processes(commands)
    for rank, process in enumerate(run.procs):
        groups.put(process.pid, rank)
    run.wait()
    rates = []
    for rank in range(len(quotas)):
        records = read_syncs(folder / f"replica-{rank}")[1:]
        loop = loop_seconds(records)
        rates.append({"tokens_per_second": sum(r["tokens"] for r in records) / loop,
                      "seconds_per_step": loop / sum(r["sync_steps"] for r in records)})
    return rates


def launch(folder: Path, processes: int, overrides: list[str], groups: QuotaGroups, backend: str = "torch") -> None:
    """One run with its processes under their quotas."""
    from hf_diloco.launch import ReplicaSupervisor, replica_overrides, start_lighthouse

    placer = Placer(folder, groups, processes, at_train_begin=backend == "torchft")
    placer.start()
    try:
        if backend == "torch":
            Processes([train_command(processes, ["--output_dir", str(folder), *overrides])]).wait()
        else:
            server = start_lighthouse("127.0.0.1:0", 2, 5.0, heartbeat_timeout_seconds=5.0)
            address = f"http://127.0.0.1:{server.address().rsplit(':', 1)[1]}"
            extra = ["--min_replicas", "2", "--sync_grace_seconds", "5"]
            commands = [train_command(1, replica_overrides([*overrides, *extra], r, processes, address, str(folder)))
                        for r in range(processes)]
            os.environ.update(run_env(1))
            try:
                code = ReplicaSupervisor(commands, str(folder), 0, linger_seconds=20).run()
            finally:
                server.shutdown()
            if code != 0:
                sys.exit(f"speeds: the torchft run in {folder} failed (exit {code}); its output is above.")
    finally:
        placer.done.set()
    if len(placer.placed) < processes:
        sys.exit(f"speeds: only replicas {sorted(placer.placed)} were put under a quota; the run does not count.")


def overlaps(overrides: list[str]) -> bool:
    """Whether a run with these flags overlaps its syncs: a sync_delay above 0, or none given under time budgets
    (where it is auto by default)."""
    if "--sync_delay" in overrides:
        return overrides[overrides.index("--sync_delay") + 1] != "0"
    return "--round_seconds" in overrides


def own_row(record: dict, replica: int = 0) -> dict:
    return next(m for m in record["replicas"] if m["replica"] == replica)


def loop_seconds(records: list[dict]) -> float:
    """Replica 0's seconds in the training loop, from its own records: its inner steps and its waits, evaluations
    left out."""
    return sum(own_row(r)["compute_seconds"] + r["blocked_seconds"] for r in records)


def capacity_of(rates: dict[tuple, list[dict]], quotas: tuple[float, ...]) -> float:
    return sum(rate["tokens_per_second"] for rate in rates[tuple(quotas)])


def measure(folder: Path, backend: str, capacity: float, slowed: list[float] = (), capacity_lost: float = 0.0,
            mixed: bool = False) -> dict:
    """`slowed`: [from, to] (Unix time) in which the capacity was `capacity_lost` lower (a quota drop); `mixed`: its
    overlapped syncs land by mixing (the steps taken in flight are dropped)."""
    lead = folder if backend == "torch" else folder / "replica-0"
    own = read_syncs(lead)
    merged = [r for r in run_syncs(folder) if r.get("committed", True)]
    loop = loop_seconds(own)
    if slowed:  # the share of replica 0's loop window spent slowed lowers the capacity by that share
        began = own[0]["time"] - own_row(own[0])["compute_seconds"] - own[0]["blocked_seconds"]
        inside = max(0.0, min(slowed[1], own[-1]["time"]) - max(slowed[0], began))
        capacity -= capacity_lost * inside / (own[-1]["time"] - began)
    dropped = 0 if not mixed else dropped_tokens(
        [folder] if backend == "torch" else [folder / f"replica-{k}" for k in range(len(QUOTAS))],
        whole_sync=backend == "torch")
    tokens = sum(r["tokens"] for r in merged)
    waited: dict[int, float] = {}
    for r in merged if backend == "torch" else [x for i in range(len(QUOTAS))
                                                 for x in read_syncs(folder / f"replica-{i}")]:
        for m in r["replicas"]:
            if m.get("participated") and (backend == "torch" or m["replica"] == r["replica"]):
                waited[m["replica"]] = waited.get(m["replica"], 0.0) + m["waited_seconds"]
    return {"tokens": tokens, "dropped": dropped, "loop_seconds": loop,
            "goodput": (tokens - dropped) / (loop * capacity), "capacity": capacity,
            "blocked_share_0": sum(r["blocked_seconds"] for r in own) / loop,
            "blocked_end_share_0": own[-1]["blocked_seconds"] / loop,
            "waited_share_worst": max(waited.values()) / loop, "waited_seconds": waited,
            "eval_loss": read_summary(lead).get("eval_loss_final"), "syncs": len(merged),
            "replica_steps": [[m.get("steps") for m in r["replicas"]] for r in merged]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="80 steps instead of 200, 2 repeats")
    parser.add_argument("--backends", default="torch,torchft", help="comma-separated: torch, torchft")
    parser.add_argument("--methods", action="store_true",
                        help="instead of the quota-drop rows: time-budget rounds streamed (int4 + error feedback, 2 "
                             "fragments, sync_delay auto) and with the delayed outer Nesterov (outer_momentum_delay "
                             f"{DELAY}); results/speeds-methods-<backends>.*")
    parser.add_argument("--overlap", action="store_true",
                        help="time-budget rounds blocking (sync_delay 0) against the defaults (sync_delay unset: τ "
                             "1, a sync lands once its exchange is done), both with the recipe's round checkpoint "
                             "after every sync; "
                             "results/speeds-overlap-<backends>.*")
    parser.add_argument("--quality", action="store_true",
                        help="eval loss at equal tokens against the same replicas at equal speed: time-budget rounds "
                             "(plain and delayed Nesterov) under 60%%, 60%%, 20%% and under three equal quotas of "
                             "the same sum, sized to train as many tokens in as many syncs; "
                             "results/speeds-quality-<backends>.*")
    parser.add_argument("--period-ms", type=float, default=100.0,
                        help="the CFS period the quotas are enforced over (default 100 ms, the kernel's; a 20%% "
                             "replica is held up to 80 ms whenever its quota runs out, 8 ms at 10)")
    args = parser.parse_args()
    if sum((args.methods, args.quality, args.overlap)) > 1:
        sys.exit("speeds: --methods, --quality and --overlap are separate tables; run one at a time.")
    if not 1 <= args.period_ms <= 1000:
        sys.exit(f"speeds: --period-ms must be between 1 and 1000, not {args.period_ms:g}.")
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not backends or set(backends) - {"torch", "torchft"}:
        sys.exit(f"speeds: --backends takes torch and/or torchft, not {args.backends!r}.")
    if "torchft" in backends:
        try:
            import torchft  # noqa: F401
        except ImportError:
            skip("speeds", "torchft is not installed (pip install -e '.[ft]').")
    try:
        groups = QuotaGroups(QUOTAS, period_us=int(args.period_ms * 1000))
    except OSError as error:
        skip("speeds", f"a CPU quota needs root and the cgroup v1 cpu controller at {CPU_CGROUP} ({error}).")
    begun = time.time()
    steps, alone_steps, repeats = (80, 60, 2) if args.quick else (200, 150, REPEATS)
    inner = INNER_STEPS
    if args.quality:  # at least 40 syncs a run, a seed per repeat, a schedule that does not depend on the length
        inner, steps = QUALITY_INNER_STEPS, 120 if args.quick else QUALITY_STEPS
    try:
        with tempfile.TemporaryDirectory() as tmp_name:
            tmp = Path(tmp_name)
            # The replicas of each quota set training at once, each alone: tokens/s and seconds per step without
            # anyone to wait for, measured before the runs and again after them (`independent_rates`); the capacity
            # takes each replica's faster one.
            sets = [QUOTAS, *([(EQUAL,) * len(QUOTAS)] if args.quality else [])]
            before = {quotas: independent_rates(tmp / f"alone-before-{i}", quotas, groups, alone_steps, inner)
                      for i, quotas in enumerate(sets)}
            alone = before
            groups.set_quotas(QUOTAS)
            round_seconds = round(inner * alone[QUOTAS][0]["seconds_per_step"], 2)
            clock = ["--inner_steps", str(inner), "--round_seconds", str(round_seconds)]
            budget = [*clock, "--sync_delay", "0"]  # blocking, as these tables compare (unset, τ would be auto)
            streamed = [*clock, "--compression", "int4", "--error_feedback", "true", "--num_fragments", "2",
                        "--sync_delay", "auto"]
            delayed = [*budget, "--outer_momentum_delay", str(DELAY)]
            # (name, overrides, quota drop, quotas, max_steps)
            rows = [(f"fixed H = {INNER_STEPS}", ["--inner_steps", str(INNER_STEPS)], False, QUOTAS, steps),
                    (f"time budget {round_seconds:g} s", budget, False, QUOTAS, steps)]
            if args.overlap:  # as the shipped recipe runs: its round checkpoints on, overlap by default
                rows = [(f"time budget {round_seconds:g} s, sync_delay 0", [*budget, "--sync_delay", "0"], False,
                         QUOTAS, steps),
                        (f"time budget {round_seconds:g} s, defaults (τ 1)", clock, False, QUOTAS, steps)]
            elif args.methods:
                rows += [("time budget, int4 + EF, 2 fragments, τ auto", streamed, False, QUOTAS, steps),
                         (f"time budget, delayed Nesterov N = {DELAY}", delayed, False, QUOTAS, steps)]
            elif args.quality:
                # The same replicas at equal speed: three quotas of the same sum, max_steps sized so that they
                # train as many tokens (the unequal run: two replicas to `steps`, the 20% one its share of them)
                # and, with the same budget, make as many syncs.
                fast = alone[QUOTAS][0]["tokens_per_second"]
                equal_steps = round(steps * capacity_of(alone, QUOTAS) / fast / len(QUOTAS))
                equal = (EQUAL,) * len(QUOTAS)
                overlapped = [*clock, "--sync_delay", "1"]
                rows = [rows[1], (f"time budget, delayed Nesterov N = {DELAY}", delayed, False, QUOTAS, steps),
                        ("time budget, sync_delay 1, mixed landing", overlapped, False, QUOTAS, steps),
                        ("time budget, sync_delay 1, eager landing", [*overlapped, "--overlap_landing", "eager"],
                         False, QUOTAS, steps),
                        (f"time budget {round_seconds:g} s, equal speed", budget, False, equal, equal_steps),
                        (f"time budget, delayed Nesterov N = {DELAY}, equal speed", delayed, False, equal,
                         equal_steps)]
            else:
                rows += [(f"time budget, replica {DROP_REPLICA} at {DROP_QUOTA:.0%} for a third", budget, True,
                          QUOTAS, steps)]
            configurations = {f"{backend}, {name}": (backend, *row) for backend in backends
                              for name, *row in rows}
            lost = alone[QUOTAS][DROP_REPLICA]["tokens_per_second"] - alone[QUOTAS][QUOTAS.index(DROP_QUOTA)][
                "tokens_per_second"]
            runs: dict[str, list[dict]] = {name: [] for name in configurations}
            for repeat in range(repeats):
                for i, (name, (backend, extra, drop, quotas, run_steps)) in enumerate(configurations.items()):
                    print(f"[{repeat + 1}/{repeats}] {name} ...", flush=True)
                    folder = tmp / f"run-{i}-{repeat}"
                    groups.set_quotas(quotas)
                    dropping = QuotaDrop(folder, backend, groups, run_steps) if drop else None
                    if dropping:
                        dropping.start()
                    seeded = ["--seed", str(repeat), "--lr_scheduler_type", "constant_with_warmup"] \
                        if args.quality else []
                    try:
                        launch(folder, len(QUOTAS), [*(DEFAULT_SAVES_TASK if args.overlap else TASK), "--max_steps",
                                                     str(run_steps), "--eval_steps",
                                                     str(run_steps), *seeded, *extra], groups, backend=backend)
                    finally:
                        if dropping:
                            dropping.done.set()
                            dropping.join()
                    available = capacity_of(alone, quotas)
                    runs[name].append(measure(folder, backend, available, dropping.window if dropping else (), lost,
                                              mixed=overlaps(extra) and "eager" not in extra))
                    runs[name][-1].update(available=available, quotas=quotas)
                    print(f"  goodput {runs[name][-1]['goodput']:.1%}, {runs[name][-1]['tokens']:,} tokens",
                          flush=True)
            after = {quotas: independent_rates(tmp / f"alone-after-{i}", quotas, groups, alone_steps, inner)
                     for i, quotas in enumerate(sets)}
            alone = {quotas: [max(b, a, key=lambda rate: rate["tokens_per_second"])
                              for b, a in zip(before[quotas], after[quotas], strict=True)] for quotas in sets}
            for measured in runs.values():  # goodput against the capacity from the faster rates
                for m in measured:
                    available = capacity_of(alone, m["quotas"])
                    m["goodput"] *= m["available"] / available
            capacity = capacity_of(alone, QUOTAS)
    finally:
        groups.close()

    def percent(values: dict) -> str:
        return show({k: 100 * v for k, v in values.items() if k != "values"}, "{:.1f}%")

    rows, spreads = [], {}
    for name, measured in runs.items():
        s = {key: spread([m.get(key, 0) for m in measured])
             for key in ("goodput", "blocked_share_0", "blocked_end_share_0", "waited_share_worst", "eval_loss",
                         "tokens", "dropped", "syncs", "loop_seconds")}
        spreads[name] = s
        flag = " FLAGGED: above 100%" if s["goodput"]["max"] > FLAGGED else ""
        rows.append([name, percent(s["goodput"]) + flag, percent(s["blocked_share_0"]),
                     percent(s["blocked_end_share_0"]), percent(s["waited_share_worst"]),
                     show(s["eval_loss"], "{:.4f}"), show(s["tokens"]), show(s["dropped"]),
                     show(s["syncs"], "{:.0f}"), show(s["loop_seconds"], "{:.1f}")])
    first = "3 replicas, quotas of 1.4 cores" if args.quality else "3 replicas at 60%, 60%, 20% of a core"
    table = markdown_table([first, "goodput", "replica 0 blocked", "of which the last sync",
                            "waited, worst replica", "eval loss", "tokens", "of which dropped at landing", "syncs",
                            "loop s"], rows)
    rates = "; ".join(", ".join(f"{q:.0%}: {b['tokens_per_second']:,.0f} and {a['tokens_per_second']:,.0f} "
                                f"tokens/s ({best['seconds_per_step']:.3f} s/step)"
                                for q, b, a, best in zip(quotas, before[quotas], after[quotas], alone[quotas],
                                                         strict=True))
                      for quotas in sets)
    kind = "seeds (--seed 0, 1, 2), constant learning rate after 20 warmup steps," if args.quality else "repeats"
    table += (f"\n\n{steps} steps (max_steps; a time-budget run ends when its fastest replica gets there), "
              f"128-token blocks, batch 4, fp32, {repeats} {kind}"
              f" interleaved; median [min, max]. Each replica's rate under its quota with the others training at the "
              f"same time, each alone (no syncs), before the runs and after them: {rates}; capacity = "
              f"{capacity:,.0f} tokens/s (the sum over the 3 replicas of each one's faster rate). round_seconds = "
              f"{inner} × replica 0's seconds per step (measured before the runs). Goodput = (committed tokens − those "
              f"of the steps a mix landing dropped) ÷ (replica 0's loop seconds × capacity); the last sync's wait "
              f"(blocking: the slowest replica's last step and the exchange) is once per run; waited: Σ waited_seconds "
              f"of the replica that waited most (torch: its arrival before the last replica's; torchft: forming the "
              f"quorum) ÷ replica 0's loop seconds. Quotas enforced per "
              f"{args.period_ms:g} ms CFS period.")
    if args.quality:
        table += (f" Equal speed: every replica at {EQUAL:.1%} of a core (the same 1.4 cores; capacity "
                  f"{capacity_of(alone, sets[1]):,.0f} tokens/s), max_steps {equal_steps} so that "
                  f"the three train about as many tokens as the unequal run in about as many syncs.")
        for backend in backends:
            for method in (f"time budget {round_seconds:g} s", f"time budget, delayed Nesterov N = {DELAY}"):
                unequal, same = spreads[f"{backend}, {method}"], spreads[f"{backend}, {method}, equal speed"]
                table += (f"\n- {backend}, {method}: eval loss {unequal['eval_loss']['median']:.4f} at "
                          f"{unequal['tokens']['median']:,.0f} tokens against {same['eval_loss']['median']:.4f} at "
                          f"{same['tokens']['median']:,.0f} at equal speed: "
                          f"{unequal['eval_loss']['median'] / same['eval_loss']['median'] - 1:+.2%} (medians).")
            mixed, eager = (spreads[f"{backend}, time budget, sync_delay 1, {landing} landing"]
                            for landing in ("mixed", "eager"))
            table += (f"\n- {backend}, sync_delay 1: eager landing {eager['eval_loss']['median']:.4f} against mixed "
                      f"{mixed['eval_loss']['median']:.4f}: "
                      f"{eager['eval_loss']['median'] / mixed['eval_loss']['median'] - 1:+.2%} (medians).")
        seeds = ", ".join(f"{name} {s['eval_loss']['max'] - s['eval_loss']['min']:.4f}" for name, s in spreads.items())
        table += f"\n- Seed-to-seed spread of the eval loss (max − min of 3 seeds): {seeds}."
    labels = list(spreads)
    palette = ["#2563eb", "#ea580c", "#059669", "#9333ea", "#0891b2", "#ca8a04", "#db2777", "#4b5563"]
    # --quality draws what it compares: the eval loss of each row's seeds
    metric, scale, label = ("eval_loss", 1, "eval loss") if args.quality else ("goodput", 100, "goodput (%)")
    figure, _ = spread_bars(labels, [{k: scale * v for k, v in spreads[n][metric].items() if k != "values"}
                                     for n in labels], (palette * 2)[:len(labels)], label,
                            f"{first}: {label}", (max(7.5, 1.1 * len(labels)), 3.4))
    mode = "methods" if args.methods else "quality" if args.quality else "overlap" if args.overlap else None
    name = f"speeds-{mode}-{'-'.join(backends)}" if mode else "speeds"
    save(name, table, {"quotas": QUOTAS, "steps": steps, "inner_steps": inner,
                           "round_seconds": round_seconds,
                           "alone": {",".join(map(str, q)): v for q, v in alone.items()},
                           "alone_before": {",".join(map(str, q)): v for q, v in before.items()},
                           "alone_after": {",".join(map(str, q)): v for q, v in after.items()},
                           "period_ms": args.period_ms,
                           "capacity_tokens_per_second": capacity, "runs": runs, "spreads": spreads},
         figure, quick=args.quick, seconds=time.time() - begun)


if __name__ == "__main__":
    os.chdir(Path(__file__).resolve().parents[1])
    main()
