"""Chaos, measured: one torchft run of 3 replicas at 3 sites (network namespaces on a switch), while replicas are
killed at random, one site's link is cut for 30 s and another's slowed to 1 Mbit/s, against the same run with no
fault in the same namespaces.

Each site runs what a user runs there: `hf-diloco launch RECIPE --accelerate-config torchft-replica.yaml
--max-restarts 5 -- --replica_id r --lighthouse http://HUB:PORT --replica_address SITE_ADDRESS ...`, with gloo bound
to the site's link; the Lighthouse runs on the switch's namespace. The faults, at seconds after the first
committed round (a seeded random choice of which replica dies):

    kill a random replica's training process (SIGKILL; its launcher starts it again and it heals)
    cut site 1's link for 30 s (link down: every packet to or from it is lost)
    slow site 2's link to 1 Mbit/s, both ways, for 60 s
    kill another random replica (at 115 s)

Reported: goodput (tokens merged in committed rounds, less those whose steps a mix landing dropped, ÷ (wall × 3 ×
the fault-free run's merged tokens/s per replica)),
the final eval loss against the fault-free run's, the rounds the survivors committed while site 1 was cut off,
whether every replica ends with the same model, and whether every round checkpoint a replica saved is complete.
The rounds use int4 with error feedback, so that a round fits a 1 Mbit/s link (0.37 MB per replica per round).

`--round-seconds T` runs both with time-budget rounds of T seconds instead of rounds of H steps
(results/chaos-time-budget.*), overlapped as the defaults overlap them (sync_delay unset: τ = 1); `--sync-delay auto`
sizes τ from the measured exchange instead, so that during the slow phase the budget stretches to the slow link's
exchange instead of every round waiting for it.

Saves as the shipped recipe for one site makes them (recipes/tiny-pretrain.yaml: a round checkpoint after every
round, `save_every_rounds: 1`), not turned off: each of them is a save window, landed together by every replica,
so overlap stays on through them. `--save-every-rounds N` changes it.

`--landing eager` lands those overlapped syncs with `overlap_landing: eager` (the steps a replica takes while its
sync is in flight are kept on top of the new θ_global) instead of the mix landing at α 0, which drops them: during
the slow phase τ covers a slow exchange, tens of steps, so the mix landing throws most of that phase's compute away
(results/chaos-time-budget-eager.*).

    python benchmarks/chaos.py [--quick] [--seed N] [--save-every-rounds N]
                               [--round-seconds T [--landing mix|eager] [--sync-delay auto|N]]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
from common import REPO, dropped_tokens, markdown_table, pyplot, run_env, save, skip
from netns import NamespaceError, star

sys.path.insert(0, str(REPO))
from hf_diloco.metrics import read_summary, read_syncs, run_syncs  # noqa: E402

REPLICAS = 3
TORCHFT_RECIPE = REPO / "recipes" / "torchft-3.yaml"
CONFIG = REPO / "accelerate_configs" / "torchft-replica.yaml"
CUT_SECONDS = 30.0
SLOW_SECONDS = 60.0
SLOW_RATE = 1_000_000


def committed(folder: Path) -> list[dict]:
    return [r for r in run_syncs(folder) if r.get("committed", True)]


def training_pid(folder: Path, replica: int) -> int | None:
    for process in psutil.process_iter(["cmdline"]):
        argv = process.info["cmdline"] or []
        launcher = {"accelerate.commands.launch", "hf_diloco.accelerate_launch"} & set(argv)
        if "train" in argv and not launcher and str(folder / f"replica-{replica}") in argv:
            return process.pid
    return None


class Chaos(threading.Thread):
    """Runs the faults at their times (seconds after the first committed round) and notes what happened."""

    def __init__(self, folder: Path, network, plan: list[tuple[float, str, int]]):
        super().__init__(daemon=True)
        self.folder, self.network, self.plan = folder, network, plan
        self.done = threading.Event()
        self.events: list[dict] = []
        self.cut_rounds: tuple[int, int] | None = None

    def run(self) -> None:
        while not self.done.is_set() and not committed(self.folder):
            time.sleep(0.2)
        origin = time.monotonic()
        for at, action, replica in self.plan:
            while not self.done.is_set() and time.monotonic() - origin < at:
                time.sleep(0.2)
            if self.done.is_set():
                self.events.append({"at": at, "action": action, "replica": replica, "skipped": "the run had ended"})
                continue
            before = len(committed(self.folder))
            if action == "kill":
                pid = training_pid(self.folder, replica)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
            elif action == "cut":
                self.network.cut(replica, True)
                self.done.wait(CUT_SECONDS)
                self.network.cut(replica, False)
                self.cut_rounds = (before, len(committed(self.folder)))
            elif action == "slow":
                self.network.shape(replica, SLOW_RATE)
                self.done.wait(SLOW_SECONDS)
                self.network.shape(replica, None)
            self.events.append({"at": at, "action": action, "replica": replica, "rounds_before": before})
            print(f"  {at:5.0f} s: {action} site {replica} (after {before} committed rounds)", flush=True)


def model_digest(folder: Path) -> str | None:
    path = folder / "model.safetensors"
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.exists() else None


def incomplete_checkpoints(folder: Path) -> list[str]:
    """Round checkpoints without their completion marker, and leftovers of a save that was cut off."""
    bad = [str(p.relative_to(folder)) for p in folder.glob("replica-*/checkpoint-*")
           if not (p / "diloco_complete.json").exists()]
    return bad + [str(p.relative_to(folder)) for p in folder.glob("replica-*/tmp-checkpoint-*")]


def run(network, folder: Path, overrides: list[str], plan: list[tuple[float, str, int]] | None) -> dict:
    """One run of 3 sites (with the faults of `plan`, or none); returns its measurements."""
    port = 29600 + random.randrange(300)
    hub = network.hub
    lighthouse = subprocess.Popen(
        ["ip", "netns", "exec", hub.namespace, sys.executable, "-m", "hf_diloco.cli", "lighthouse", "--host",
         hub.address, "--port", str(port), "--min-replicas", "2", "--grace-seconds", "5", "--heartbeat-timeout", "3"],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=run_env(1), cwd=REPO)
    sites = []
    for r, host in enumerate(network.hosts):
        command = ["ip", "netns", "exec", host.namespace, "env", f"GLOO_SOCKET_IFNAME={host.link}", sys.executable,
                   "-m", "hf_diloco.cli", "launch", str(TORCHFT_RECIPE), "--accelerate-config", str(CONFIG),
                   "--max-restarts", "5", "--", *overrides, "--replica_id", str(r), "--num_replicas", str(REPLICAS),
                   "--lighthouse", f"http://{hub.address}:{port}", "--replica_address", host.address,
                   "--output_dir", str(folder / f"replica-{r}")]
        log = (folder.parent / f"{folder.name}-site{r}.log").open("w")
        sites.append((subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=run_env(1), cwd=REPO), log))
    chaos = Chaos(folder, network, plan) if plan else None
    started = time.perf_counter()
    if chaos:
        chaos.start()
    try:
        codes = [process.wait(timeout=3600) for process, _ in sites]
    finally:
        wall = time.perf_counter() - started
        if chaos:
            chaos.done.set()
            chaos.join()
        for process, log in sites:
            if process.poll() is None:
                process.kill()
            log.close()
        lighthouse.kill()
        for r in range(REPLICAS):
            network.shape(r, None)
            network.cut(r, False)
    rounds = committed(folder)
    summary = read_summary(folder / "replica-0")
    own = read_syncs(folder / "replica-0")
    budgets = [r["sync_delay_auto"]["budget_seconds"] for r in own if "budget_seconds" in r.get("sync_delay_auto", {})]
    return {"codes": codes, "wall_seconds": wall, "rounds": len(rounds), "tokens": sum(r["tokens"] for r in rounds),
            "dropped": 0 if "eager" in overrides else dropped_tokens([folder / f"replica-{k}"
                                                                      for k in range(REPLICAS)]),
            "eval_loss": summary.get("eval_loss_final"), "digests": [model_digest(folder / f"replica-{r}")
                                                                     for r in range(REPLICAS)],
            "incomplete_checkpoints": incomplete_checkpoints(folder),
            "checkpoints": len(list(folder.glob("replica-*/checkpoint-*"))),
            "events": chaos.events if chaos else [], "cut_rounds": chaos.cut_rounds if chaos else None,
            "participants": [r.get("participants") for r in rounds],
            "blocked_share_0": sum(r["blocked_seconds"] for r in own) / wall, "largest_budget": max(budgets, default=0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer steps, the same faults closer together")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random choice of replicas to kill")
    parser.add_argument("--round-seconds", type=float, default=0.0,
                        help="time-budget rounds of this many seconds, overlapped as the defaults overlap them "
                             "(0: rounds of H steps)")
    parser.add_argument("--sync-delay", default="",
                        help="sync_delay of the time-budget rounds (auto or a number of steps; unset: the default)")
    parser.add_argument("--save-every-rounds", type=int, default=1,
                        help="a round checkpoint every this many rounds (default 1, recipes/tiny-pretrain.yaml's)")
    parser.add_argument("--landing", choices=["mix", "eager"], default="mix",
                        help="overlap_landing of the time-budget rounds' overlapped syncs (with --round-seconds)")
    args = parser.parse_args()
    if args.round_seconds < 0:
        sys.exit(f"chaos: --round-seconds must be 0 or more, not {args.round_seconds:g}.")
    if (args.landing != "mix" or args.sync_delay) and not args.round_seconds:
        sys.exit("chaos: --landing and --sync-delay apply to overlapped time-budget rounds: give --round-seconds too.")
    if args.save_every_rounds < 0:
        sys.exit(f"chaos: --save-every-rounds must be 0 or more, not {args.save_every_rounds}.")
    try:
        import torchft  # noqa: F401
    except ImportError:
        skip("chaos", "torchft is not installed (pip install -e '.[ft]').")
    begun = time.time()
    rng = random.Random(args.seed)
    steps, inner = (400, 20) if args.quick else (1200, 20)
    scale = 0.5 if args.quick else 1.0
    # Every fault inside the run: since the slow phase no longer holds the replicas (a sync that comes due while
    # the one before still exchanges waits for it, and the replicas train on), a time-budget run ends about 135 s
    # after its first sync, where a kill at 135 s (the plan until then) found it over.
    plan = [(10 * scale, "kill", rng.randrange(REPLICAS)), (25 * scale, "cut", 1), (65 * scale, "slow", 2),
            (115 * scale, "kill", rng.randrange(REPLICAS))]
    overrides = ["--max_steps", str(steps), "--inner_steps", str(inner), "--block_size", "128",
                 "--per_device_train_batch_size", "4", "--eval_strategy", "steps", "--eval_steps", str(steps),
                 "--eval_on_start", "false", "--logging_steps", str(steps), "--disable_tqdm", "true",
                 "--compression", "int4", "--error_feedback", "true", "--min_replicas", "2",
                 "--sync_grace_seconds", "5", "--sync_timeout", "20", "--save_strategy", "no",
                 "--save_every_rounds", str(args.save_every_rounds), "--end_linger_seconds", "60"]
    if args.round_seconds:
        overrides += ["--round_seconds", str(args.round_seconds), "--overlap_landing", args.landing]
        overrides += ["--sync_delay", args.sync_delay] if args.sync_delay else []
    try:
        with tempfile.TemporaryDirectory() as tmp_name, star(REPLICAS) as network:
            tmp = Path(tmp_name)
            print("[1/2] no fault ...", flush=True)
            clean = run(network, tmp / "clean", overrides, None)
            print("[2/2] chaos ...", flush=True)
            chaos = run(network, tmp / "chaos", overrides, plan)
    except NamespaceError as error:
        skip("chaos", f"network namespaces cannot be made here: {error}")
    rate = clean["tokens"] / (REPLICAS * clean["wall_seconds"])
    rows = []
    for name, r in (("no fault", clean), ("chaos", chaos)):
        goodput = (r["tokens"] - r["dropped"]) / (r["wall_seconds"] * REPLICAS * rate)
        loss = f"{r['eval_loss']:.4f}" if r["eval_loss"] else "-"
        change = f"{r['eval_loss'] / clean['eval_loss'] - 1:+.2%}" if r["eval_loss"] and clean["eval_loss"] else "-"
        during = (f"{r['cut_rounds'][1] - r['cut_rounds'][0]}" if r["cut_rounds"] else "-")
        rows.append([name, f"{goodput:.1%}", f"{r['blocked_share_0']:.1%}", f"{r['tokens']:,}", f"{r['dropped']:,}",
                     f"{r['wall_seconds']:.0f}", r["rounds"], loss,
                     change, during, "yes" if len(set(r["digests"])) == 1 and r["digests"][0] else "NO",
                     f"{r['checkpoints'] - len(r['incomplete_checkpoints'])} of {r['checkpoints']}",
                     " ".join(map(str, r["codes"]))])
    table = markdown_table(["run", "goodput", "replica 0 blocked", "tokens merged", "of which dropped at landing",
                            "wall s", "committed rounds",
                            "eval loss", "vs no fault", "rounds committed during the 30 s cut", "replicas identical",
                            "round checkpoints complete", "exit codes"], rows)
    delay = f"sync_delay {args.sync_delay}" if args.sync_delay else "the default sync_delay (1)"
    rounds = f"time-budget rounds of {args.round_seconds:g} s overlapped with {delay}, {args.landing} " \
        "landing" if args.round_seconds else f"H = {inner}"
    events = "; ".join(f"{e['at']:.0f} s {e['action']} site {e['replica']}" + (f" ({e['skipped']})"
                                                                              if "skipped" in e else "")
                       for e in chaos["events"])
    table += (f"\n\n3 torchft replicas at 3 sites (network namespaces on one switch, 2 CPU cores shared), {steps} "
              f"steps, {rounds}, int4 + error feedback, min_replicas 2, a round checkpoint every "
              f"{args.save_every_rounds} round(s), "
              f"`--max-restarts 5` at each site. Faults (seconds after the first committed round): {events}. "
              f"Goodput = (tokens merged in committed rounds − those whose steps a mix landing dropped: the "
              f"`in_flight_steps` of each replica's overlapped syncs) ÷ (wall × 3 × {rate:,.0f} tokens/s, the "
              f"fault-free run's merged rate per replica); replica 0 blocked: Σ its records' blocked_seconds ÷ wall. "
              f"One run each.")
    if args.round_seconds and clean["largest_budget"] and chaos["largest_budget"]:
        table += (f" The largest budget a sync stretched to: {clean['largest_budget']:.2f} s without faults, "
                  f"{chaos['largest_budget']:.2f} s under chaos.")
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(7, 3))
    for name, r, color in (("no fault", clean, "#2563eb"), ("chaos", chaos, "#ea580c")):
        axis.step(range(1, len(r["participants"]) + 1), r["participants"], where="mid", color=color, label=name)
    axis.set(xlabel="committed round", ylabel="replicas in the round", title="Who took part in each round")
    axis.legend()
    name = ("chaos-time-budget" + ("-eager" if args.landing == "eager" else "")) if args.round_seconds else "chaos"
    save(name, table,
         {"clean": clean, "chaos": chaos, "plan": plan, "round_seconds": args.round_seconds}, figure, quick=args.quick,
         seconds=time.time() - begun)


if __name__ == "__main__":
    main()
