"""Every process hf-diloco starts and watches, in one place.

    run_with_restarts   one launch (`accelerate launch ...`), started again from the newest complete checkpoint
                        when it fails (`hf-diloco launch --max-restarts N`); a stop request passed on once
    ReplicaSupervisor   the N torchft replica launches of `hf-diloco launch --replicas N`, each started again
                        when it fails (it heals from the live ones)
    start_lighthouse    a torchft Lighthouse served in this process (`hf-diloco lighthouse`, `--replicas N`)
    supervise_run       the app's detached supervisor of one run folder (`python -m hf_diloco.launch supervise`),
    reap_run            and its reaper after Stop (`python -m hf_diloco.launch reap`)

Design choices:
- Commands are argument lists, never a shell line.
- A launch runs in a session of its own, so a signal sent to us is passed on exactly once (schedulers and Ctrl-C
  signal a whole process group; the launcher forwards its own copy to the workers).
- The restart loop is ours rather than accelerate's `--max_restarts`: with accelerate's default static rendezvous
  a restarted gloo group cannot connect (it reaches for the dead processes' addresses).
- This module imports neither torch nor transformers at import time (the app imports it to start runs).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from .metrics import read_sync_rounds, run_rounds
from .runs import (
    ACTIVE,
    LOG_FILE,
    REPLICAS_FILE,
    STOP_FILE,
    STOP_SIGNAL,
    STOPPED_FILE,
    _descendants,
    _read,
    _updating,
    failure_reason,
    load,
    training_env,
)

# How long accelerate's launcher (torchelastic) lets its processes finish a stop before it kills them; its own
# default, 30 s, is shorter than many rounds, and a killed stop saves nothing.
STOP_GRACE_SECONDS = "900"


def run_with_restarts(command: list[str], max_restarts: int, resume: bool = True,
                      output_dir: str | None = None) -> int:
    """Run the launch; when it fails, start it again (up to `max_restarts` times) resuming from the newest complete
    checkpoint. A run that was asked to stop (SIGTERM/SIGINT to this process) is not restarted, and exits 0 when
    it did stop (its `<output_dir>/stopped.json` is from this launch), whatever status the launcher ends with.

    The launch runs in a session of its own, and SIGTERM/SIGINT sent to this process (or its process group, as
    Ctrl-C does) is passed on to it exactly once: the launcher hands it to every training process, which finish
    their round and save (given `TORCH_ELASTIC_SHUTDOWN_TIMEOUT`, default here 900 s, before the launcher kills).
    """
    stopping: list[int] = []
    child: list[subprocess.Popen] = []

    def pass_stop_on(signum, _frame) -> None:
        stopping.append(signum)
        if child and child[-1].poll() is None:
            child[-1].send_signal(signum)

    env = {**os.environ, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
                                                                         STOP_GRACE_SECONDS)}
    started = time.time()
    previous = {signum: signal.signal(signum, pass_stop_on) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        for attempt in range(max_restarts + 1):
            child.append(subprocess.Popen(command, env=env, start_new_session=True))
            code = child[-1].wait()  # retried through the signals passed on meanwhile (PEP 475)
            if stopping and code != 0 and output_dir and _stopped_since(output_dir, started):
                print("[diloco] stopped on request with a checkpoint", flush=True)
                return 0
            if code == 0 or stopping or attempt == max_restarts:
                return code
            print(f"[diloco] the run failed (exit status {code}); restart {attempt + 1} of {max_restarts}, resuming "
                  f"from the newest complete checkpoint", flush=True)
            if resume and command[-2:] != ["--resume_from_checkpoint", "auto"]:
                command = [*command, "--resume_from_checkpoint", "auto"]  # the last occurrence of a flag wins
        return code
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _stopped_since(output_dir: str, since: float) -> bool:
    try:
        return json.loads((Path(output_dir) / STOPPED_FILE).read_text())["time"] >= since
    except (OSError, ValueError, KeyError, TypeError):
        return False


def start_lighthouse(bind: str, min_replicas: int, grace_seconds: float, heartbeat_timeout_seconds: float = 5.0):
    """torchft's Lighthouse, serving in this process until `.shutdown()`; its address is `.address()`."""
    from .torchft_backend import require_torchft

    require_torchft()
    from torchft._torchft import LighthouseServer

    return LighthouseServer(bind=bind, min_replicas=min_replicas, join_timeout_ms=int(grace_seconds * 1000),
                            quorum_tick_ms=50, heartbeat_timeout_ms=int(heartbeat_timeout_seconds * 1000))


class ReplicaSupervisor:
    """Runs N replica launches on this machine, starting a replica that failed again (it heals from the live
    ones) up to `max_restarts` times each; hands a stop request in `output_dir` to every replica and reports the
    stop back where one-folder runs report it.

    What each replica's launch is doing goes to `<output_dir>/replicas.json` whenever it changes (the app shows it):
    per replica its `state` ("running"; "rejoining" once started again, until `records_at_restart` is passed by its
    round log; "finished"; "exited" with no restart left; "ended" when started again too late), `restarts`,
    `exit_code` and its `outages` (after which round of the run it went down, and whether it was started again).

    The run succeeds (exit 0) when any replica finished it: a replica exits 0 only after the run's last round
    committed (or after a stop), and a replica that died for good does not undo what the others committed. The
    closing line names every replica's exit."""

    def __init__(self, commands: list[list[str]], output_dir: str, max_restarts: int, linger_seconds: float = 15.0):
        self.linger_seconds = linger_seconds  # how long a restarted replica may outlive the finished others
        self.commands = commands
        self.output_dir = Path(output_dir)
        self.max_restarts = max_restarts
        self.restarts = [0] * len(commands)
        self.stopping = False
        self.finished_at: float | None = None  # when the first replica completed the run
        self.states = [{"replica": r, "state": "running", "restarts": 0, "exit_code": None, "records_at_restart": 0,
                        "outages": []}
                       for r in range(len(commands))]

    def _outage(self, restarted: bool) -> dict:
        """A replica went down now: after the run's newest round, and whether it is being started again."""
        rounds = [r["round"] for r in run_rounds(self.output_dir) if r.get("committed", True)]
        return {"after_round": max(rounds, default=0), "restarted": restarted}

    def _note(self, replica: int, **changes) -> None:
        """Record a replica's new state in replicas.json (atomically: the app reads it while it changes)."""
        self.states[replica].update(changes)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        temporary = self.output_dir / (REPLICAS_FILE + ".tmp")
        temporary.write_text(json.dumps(self.states, indent=1) + "\n")
        temporary.replace(self.output_dir / REPLICAS_FILE)

    def _end_latecomers(self, processes, codes: list[int | None]) -> None:
        """A replica started again near the end finds no one left to form a round with: once every replica that
        never restarted has finished, the restarted ones get `linger_seconds` to finish too, then are ended (they
        hold nothing the finished replicas do not)."""
        if self.finished_at is None or time.monotonic() - self.finished_at < self.linger_seconds:
            return
        running = [r for r, code in enumerate(codes) if code is None]
        if running and all(self.restarts[r] > 0 for r in running):
            for r in running:
                processes[r].kill()
                processes[r].wait()
                codes[r] = 0
                self._note(r, state="ended", exit_code=0)
                print(f"[diloco] replica {r} was started again too late to rejoin: the run had finished; ended it",
                      flush=True)

    def run(self) -> int:
        def note_stop(signum, _frame) -> None:  # the replicas got it too when it came from the terminal
            self.stopping = True
            for process in processes:
                if process.poll() is None:
                    process.send_signal(signum)

        previous = {s: signal.signal(s, note_stop) for s in (signal.SIGTERM, signal.SIGINT)}
        processes = [subprocess.Popen(command) for command in self.commands]
        codes: list[int | None] = [None] * len(processes)
        self._note(0)
        try:
            while any(code is None for code in codes):
                time.sleep(0.5)
                request = self.output_dir / STOP_FILE
                if request.exists():
                    for r in range(len(processes)):
                        folder = Path(replica_folder(self.output_dir, r))
                        folder.mkdir(parents=True, exist_ok=True)
                        (folder / STOP_FILE).write_text(request.read_text())
                    request.unlink(missing_ok=True)
                    self.stopping = True
                self._end_latecomers(processes, codes)
                for r, process in enumerate(processes):
                    if codes[r] is not None or (code := process.poll()) is None:
                        continue
                    if code != 0 and not self.stopping and self.restarts[r] < self.max_restarts:
                        self.restarts[r] += 1
                        print(f"[diloco] replica {r} exited with status {code}; starting it again (restart "
                              f"{self.restarts[r]} of {self.max_restarts}); it heals from a live replica", flush=True)
                        processes[r] = subprocess.Popen(self.commands[r])
                        self._note(r, state="rejoining", restarts=self.restarts[r], exit_code=code,
                                   records_at_restart=len(read_sync_rounds(replica_folder(self.output_dir, r))),
                                   outages=[*self.states[r]["outages"], self._outage(restarted=True)])
                        continue
                    codes[r] = code
                    outages = self.states[r]["outages"] + ([self._outage(restarted=False)] if code else [])
                    self._note(r, state="finished" if code == 0 else "exited", exit_code=code, outages=outages)
                    if code == 0 and self.finished_at is None:
                        self.finished_at = time.monotonic()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        stopped = [Path(replica_folder(self.output_dir, r)) / STOPPED_FILE for r in range(len(processes))]
        if any(path.exists() for path in stopped):
            first = next(path for path in stopped if path.exists())
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / STOPPED_FILE).write_text(first.read_text())
        print(self.ending(codes), flush=True)
        return 0 if 0 in codes else next(code for code in codes if code)

    def ending(self, codes: list[int | None]) -> str:
        """One line on how the run ended: the last round and who took part in it, and how each replica exited."""
        rounds = [r for replica in range(len(codes)) for r in read_sync_rounds(replica_folder(self.output_dir, replica))
                  if r.get("committed", True)]
        exits = ", ".join(f"replica {r} exit {code}" for r, code in enumerate(codes))
        if not rounds:
            return f"[diloco] no round committed; {exits}"
        last = max(rounds, key=lambda r: r["round"])
        took_part = [m["replica"] for m in last.get("members", []) if m.get("participated")]
        return (f"[diloco] the run ended at round {last['round']} (step {last['step']}), committed by replica(s) "
                f"{', '.join(map(str, took_part))}; {exits}")


def supervise_run(run_dir: Path) -> int:
    """The app's run supervisor (`python -m hf_diloco.launch supervise RUN_DIR`, detached): run the run's command,
    then record how it ended in its run.json."""
    signal.signal(STOP_SIGNAL, signal.SIG_IGN)  # the stop signal is for the trainers
    run = _read(run_dir)
    env = {**training_env(), "HF_DILOCO_STOP_SIGNAL": "1"}
    with (run_dir / LOG_FILE).open("ab") as log:
        log.write(("$ " + " ".join(run.command) + "\n").encode())
        log.flush()
        code = subprocess.call(run.command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env)
    with _updating(run_dir) as run:  # the app may have asked to stop meanwhile: its fields are kept
        run.exit_code = code
        run.ended = time.time()
        stopped = (Path(run.output_dir) / STOPPED_FILE).exists()  # what the run did, not what was asked
        run.status = ("stopped" if stopped else "finished") if code == 0 else "failed"
        if code != 0:
            run.reason = failure_reason(run_dir / LOG_FILE) or f"the run exited with status {code}; see its log."
    return code


def reap_run(run_dir: Path, grace_seconds: float) -> None:
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
        with _updating(run_dir) as current:
            if current.status not in ACTIVE:  # its supervisor recorded the end first
                return
            current.status, current.ended = "failed", time.time()
            current.exit_code = current.exit_code if current.exit_code is not None else -signal.SIGKILL
            current.reason = f"it did not stop within {grace_seconds:.0f} s of Stop and was killed (no checkpoint)."


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (for a launch's rendezvous; another program could take it before it starts)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def replica_folder(output_dir: str | os.PathLike, replica: int) -> str:
    """Where replica `replica` of a run started by `hf-diloco launch --replicas N` writes."""
    return os.path.join(str(output_dir), f"replica-{replica}")


if __name__ == "__main__":
    action, folder = sys.argv[1], Path(sys.argv[2])
    if action == "supervise":
        sys.exit(supervise_run(folder))
    if action == "reap":
        reap_run(folder, float(sys.argv[3]))
