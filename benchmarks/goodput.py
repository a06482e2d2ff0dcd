"""Goodput of 3 replicas when one dies: `outer_backend: torch` (a round is a barrier; a death ends the launch, which
`--max-restarts` starts again from the newest round checkpoint) against `torchft` (decoupled: a dead replica is left
out and restarted, it heals from the live ones). Replicas of unequal speed: benchmarks/speeds.py (real CPU quotas).

Scenarios, each run once per backend on the built-in corpus (tiny Llama, 3 replicas on this machine):
- no fault;
- kill: replica 2's training process is SIGKILLed every N rounds and started again.

Goodput = useful tokens ÷ (wall time × capacity). Useful tokens are those of the rounds the final model contains
(torch: the rounds left after the last resume; torchft: the tokens merged in committed rounds). Wall time is the
launch command's, start-up and restarts included. Capacity is what the replicas could train without waiting:
3 × r, where r = tokens/s per replica of the torch backend's fault-free run in the same invocation (which
therefore reads 100%). Eval loss is the final model's on the held-out blocks, compared with the same backend's
fault-free run.

Variants (`--variants`) run the same four scenarios with another round: `fp32` (plain DiLoCo) and
`int4-ef-streaming` (int4 with error feedback, F = 2 fragments overlapped by τ = 2 steps), on both backends. Each
row also gives the mean bytes a replica sent per round, to compare the backends at the same codec.

    python benchmarks/goodput.py [--quick] [--kill-every N] [--variants fp32,int4-ef-streaming]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
from common import RECIPE, REPO, free_port, markdown_table, pyplot, run_env, save, skip

from hf_diloco.metrics import read_summary, run_syncs

REPLICAS = 3
VARIANTS = {
    "fp32": [],
    "int4-ef-streaming": ["--compression", "int4", "--error_feedback", "true", "--num_fragments", "2",
                          "--sync_delay", "2"],
}


def pid_of_replica(folder: Path, backend: str, replica: int) -> int | None:
    """The training process of `replica`: torchft, by its --replica_id; torch, by the RANK accelerate gave it."""
    for process in psutil.process_iter(["cmdline"]):
        try:
            argv = process.info["cmdline"] or []
            if "hf_diloco.cli" not in argv or "accelerate.commands.launch" in argv or \
                    str(folder) not in " ".join(argv):
                continue
            if backend == "torchft":
                if f"replica-{replica}" in " ".join(argv):
                    return process.pid
            elif process.environ().get("RANK") == str(replica):
                return process.pid
        except psutil.Error:
            continue
    return None


class Killer(threading.Thread):
    """Kills replica 2 whenever the run's round count reaches the next multiple of `every` (each once)."""

    def __init__(self, folder: Path, backend: str, every: int, total_rounds: int):
        super().__init__(daemon=True)
        self.folder, self.backend, self.every, self.total = folder, backend, every, total_rounds
        self.kills: list[int] = []
        self.done = threading.Event()

    def run(self) -> None:
        target = self.every
        while not self.done.is_set() and target < self.total:
            rounds = run_syncs(self.folder)
            members = rounds[-1].get("replicas", []) if rounds else []
            present = not members or {"replica": 2, "participated": False} not in members
            if rounds and rounds[-1]["round"] >= target and present:
                pid = pid_of_replica(self.folder, self.backend, 2)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    self.kills.append(rounds[-1]["round"])
                    print(f"  killed replica 2 after round {rounds[-1]['round']}", flush=True)
                    target += self.every
            time.sleep(0.2)


def command(backend: str, folder: Path, overrides: list[str]) -> list[str]:
    train = ["-m", "hf_diloco.cli", "train", "--config", str(RECIPE), "--disable_tqdm", "true", *overrides]
    if backend == "torch":
        return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(REPLICAS),
                "--num_machines", "1", "--main_process_port", str(free_port()), "--mixed_precision", "no",
                "--dynamo_backend", "no", *train, "--output_dir", str(folder)]
    return [sys.executable, *train]


def run(backend: str, scenario: str, folder: Path, overrides: list[str], kill_every: int, total_rounds: int) -> dict:
    """One launch of a scenario, as a user would start it; returns its measurements."""
    from hf_diloco.launch import ReplicaSupervisor, replica_overrides, run_with_restarts, start_lighthouse

    env_before = dict(os.environ)
    os.environ.update(run_env(1))
    killer = Killer(folder, backend, kill_every, total_rounds) if scenario == "kill" else None
    restarts = total_rounds // kill_every + 1 if killer else 0
    started = time.perf_counter()
    try:
        if killer:
            killer.start()
        if backend == "torch":
            code = run_with_restarts(command(backend, folder, overrides), restarts)
        else:
            server = start_lighthouse("127.0.0.1:0", 2, 5.0, heartbeat_timeout_seconds=2.0)
            address = f"http://127.0.0.1:{server.address().rsplit(':', 1)[1]}"
            extra = ["--min_replicas", "2", "--sync_grace_seconds", "5"]
            commands = [command(backend, folder, replica_overrides([*overrides, *extra], r, REPLICAS, address,
                                                                   str(folder))) for r in range(REPLICAS)]
            try:
                code = ReplicaSupervisor(commands, str(folder), restarts, linger_seconds=20).run()
            finally:
                server.shutdown()
    finally:
        if killer:
            killer.done.set()
        os.environ.clear()
        os.environ.update(env_before)
    wall = time.perf_counter() - started
    if code != 0:
        sys.exit(f"goodput: the {backend} {scenario} run failed (exit {code}); its output is above.")
    rounds = run_syncs(folder)
    lead = folder if backend == "torch" else folder / "replica-0"
    summary = read_summary(lead)
    sent = [r["bytes_per_replica"] for r in rounds if r.get("committed", True) and r["bytes_per_replica"]]
    return {"backend": backend, "scenario": scenario, "wall_seconds": wall, "rounds": len(rounds),
            "bytes_per_round": sum(sent) / len(sent) if sent else 0.0,
            "useful_tokens": sum(r["tokens"] for r in rounds), "eval_loss": summary.get("eval_loss_final"),
            "kills": killer.kills if killer else [],
            "round_compute_seconds": [r["compute_seconds"] for r in rounds],
            "participants": [sum(bool(m.get("participated")) for m in r["replicas"]) for r in rounds]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="120 steps, H = 30 (about 4 minutes)")
    parser.add_argument("--kill-every", type=int, default=0, help="rounds between kills (default: 2 quick, 4 full)")
    parser.add_argument("--variants", default="fp32", help=f"comma-separated, from {', '.join(VARIANTS)}")
    args = parser.parse_args()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        sys.exit(f"goodput: unknown variant(s) {', '.join(unknown) or '(none given)'}; choose from "
                 f"{', '.join(VARIANTS)}.")
    try:
        import torchft  # noqa: F401
    except ImportError:
        skip("goodput", "torchft is not installed (pip install -e '.[ft]').")
    begun = time.time()
    # Full: rounds of about 8 s, so that a replica's restart (about 12 s of start-up here) costs it a round or two,
    # not half the run; quick: the same method at a third of the length.
    steps, inner = (120, 30) if args.quick else (600, 50)
    kill_every = args.kill_every or (2 if args.quick else 4)
    total_rounds = -(-steps // inner)
    overrides = ["--max_steps", str(steps), "--inner_steps", str(inner), "--block_size", "128",
                 "--per_device_train_batch_size", "4", "--eval_strategy", "steps", "--eval_steps", str(steps),
                 "--eval_on_start", "false", "--save_strategy", "no", "--logging_steps", str(steps),
                 "--sync_timeout", "120"]
    results = []
    scenarios = ["no fault", "kill"]
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        plan = [(variant, backend, scenario) for variant in variants for scenario in scenarios
                for backend in ("torch", "torchft")]
        for i, (variant, backend, scenario) in enumerate(plan):
            print(f"[{i + 1}/{len(plan)}] {variant}, {backend}: {scenario} ...", flush=True)
            extra = ["--save_every_rounds", "1" if backend == "torch" and scenario == "kill" else "0",
                     *VARIANTS[variant]]
            result = run(backend, scenario, tmp / f"{variant}-{backend}-{scenario.replace(' ', '-')}",
                         [*overrides, *extra], kill_every, total_rounds)
            result["variant"] = variant
            results.append(result)
    base = next(r for r in results if r["backend"] == "torch" and r["scenario"] == "no fault")
    rate = base["useful_tokens"] / (REPLICAS * base["wall_seconds"])  # tokens/s per full-speed replica
    reference_loss = {(r["variant"], r["backend"]): r["eval_loss"] for r in results if r["scenario"] == "no fault"}
    rows = []
    for r in results:
        r["goodput"] = r["useful_tokens"] / (r["wall_seconds"] * rate * REPLICAS)
        reference = reference_loss[(r["variant"], r["backend"])]
        loss_change = r["eval_loss"] / reference - 1 if r["eval_loss"] else float("nan")
        rows.append([r["variant"], r["backend"], r["scenario"], f"{r['goodput']:.1%}", f"{r['useful_tokens']:,}",
                     f"{r['wall_seconds']:.0f}", r["rounds"], f"{r['bytes_per_round'] / 1e6:.3f}",
                     f"{r['eval_loss'] or float('nan'):.4f}", f"{loss_change:+.2%}",
                     ", ".join(map(str, r["kills"])) or "-",
                     ", ".join(f"{k + 1} ({n})" for k, n in enumerate(r["participants"]) if n < REPLICAS) or "-"])
    table = markdown_table(["round", "backend", "scenario", "goodput", "useful tokens", "wall s", "rounds",
                            "MB per round", "eval loss", "vs its fault-free", "killed after rounds",
                            "rounds without every replica (how many took part)"], rows)
    table += (f"\n\n3 replicas, {steps} steps, H = {inner} ({total_rounds} rounds of H), 128-token blocks, batch 4; "
              f"kill: replica 2 SIGKILLed every {kill_every} rounds and restarted. Goodput = useful tokens ÷ (wall × "
              f"capacity), capacity = {REPLICAS} × {rate:,.0f} tokens/s (the first torch fault-free run's rate per "
              f"replica). MB per round: mean bytes a replica sent per committed round "
              f"(a fragment round with streaming). One run per row.")
    plt = pyplot()
    figure, axes = plt.subplots(1, len(variants), figsize=(7 * len(variants), 3.2), squeeze=False)
    for axis, variant in zip(axes[0], variants, strict=True):
        for offset, backend, color in ((-0.2, "torch", "#2563eb"), (0.2, "torchft", "#ea580c")):
            values = [next(r["goodput"] for r in results if r["backend"] == backend and r["scenario"] == s and
                           r["variant"] == variant) * 100 for s in scenarios]
            axis.bar([i + offset for i in range(len(scenarios))], values, width=0.38, color=color, label=backend)
        axis.set_xticks(range(len(scenarios)), scenarios)
        axis.set_ylabel("goodput (%)")
        axis.axhline(90, color="#888", linestyle="--", linewidth=1)
        axis.legend()
        axis.set_title(f"3 replicas ({variant}): goodput when one dies")
    name = "goodput" if variants == ["fp32"] else "goodput-variants"
    save(name, table, {"results": results, "rate_per_replica": rate, "steps": steps, "inner_steps": inner,
                       "kill_every": kill_every, "variants": variants},
         figure, quick=args.quick, seconds=time.time() - begun)


if __name__ == "__main__":
    os.chdir(REPO)
    main()
