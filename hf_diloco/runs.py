"""Runs as folders, started and stopped from outside: what the app (and anyone else) uses to manage training.

    <runs_dir>/<run_id>/run.json     recipe, accelerate config, overrides, command, pids, status, times, exit code
    <runs_dir>/<run_id>/run.log      everything the run printed
    <runs_dir>/<run_id>/output/      the run's output_dir (syncs.jsonl, checkpoints, model, and the files
                                     below, written by hf_diloco.run_callbacks)
        progress.json       step, max_steps and phase, rewritten by the main process as it trains
        trainer_log.jsonl   every dict Trainer logged (loss, eval_loss, ...): what a baseline run shows
        stop.request        written by `stop`; the run stops at the next round boundary (or step) and removes it
        stopped.json        written by the run when it has stopped on request, with the step and checkpoint
        replica-r/          an `outer_backend: torchft` run (`hf-diloco launch --replicas N`): replica r's own
                            syncs.jsonl, progress.json, ... and model; the launcher hands stop.request on to
                            every replica folder and writes stopped.json here
        replicas.json       such a run's replica launches: state (running, rejoining, finished, exited),
                            restarts and exit code of each, rewritten by the launcher as they change

Design choices:
- State lives on disk, never in a server's memory: any number of runs, and an app restart loses nothing.
- Every run is started under a small supervisor process (`python -m hf_diloco.launch supervise RUN_DIR`), detached
  in a session of its own. The supervisor starts the command as an argument list (never a shell), waits for it
  and writes the exit code and final status into run.json, so the outcome is recorded even if the app is gone.
- Status is read from the processes, not guessed: a run.json saying "running" whose supervisor no longer exists
  is reported as failed.
- Stop is graceful: `stop` writes `stop.request` into the output folder; the runs' StopOnRequest callback
  finishes the current round (DiLoCo; the request rides along with the round's sync, so every replica stops at
  the same step) or step (plain Trainer), saves a checkpoint and exits. A request made while the run is still
  starting is honoured at its first step. The status says `stopped` only if the run wrote `stopped.json`; a run
  that reached its end first is `finished`. The supervisor and everything below it are killed only if the run is
  still alive after `grace_seconds` (status `failed`).
- A failed run keeps its own one-sentence reason (`reason`): the CLI's last `hf-diloco: error:` line, else the
  last exception line of the log.
- Run ids come from the run's name plus a counter, not a clock, so the command Preview shows is the one Start
  runs; the run's clock (`created`) starts when it is started.
- An `outer_backend: torchft` run is one `hf-diloco launch --replicas N` command (a Lighthouse and N replica
  launches on this machine) instead of one `accelerate launch`; stopping and status work the same way.
- This module imports neither torch nor transformers, so the app stays light.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from .errors import DamagedFile, first_line
from .files import WHAT_TO_DO, read_json, write_json
from .metrics import EARLIER_SYNCS_FILE, SUMMARY_FILE, SYNCS_FILE, launch_folder, replica_folders

RUN_FILE = "run.json"
LOCK_FILE = "run.lock"
LOG_FILE = "run.log"
OUTPUT_DIR = "output"
STOP_SIGNAL = signal.SIGUSR1
STOP_FILE = "stop.request"
STOPPED_FILE = "stopped.json"
PROGRESS_FILE = "progress.json"
TRAINER_LOG_FILE = "trainer_log.jsonl"
REPLICAS_FILE = "replicas.json"  # a torchft launch's replica states, written by launch.ReplicaSupervisor
CONFIG_FILE = "run_config.json"  # the run's settings, written by `hf-diloco train` and DiLoCoTrainer
# Files every run of hf-diloco writes into its output folder, whoever started it: a folder under the runs directory
# that holds one of them (or whose replica-r folders do) is a run, shown beside those the app started.
RUN_MARKERS = (SYNCS_FILE, EARLIER_SYNCS_FILE, PROGRESS_FILE, TRAINER_LOG_FILE, CONFIG_FILE, SUMMARY_FILE)
GROWING_SECONDS = 120.0  # a found run that has not finished is running while its files changed this recently
ACTIVE = ("starting", "running", "stopping")
ERROR_PREFIX = "hf-diloco: error: "
EXCEPTION_LINE = re.compile(r"^(?:[\w.]+\.)?(\w+(?:Error|Exception)): (.+)$")


# `accelerate launch`, with torchrun's rendezvous store on the launch's own address (hf_diloco.accelerate_launch).
LAUNCHER = "hf_diloco.accelerate_launch"


def accelerate_command(recipe: str, accelerate_config: str, overrides: list[str], port: int | None = None,
                       launch_args: list[str] | None = None) -> list[str]:
    """The `accelerate launch ... -m hf_diloco.cli train --config RECIPE ...` command, as an argument list.

    `launch_args` are accelerate's own flags (e.g. --num_processes, --machine_rank); `overrides` are recipe fields.
    """
    command = [sys.executable, "-m", LAUNCHER, "--config_file", accelerate_config]
    if port is not None:
        command += ["--main_process_port", str(port)]
    return command + [*(launch_args or []), "-m", "hf_diloco.cli", "train", "--config", recipe, *overrides]


def torchft_command(recipe: str, accelerate_config: str, replicas: int, overrides: list[str],
                    max_restarts: int = 0) -> list[str]:
    """The `hf-diloco launch RECIPE --accelerate-config CONFIG --replicas N --max-restarts R ...` command of an
    `outer_backend: torchft` run, as an argument list: a torchft Lighthouse and N replica launches, replica r
    writing `<output_dir>/replica-r` and started again up to R times when it fails. `overrides` are recipe fields."""
    return [sys.executable, "-m", "hf_diloco.cli", "launch", recipe, "--accelerate-config", accelerate_config,
            "--replicas", str(replicas), "--max-restarts", str(max_restarts), *overrides]


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
    name: str = ""
    reason: str = ""
    form: dict = field(default_factory=dict)  # the app's knobs as the user filled them in (a reload refills these)
    # a folder a run wrote that the app did not start (`hf-diloco train`, `launch`, `slurm`, `demo`, Python): it is
    # its own output folder, has no run.json, and is watched, compared and pushed, not stopped or restarted
    found: bool = False
    # keys of run.json this version does not know (written by a newer one): kept as they were when it is rewritten
    unknown: dict = field(default_factory=dict, repr=False)

    @property
    def folder(self) -> Path:
        return Path(self.output_dir) if self.found else Path(self.output_dir).parent


def _write(run_dir: Path, run: Run) -> None:
    values = asdict(run)
    write_json(run_dir / RUN_FILE, {**values.pop("unknown"), **values})  # atomic: readers never see half a file


def _read(run_dir: Path) -> Run:
    """The run.json of `run_dir`; DamagedFile, naming it, when it cannot be read as a run. Keys this version does
    not know (a newer version wrote the file) are kept aside, not read, and written back as they were."""
    values = read_json(run_dir / RUN_FILE)
    known = set(Run.__dataclass_fields__) - {"unknown"}
    try:
        return Run(**{k: v for k, v in values.items() if k in known},
                   unknown={k: v for k, v in values.items() if k not in known})
    except TypeError as error:  # fields missing
        raise DamagedFile(f"{run_dir / RUN_FILE} is not a run's record ({first_line(error)}); {WHAT_TO_DO}.") \
            from None


@contextlib.contextmanager
def _updating(run_dir: Path):
    """Read-modify-write of run.json under an exclusive lock: the app (start, stop), the supervisor (exit) and the
    reaper each change a few fields, and none of them may undo another's change."""
    with (run_dir / LOCK_FILE).open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            run = _read(run_dir)
            yield run
            _write(run_dir, run)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


# Secrets of the app's own process that no process it starts may see (a run, its supervisor and reaper, the form's
# validation): Hub tokens (only the app's own push uses one) and the app's password. huggingface_hub is also told
# not to pick up a stored login by itself.
SECRETS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HUGGINGFACE_HUB_TOKEN", "HF_API_TOKEN", "HF_DILOCO_APP_AUTH")


def training_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of every process the app starts (a run and its supervisor, the reaper of a stopped run, the
    form's validation): the app's, less its secrets, so a check sees what the run will see."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in SECRETS}
    return {**env, "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1", "PYTHONUNBUFFERED": "1"}


def _alive(pid: int | None, marker: str) -> bool:
    """True if `pid` runs and its command line contains `marker` (a recycled pid does not count)."""
    if not pid:
        return False
    try:
        process = psutil.Process(pid)
        cmdline, state = " ".join(process.cmdline()), process.status()
    except (psutil.Error, OSError):
        return False
    # An empty command line is a process in the middle of exec (just started): alive, marker not yet readable.
    return (marker in cmdline or not cmdline) and state != psutil.STATUS_ZOMBIE


def load(run_dir: Path) -> Run:
    """A run with its real status: an active run whose supervisor is gone has failed; a run whose run.json cannot be
    read has failed too, its reason the sentence naming the file (nothing is started, stopped or written)."""
    try:
        run = _read(run_dir)
    except DamagedFile as error:
        output_dir = str(run_dir / OUTPUT_DIR)
        return Run(run_dir.name, "", "", [], [], output_dir, status="failed", name=run_dir.name, reason=str(error),
                   created=_mtime(run_dir / RUN_FILE))
    if run.status in ACTIVE and not _alive(run.supervisor_pid, "hf_diloco.launch"):
        run.status = "failed"
        run.ended = run.ended or time.time()
        run.reason = run.reason or "its supervisor process is gone (the machine restarted or it was killed)."
    return run


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def list_runs(runs_dir: Path) -> list[Run]:
    """Every run under `runs_dir`, newest first: those the app started (a run.json) and every other folder a run
    of hf-diloco wrote (`found_run`)."""
    if not runs_dir.is_dir():
        return []
    runs = [run for p in runs_dir.iterdir() if p.is_dir() and (run := load_folder(p)) is not None]
    return sorted(runs, key=lambda r: r.created, reverse=True)


def load_folder(folder: Path) -> Run | None:
    """The run in `folder`: one the app started (`load`), one found there (`found_run`), or None."""
    return load(folder) if (folder / RUN_FILE).exists() else found_run(folder)


def found_run(folder: Path) -> Run | None:
    """A run that `folder` holds without a run.json (started by `hf-diloco train`, `launch`, `slurm` or `demo`, or by
    a DiLoCoTrainer in a script), with what its files say: its name is the folder's, its clock runs from its first
    file to its newest, and its status is read as a pushed card reads it (`run_outcome`: finished, stopped, or not
    finished), a run that has not finished being `running` while its files still change (GROWING_SECONDS) and
    `failed` when its launch says every replica ended in an error (a torchft launch's replicas.json). None when no
    run of hf-diloco wrote the folder."""
    written = [path for base in [folder, *replica_folders(folder)] for path in (base / name for name in RUN_MARKERS)
               if path.is_file()]
    if not written:
        return None
    first, newest = min(map(_mtime, written)), max(map(_mtime, written))
    try:
        status = run_outcome(folder)["ended"]
        replicas = read_json(folder / REPLICAS_FILE, [], list)
    except DamagedFile as error:  # shown as the reason it cannot be read, as a damaged run.json is
        return Run(folder.name, "", "", [], [], str(folder), status="failed", created=first, ended=newest,
                   name=folder.name, reason=str(error), found=True)
    if status == "finished" and not any(p.name in (SUMMARY_FILE, PROGRESS_FILE) for p in written):
        # no progress.json (a DiLoCoTrainer of one's own script) and no summary yet: not known to have finished
        status = "unfinished"
    if status == "unfinished" and time.time() - newest < GROWING_SECONDS:
        status = "running"
    elif status == "unfinished" and replicas and all(r.get("exit_code") not in (None, 0) for r in replicas):
        status = "failed"
    return Run(folder.name, "", "", [], [], str(folder), status=status, created=first,
               ended=None if status == "running" else newest, name=folder.name, found=True)


def run_outcome(folder: str | Path) -> dict:
    """How the run whose model is in `folder` ended: {"ended": "finished" | "stopped" | "failed" | "unfinished",
    "step", "max_steps", "checkpoint"}. Read from the run's own files: `stopped.json` (a stop on request),
    `progress.json` (its last step and phase; a torchft launch's furthest replica) and, for a run started by the
    app, run.json's status. A folder with none of them (a model saved by a script of one's own) counts as
    finished."""
    folder = Path(folder)
    root = launch_folder(folder)
    stopped = read_json(root / STOPPED_FILE, {}) or read_json(folder / STOPPED_FILE, {})
    # A torchft launch ended where its furthest replica did: a replica that missed the last round is handed the
    # final model by a peer, so every replica folder holds the run's end.
    progress = max((read_json(f / PROGRESS_FILE, {}) for f in replica_folders(root) or [folder]),
                   key=lambda p: p.get("step") or 0)
    started = read_json(root.parent / RUN_FILE, {})  # runs.start puts output/ inside the run's folder
    step, total = progress.get("step"), progress.get("max_steps")
    if started.get("status") == "failed":
        ended = "failed"
    elif stopped:
        ended, step = "stopped", stopped.get("step", step)
    elif progress and (progress.get("phase") != "finished" or (total and step is not None and step < total)):
        ended = "unfinished"
    else:
        ended = "finished"
    return {"ended": ended, "step": step, "max_steps": total, "checkpoint": stopped.get("checkpoint")}




def slug(name: str) -> str:
    """A folder-safe form of a run name: letters, digits, '.', '_' and '-'.

    >>> slug("tiny pretrain H=5 / lr 0.7")
    'tiny-pretrain-H-5-lr-0.7'
    """
    return re.sub(r"[^A-Za-z0-9._]+", "-", name).strip("-.") or "run"


def new_run_id(runs_dir: Path, name: str) -> str:
    """`name` as a folder name, with -2, -3, ... if taken."""
    base = slug(Path(name).stem if name.endswith(".yaml") else name)
    run_id, n = base, 1
    while (runs_dir / run_id).exists():
        n += 1
        run_id = f"{base}-{n}"
    return run_id


def plan(runs_dir: Path, recipe: str, accelerate_config: str, overrides: list[str], port: int | None = None,
         launch_args: list[str] | None = None, name: str = "", replicas: int | None = None,
         max_restarts: int = 0) -> Run:
    """The run that `start_planned` will start: its id, output folder and exact command (nothing is created).

    With `replicas`, an `outer_backend: torchft` run of that many replicas, each started again up to
    `max_restarts` times (`torchft_command`; its replicas meet through the Lighthouse, so `port` and `launch_args`
    do not apply); otherwise one `accelerate launch`.
    """
    run_id = new_run_id(runs_dir, name or recipe)
    output_dir = str((runs_dir / run_id / OUTPUT_DIR).resolve())
    fields = [*overrides, "--output_dir", output_dir]
    if replicas is not None:
        assert port is None and not launch_args, "a torchft run takes neither a rendezvous port nor launch flags"
        command = torchft_command(recipe, accelerate_config, replicas, fields, max_restarts)
    else:
        command = accelerate_command(recipe, accelerate_config, fields, port, launch_args)
    return Run(run_id, recipe, accelerate_config, list(overrides), command, output_dir, name=name or run_id)


def start_planned(run: Run) -> Run:
    """Create the run folder and start the run under its supervisor, detached in its own session."""
    run_dir = run.folder
    run_dir.mkdir(parents=True)
    run.created = time.time()  # the run's clock starts now, not when it was planned
    _write(run_dir, run)
    with _updating(run_dir) as current:  # held until the pid is recorded: the supervisor's end waits for it
        with (run_dir / LOG_FILE).open("ab") as log:  # the supervisor's own errors, if any, end up in the log
            supervisor = subprocess.Popen(
                [sys.executable, "-m", "hf_diloco.launch", "supervise", str(run_dir)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, env=training_env(),
            )
        current.supervisor_pid = supervisor.pid
        current.status = "running"
    return _read(run_dir)


def start(runs_dir: Path, recipe: str, accelerate_config: str, overrides: list[str], port: int | None = None,
          launch_args: list[str] | None = None, name: str = "", replicas: int | None = None) -> Run:
    """Plan and start a run."""
    runs_dir.mkdir(parents=True, exist_ok=True)
    return start_planned(plan(runs_dir, recipe, accelerate_config, overrides, port, launch_args, name, replicas))


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (torch's launcher puts its workers in sessions of their own, so a process group
    would miss them)."""
    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def training_pids(run: Run) -> list[int]:
    """The run's training processes on this machine (one per local replica), not its launcher."""
    if not run.supervisor_pid:
        return []
    return [pid for pid in _descendants(run.supervisor_pid)
            if _alive(pid, "hf_diloco.cli train") and not _alive(pid, LAUNCHER)]


def stop(run_dir: Path, grace_seconds: float = 600.0) -> Run:
    """Ask the run to stop at the end of its current round (checkpoint saved); kill it after `grace_seconds`."""
    run = load(run_dir)
    if run.status not in ACTIVE:
        return run
    Path(run.output_dir).mkdir(parents=True, exist_ok=True)
    # Read by the runs' StopOnRequest callback at every step, from before the first one. No signal is sent: a
    # process still importing would die of SIGUSR1 (`kill -USR1` works by hand once training runs).
    (Path(run.output_dir) / STOP_FILE).write_text(f"{time.time()}\n")
    with _updating(run_dir) as run:
        if run.status not in ACTIVE:  # it ended meanwhile: its own final status stands
            return run
        run.stop_requested = run.stop_requested or time.time()
        run.status = "stopping"
    subprocess.Popen(
        [sys.executable, "-m", "hf_diloco.launch", "reap", str(run_dir), str(grace_seconds)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        env=training_env(),
    )
    return run


def failure_reason(log_file: Path) -> str:
    """The run's own one-sentence reason: the CLI's last error line, else the last exception line of the log."""
    try:
        with log_file.open("rb") as f:
            f.seek(max(0, log_file.stat().st_size - 200_000))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    errors = [line.split(ERROR_PREFIX, 1)[1].strip() for line in lines if ERROR_PREFIX in line]
    if errors:
        return errors[-1]
    exceptions = [m for line in lines if (m := EXCEPTION_LINE.match(line.strip()))
                  and m.group(1) != "CalledProcessError"]  # the launcher's own "a process failed" line
    return f"{exceptions[-1].group(1)}: {exceptions[-1].group(2)}" if exceptions else ""
