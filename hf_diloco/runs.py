"""Runs as folders, started and stopped from outside: what the app (and anyone else) uses to manage training.

    <runs_dir>/<run_id>/run.json     recipe, accelerate config, overrides, command, pids, status, times, exit code
    <runs_dir>/<run_id>/run.log      everything the run printed
    <runs_dir>/<run_id>/output/      the run's output_dir (sync_rounds.jsonl, checkpoints, model)

Design choices:
- State lives on disk, never in a server's memory: any number of runs, and an app restart loses nothing.
- Every run is started under a small supervisor process (`python -m hf_diloco.runs supervise RUN_DIR`), detached
  in a session of its own. The supervisor starts the command as an argument list (never a shell), waits for it
  and writes the exit code and final status into run.json, so the outcome is recorded even if the app is gone.
- Status is read from the processes, not guessed: a run.json saying "running" whose supervisor no longer exists
  is reported as failed.
- Stop is graceful: SIGUSR1 goes to the training processes, which finish the current round, save a checkpoint and
  exit (see DiLoCoTrainer); the stop request rides along with the round's sync, so every replica stops at the same
  step. The supervisor and everything below it are killed only if the run is still alive after `grace_seconds`.
- This module imports neither torch nor transformers, so the app stays light.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

RUN_FILE = "run.json"
LOG_FILE = "run.log"
OUTPUT_DIR = "output"
STOP_SIGNAL = signal.SIGUSR1
ACTIVE = ("starting", "running", "stopping")


def accelerate_command(recipe: str, accelerate_config: str, overrides: list[str], port: int | None = None,
                       launch_args: list[str] | None = None) -> list[str]:
    """The `accelerate launch ... -m hf_diloco.cli train --config RECIPE ...` command, as an argument list.

    `launch_args` are accelerate's own flags (e.g. --num_processes, --machine_rank); `overrides` are recipe fields.
    """
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", accelerate_config]
    if port is not None:
        command += ["--main_process_port", str(port)]
    return command + [*(launch_args or []), "-m", "hf_diloco.cli", "train", "--config", recipe, *overrides]


@dataclass
class Run:
    id: str
    recipe: str
    accelerate_config: str
    overrides: list[str]
    command: list[str]
    output_dir: str
    status: str = "starting"
    supervisor_pid: int | None = None
    created: float = field(default_factory=time.time)
    ended: float | None = None
    exit_code: int | None = None
    stop_requested: float | None = None

    @property
    def folder(self) -> Path:
        return Path(self.output_dir).parent


def _write(run_dir: Path, run: Run) -> None:
    temporary = run_dir / (RUN_FILE + ".tmp")
    temporary.write_text(json.dumps(asdict(run), indent=2) + "\n")
    temporary.replace(run_dir / RUN_FILE)  # atomic: readers never see half a file


def _read(run_dir: Path) -> Run:
    return Run(**json.loads((run_dir / RUN_FILE).read_text()))


def _alive(pid: int | None, marker: str) -> bool:
    """True if `pid` runs and its command line contains `marker` (a recycled pid does not count)."""
    if not pid:
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return marker in cmdline and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def load(run_dir: Path) -> Run:
    """A run with its real status: an active run whose supervisor is gone has failed."""
    run = _read(run_dir)
    if run.status in ACTIVE and not _alive(run.supervisor_pid, "hf_diloco.runs"):
        run.status = "failed"
        run.ended = run.ended or time.time()
    return run


def list_runs(runs_dir: Path) -> list[Run]:
    """Every run under `runs_dir`, newest first."""
    if not runs_dir.is_dir():
        return []
    runs = [load(p.parent) for p in runs_dir.glob(f"*/{RUN_FILE}")]
    return sorted(runs, key=lambda r: r.created, reverse=True)


def new_run_id(runs_dir: Path, recipe: str) -> str:
    base = f"{Path(recipe).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_id, n = base, 1
    while (runs_dir / run_id).exists():
        n += 1
        run_id = f"{base}-{n}"
    return run_id


def plan(runs_dir: Path, recipe: str, accelerate_config: str, overrides: list[str], port: int | None = None,
         launch_args: list[str] | None = None) -> Run:
    """The run that `start_planned` will start: its id, output folder and exact command (nothing is created)."""
    run_id = new_run_id(runs_dir, recipe)
    output_dir = str((runs_dir / run_id / OUTPUT_DIR).resolve())
    command = accelerate_command(recipe, accelerate_config, [*overrides, "--output_dir", output_dir], port, launch_args)
    return Run(run_id, recipe, accelerate_config, list(overrides), command, output_dir)


def start_planned(run: Run) -> Run:
    """Create the run folder and start the run under its supervisor, detached in its own session."""
    run_dir = run.folder
    run_dir.mkdir(parents=True)
    _write(run_dir, run)
    with (run_dir / LOG_FILE).open("ab") as log:  # the supervisor's own errors, if any, end up in the log
        supervisor = subprocess.Popen(
            [sys.executable, "-m", "hf_diloco.runs", "supervise", str(run_dir)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
        )
    run.supervisor_pid = supervisor.pid
    run.status = "running"
    _write(run_dir, run)
    return run


def start(runs_dir: Path, recipe: str, accelerate_config: str, overrides: list[str], port: int | None = None,
          launch_args: list[str] | None = None) -> Run:
    """Plan and start a run."""
    runs_dir.mkdir(parents=True, exist_ok=True)
    return start_planned(plan(runs_dir, recipe, accelerate_config, overrides, port, launch_args))


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (torch's launcher puts its workers in sessions of their own, so a process group
    would miss them)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # after the command: state, ppid, ...
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def training_pids(run: Run) -> list[int]:
    """The run's training processes on this machine (one per local replica), not its launcher."""
    if not run.supervisor_pid:
        return []
    return [pid for pid in _descendants(run.supervisor_pid)
            if _alive(pid, "hf_diloco.cli train") and not _alive(pid, "accelerate.commands.launch")]


def stop(run_dir: Path, grace_seconds: float = 600.0) -> Run:
    """Ask the run to stop at the end of its current round (checkpoint saved); kill it after `grace_seconds`."""
    run = load(run_dir)
    if run.status not in ACTIVE:
        return run
    for pid in training_pids(run):
        try:
            os.kill(pid, STOP_SIGNAL)
        except ProcessLookupError:
            pass
    run.stop_requested = run.stop_requested or time.time()
    run.status = "stopping"
    _write(run_dir, run)
    subprocess.Popen(
        [sys.executable, "-m", "hf_diloco.runs", "reap", str(run_dir), str(grace_seconds)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    return run


def _supervise(run_dir: Path) -> int:
    """Run the command, then record how it ended."""
    signal.signal(STOP_SIGNAL, signal.SIG_IGN)  # the stop signal is for the trainers
    run = _read(run_dir)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_DILOCO_STOP_SIGNAL": "1"}
    with (run_dir / LOG_FILE).open("ab") as log:
        log.write(("$ " + " ".join(run.command) + "\n").encode())
        log.flush()
        code = subprocess.call(run.command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env)
    run = _read(run_dir)  # the app may have asked to stop meanwhile
    run.exit_code = code
    run.ended = time.time()
    run.status = ("stopped" if run.stop_requested else "finished") if code == 0 else "failed"
    _write(run_dir, run)
    return code


def _reap(run_dir: Path, grace_seconds: float) -> None:
    """Kill the run's supervisor and all its descendants if it outlives the grace period after a stop request."""
    deadline = time.time() + grace_seconds
    while time.time() < deadline:
        if load(run_dir).status not in ACTIVE:
            return
        time.sleep(1.0)
    run = load(run_dir)
    if run.status in ACTIVE and run.supervisor_pid:
        for pid in [run.supervisor_pid, *_descendants(run.supervisor_pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        run.status, run.ended = "stopped", time.time()
        run.exit_code = run.exit_code if run.exit_code is not None else -signal.SIGKILL
        _write(run_dir, run)


if __name__ == "__main__":
    action, folder = sys.argv[1], Path(sys.argv[2])
    if action == "supervise":
        sys.exit(_supervise(folder))
    if action == "reap":
        _reap(folder, float(sys.argv[3]))
