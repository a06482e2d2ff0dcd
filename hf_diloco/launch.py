"""Every process hf-diloco starts and watches, and every check that can run before they start, in one place.

    check_launch        what `hf-diloco launch` checks before starting anything (recipe, accelerate config and
                        flags, model, data, checkpoint to resume, output folder)
    Launch              one launch started and watched: its stderr passed on with tokens hidden, a worker's bad
                        input reported once (report_input_error) and never started again
    redact              a command as it may be printed or stored: Hub tokens read `***`
    run_with_restarts   one launch (`accelerate launch ...`), started again from the newest complete checkpoint
                        when it fails (`hf-diloco launch --max-restarts N`); a stop request passed on once
    ReplicaSupervisor   the N torchft replica launches of `hf-diloco launch --replicas N`, each started again
                        when it fails (it heals from the live ones): replica_commands, run_lighthouse,
                        supervise_replicas
    start_lighthouse    a torchft Lighthouse served in this process (`hf-diloco lighthouse`, `--replicas N`), and
    serve_until_stopped its loop until SIGTERM or SIGINT
    supervise_run       the app's detached supervisor of one run folder (`python -m hf_diloco.launch supervise`),
    reap_run            and its reaper after Stop (`python -m hf_diloco.launch reap`)
    exit_process        how a launched worker ends once its run is done
    free_port, wait_for what tests and benchmarks use to start and watch processes too

Design choices:
- Commands are argument lists, never a shell line. What is printed or stored of one goes through `redact`; the
  process run gets every argument as given.
- Bad input found inside a worker (exit status 2, as every hf-diloco command ends on bad input) cannot be fixed by
  starting it again: the launch ends with the worker's sentence, once, and exit status 2. The workers hand the
  sentence over in a file rather than each printing it, and the launcher's stderr after it (torchelastic's report
  of the failed processes, some forty lines of traceback) is dropped: the sentence says everything.
- A launch runs in a session of its own, so a signal sent to us is passed on exactly once (schedulers and Ctrl-C
  signal a whole process group; the launcher forwards its own copy to the workers).
- The restart loop is ours rather than accelerate's `--max_restarts`: with accelerate's default static rendezvous
  a restarted gloo group cannot connect (it reaches for the dead processes' addresses).
- This module imports neither torch, transformers nor a backend at import time (the app imports it to start runs);
  torchft is looked for through hf_diloco.checks and imported only to serve a Lighthouse.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path
from typing import Any

from .checks import require_torchft
from .errors import ConfigError
from .files import check_run_folder_free, hold_run_folder, read_json, write_json
from .hub import MODEL_PATTERNS
from .metrics import read_syncs, sync_number
from .recipes import HUB_TOKEN_ENV
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


# --- before anything starts -----------------------------------------------------------------------------------------


def check_launch(run, config, accelerate_config: str, processes: int | None = None, machines: int | None = None,
                 rank: int | None = None, dry_run: bool = False) -> dict:
    """Everything `hf-diloco launch` can check before it starts a process, once for all of them (either backend,
    any number of replicas): the accelerate config with the launch flags beside it (`processes`, `machines`,
    `rank`; None: the config's), what a dry run checks (the recipe's arguments and their combinations, H against
    max_steps among them; the model, built from its config on the meta device, with its LoRA targets; the dataset
    and its text column, from its first row: `train.check_inputs`), that no live run holds the output folder, the
    checkpoint to resume and (unless `dry_run`) that the output folder holds no other run. Returns the accelerate
    config's settings; raises ConfigError in the sentence a training process would end with."""
    from . import train as training

    values = training.check_accelerate_config(accelerate_config, config, processes=processes, machines=machines,
                                              rank=rank)
    if values["hf_diloco_layout"]["note"]:
        print(f"hf-diloco: warning: {values['hf_diloco_layout']['note']}", file=sys.stderr, flush=True)
    model = training.check_inputs(run, config)
    if values["hf_diloco_layout"]["sharded"]:
        from .parallel import check_shardable

        check_shardable(model)
    check_run_folder_free(config.output_dir)  # before resume's clean-up: a live run's save in progress is its own
    training.resolve_checkpoint(config)
    if not dry_run:
        training.check_output_dir(config)
    return values


def check_torchft_launch(accelerate_config: str, config, launch_args: list[str]) -> int:
    """outer_backend torchft starts one launch per replica: its accelerate config must start one replica's
    processes (replica_group_size), and accelerate's machine flags do not apply. Returns the processes of a
    replica."""
    from . import train as training

    if launch_args:
        raise ConfigError("outer_backend torchft replicas meet through the Lighthouse: accelerate's machine flags "
                          f"({' '.join(launch_args[::2])}) do not apply; leave them out.")
    values = training.check_accelerate_config(accelerate_config, config)
    processes = int(values.get("num_processes", 1) or 1)
    group = values["hf_diloco_layout"]["group"]  # replica_group_size, or the config's dp_shard_size × tp_size
    if processes != group:
        raise ConfigError(f"outer_backend torchft starts one launch per replica of replica_group_size="
                          f"{group} process(es), but {accelerate_config!r} starts {processes}; "
                          f"use accelerate_configs/torchft-replica.yaml (one process) or torchft-replica-2proc.yaml "
                          f"with replica_group_size 2.")
    return processes


# --- one launch ------------------------------------------------------------------------------------------------------

INPUT_ERROR = 2  # the exit status of bad input, a worker's (hf_diloco.cli) and a launch's
INPUT_ERROR_FILE = "HF_DILOCO_INPUT_ERROR_FILE"  # where a worker of a Launch hands over the sentence of its bad input
TOKEN_FLAGS = ("--hub_token", "--hub-token")
HUB_TOKEN = re.compile(r"(?<![A-Za-z0-9])hf_[A-Za-z0-9]{20,}")  # the shape of a Hugging Face access token
HIDDEN = "***"


def redact(command: list[str]) -> list[str]:
    """`command` as it may be printed or stored: the value of `--hub_token` (either spelling, `--hub_token=...` too)
    and anything shaped like a Hugging Face token (`hf_` then 20 or more letters and digits) read `***`.

    >>> redact(["train", "--hub_token", "secret", "--hub-token=x", "--note", "a-hf_abcdefghijklmnopqrstuv"])
    ['train', '--hub_token', '***', '--hub-token=***', '--note', 'a-***']
    """
    values = set(token_values(command))

    def hide(word: str) -> str:
        flag, equals, _ = word.partition("=")
        if word in values:
            return HIDDEN
        if equals and flag in TOKEN_FLAGS:
            return f"{flag}={HIDDEN}"
        return HUB_TOKEN.sub(HIDDEN, word)

    return [hide(word) for word in command]


def token_values(command: list[str]) -> list[str]:
    """The values `command` gives `--hub_token` (either spelling, `--hub_token=...` too)."""
    return [word if previous in TOKEN_FLAGS else word.partition("=")[2]
            for previous, word in pairwise(["", *command])
            if previous in TOKEN_FLAGS or ("=" in word and word.partition("=")[0] in TOKEN_FLAGS)]


def without_tokens(command: list[str]) -> tuple[list[str], str | None]:
    """`command` without its `--hub_token` flags (either spelling, `--hub_token=...` too), and the token they gave
    (the last), for a launch to hand its workers in their environment instead (recipes.HUB_TOKEN_ENV).

    >>> without_tokens(["train", "--hub_token", "a", "--x", "1", "--hub-token=b"])
    (['train', '--x', '1'], 'b')
    """
    kept, words = [], iter(command)
    for word in words:
        if word in TOKEN_FLAGS:
            next(words, None)  # its value
        elif not ("=" in word and word.partition("=")[0] in TOKEN_FLAGS):
            kept.append(word)
    values = token_values(command)
    return kept, (values[-1] if values else None)


def shown(command: list[str]) -> str:
    """The line that shows `command` (redacted)."""
    return " ".join(redact(command))


def report_input_error(sentence: str) -> bool:
    """In a worker of a `Launch`: hand the sentence of the bad input it ends on to its launcher, which prints it
    once for all the workers; False anywhere else (the caller prints it)."""
    path = os.environ.get(INPUT_ERROR_FILE)
    if not path:
        return False
    try:
        with open(path, "a") as report:  # one short append per worker: whole lines, whatever the order
            report.write(" ".join(sentence.split()) + "\n")
    except OSError:
        return False
    return True


class Launch:
    """One launch hf-diloco starts and watches (an `accelerate launch ...`, a torchft replica's), used like the
    `subprocess.Popen` it holds.

    Its stderr (the launcher's and every worker's) is passed on to this process's, line by line, with the Hub
    token of its command hidden (`redact`; tokens a worker prints, say in a traceback, too). A worker that ends on
    bad input hands its sentence over (`report_input_error`) instead of printing it: `input_error` is then that
    sentence, `poll` and `wait` return INPUT_ERROR (2) whatever status the launcher ended with, and what the launch
    writes to stderr after it (torchelastic's report of the failure, the other workers being stopped) is dropped,
    so the sentence is said once, by whoever started the launch. (Its stderr is a pipe to this process: were this
    process killed outright, the launch's next write to stderr would fail.)"""

    def __init__(self, command: list[str], env: dict[str, str] | None = None, new_session: bool = False):
        handle, self._report = tempfile.mkstemp(prefix="hf-diloco-input-error-")
        os.close(handle)
        self.input_error: str | None = None
        # In the stream, a value short enough to be ordinary text is left alone (a real token has the token's shape).
        self._secrets = {value.encode() for value in token_values(command) if len(value) >= 8}
        # The token goes to the workers in their environment, never on a command line any user can read (`ps`).
        command, token = without_tokens(command)
        environment = {**(os.environ if env is None else env), INPUT_ERROR_FILE: self._report}
        if token is not None:
            environment[HUB_TOKEN_ENV] = token
        self.process = subprocess.Popen(command, env=environment, stderr=subprocess.PIPE,
                                        start_new_session=new_session)
        self.pid = self.process.pid
        self.new_session = new_session
        self._copier = threading.Thread(target=self._pass_stderr_on, daemon=True)
        self._copier.start()

    def end_leftovers(self) -> None:
        """Once the launch has ended, SIGKILL whatever is left in its session (started with `new_session`): a
        training process whose launcher was killed outright trains on, and a restart beside it would make two of
        one replica."""
        if self.new_session:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)

    def _reported(self) -> str | None:
        """The first whole sentence a worker handed over, once there is one."""
        if self.input_error is None:
            with contextlib.suppress(OSError):
                with open(self._report) as report:
                    first = report.readline()
                if first.endswith("\n"):
                    self.input_error = first.strip()
        return self.input_error

    def _pass_stderr_on(self) -> None:
        pending = b""
        with self.process.stderr as stream:
            for chunk in iter(lambda: stream.read1(1 << 16), b""):
                *lines, pending = re.split(rb"(?<=[\r\n])", pending + chunk)  # a progress bar's line ends in \r
                self._write(b"".join(lines))
        self._write(pending)

    def _write(self, data: bytes) -> None:
        if not data or self._reported():
            return
        for secret in self._secrets:
            data = data.replace(secret, HIDDEN.encode())
        data = HUB_TOKEN.sub(HIDDEN, data.decode("utf-8", "surrogateescape")).encode("utf-8", "surrogateescape")
        out = sys.__stderr__.buffer
        out.write(data)
        out.flush()

    def _status(self, code: int | None) -> int | None:
        if code is None:
            return None
        self._copier.join(timeout=10)  # the rest of its stderr (a process left behind may hold it open)
        if code != 0 and self._reported():
            code = INPUT_ERROR
        with contextlib.suppress(OSError):
            os.unlink(self._report)
        return code

    def poll(self) -> int | None:
        return self._status(self.process.poll())

    def wait(self) -> int:
        return self._status(self.process.wait())

    def send_signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def kill(self) -> None:
        self.process.kill()


def run_with_restarts(command: list[str], max_restarts: int, resume: bool = True,
                      output_dir: str | None = None, env: dict[str, str] | None = None) -> int:
    """Run the launch; when it fails, start it again (up to `max_restarts` times) resuming from the newest complete
    checkpoint. A run that was asked to stop (SIGTERM/SIGINT to this process) is not restarted, and exits 0 when
    it did stop (its `<output_dir>/stopped.json` is from this launch), whatever status the launcher ends with;
    once such a launch has ended, this process ignores SIGTERM/SIGINT (repeats of the same request) until it exits.
    A launch whose worker ended on bad input is not started again: ConfigError with the worker's sentence (see
    `Launch`).

    The launch runs in a session of its own, and SIGTERM/SIGINT sent to this process (or its process group, as
    Ctrl-C does) is passed on to it: the launcher hands it to every training process, which finish their round
    and save (given `TORCH_ELASTIC_SHUTDOWN_TIMEOUT`, default here 900 s, before the launcher kills).
    `env` is added to this process's environment for the launch.
    """
    stopping: list[int] = []
    child: list[Launch] = []

    def pass_stop_on(signum, _frame) -> None:
        stopping.append(signum)
        if child and child[-1].poll() is None:
            child[-1].send_signal(signum)

    env = {**os.environ, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
                                                                         STOP_GRACE_SECONDS), **(env or {})}
    started = time.time()
    previous = {signum: signal.signal(signum, pass_stop_on) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        for attempt in range(max_restarts + 1):
            child.append(Launch(command, env=env, new_session=True))
            code = child[-1].wait()  # retried through the signals passed on meanwhile (PEP 475)
            if child[-1].input_error:  # starting it again cannot fix its input
                raise ConfigError(child[-1].input_error)
            if stopping and code != 0 and output_dir and _stopped_since(output_dir, started):
                print("[diloco] stopped on request with a checkpoint", flush=True)
                return 0
            if code == 0 or stopping or attempt == max_restarts:
                return code
            child[-1].end_leftovers()
            print(f"[diloco] the run failed (exit status {code}); restart {attempt + 1} of {max_restarts}, resuming "
                  f"from the newest complete checkpoint", flush=True)
            if resume and command[-2:] != ["--resume_from_checkpoint", "auto"]:
                command = [*command, "--resume_from_checkpoint", "auto"]  # the last occurrence of a flag wins
        return code
    finally:
        for signum, handler in previous.items():
            # After a stop, a repeat of the request may still be on its way (a scheduler signals the job's processes
            # and their launcher): it is the same request, not a reason to end with a signal's status.
            signal.signal(signum, signal.SIG_IGN if stopping else handler)


def _stopped_since(output_dir: str, since: float) -> bool:
    """Whether the run wrote its stopped.json since `since` (a damaged one is not a stop: the run failed)."""
    try:
        return read_json(Path(output_dir) / STOPPED_FILE, {}).get("time", 0) >= since
    except (ConfigError, TypeError):
        return False


# --- the torchft Lighthouse ------------------------------------------------------------------------------------------


def start_lighthouse(bind: str, min_replicas: int, grace_seconds: float, heartbeat_timeout_seconds: float = 5.0):
    """torchft's Lighthouse, serving in this process until `.shutdown()`; its address is `.address()`."""
    require_torchft()
    from torchft._torchft import LighthouseServer

    return LighthouseServer(bind=bind, min_replicas=min_replicas, join_timeout_ms=int(grace_seconds * 1000),
                            quorum_tick_ms=50, heartbeat_timeout_ms=int(heartbeat_timeout_seconds * 1000))


def serve_until_stopped(server) -> None:
    """Keep `server` (a Lighthouse) serving until this process gets SIGTERM or SIGINT, then shut it down."""
    stopped = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopped.set())
    stopped.wait()
    server.shutdown()


@contextlib.contextmanager
def run_lighthouse(config, dry_run: bool = False):
    """The Lighthouse address the replicas of `hf-diloco launch --replicas N` meet at, and whether this process
    serves it: the recipe's `lighthouse` when it names one, else one started here on loopback (shut down on leaving;
    a dry run starts none and yields a placeholder)."""
    if config.lighthouse:
        yield config.lighthouse, False
        return
    if dry_run:
        yield "http://127.0.0.1:<port of the Lighthouse this command starts>", False
        return
    server = start_lighthouse("127.0.0.1:0", config.min_replicas, config.sync_grace_seconds)
    try:
        yield f"http://127.0.0.1:{server.address().rsplit(':', 1)[1]}", True
    finally:
        server.shutdown()


# --- torchft replicas ------------------------------------------------------------------------------------------------


def replica_folder(output_dir: str | os.PathLike, replica: int) -> str:
    """Where replica `replica` of a run started by `hf-diloco launch --replicas N` writes."""
    return os.path.join(str(output_dir), f"replica-{replica}")


def replica_overrides(overrides: list[str], replica: int, replicas: int, lighthouse: str, output_dir: str,
                      on_this_machine: bool = False) -> list[str]:
    """The recipe overrides of one replica (later flags win, so these come last). `on_this_machine`: the run's
    Lighthouse and every replica are here, so each replica's healing server listens on loopback only."""
    local = ["--replica_address", "127.0.0.1"] if on_this_machine else []
    return [*overrides, "--outer_backend", "torchft", "--replica_id", str(replica), "--num_replicas", str(replicas),
            "--lighthouse", lighthouse, "--output_dir", replica_folder(output_dir, replica), *local]


def replica_commands(recipe: str, accelerate_config: str, overrides: list[str], config, replicas: int,
                     processes: int, lighthouse: str, port: int | None = None) -> list[list[str]]:
    """The `accelerate launch` command of each of `replicas` torchft replicas on this machine, meeting at
    `lighthouse`. Replicas of several processes each rendezvous on a port of their own (`port` + r, or free ones)."""
    from .runs import accelerate_command

    ports = [None] * replicas if processes == 1 else [port + r if port else free_port() for r in range(replicas)]
    return [accelerate_command(recipe, accelerate_config,
                               replica_overrides(overrides, r, replicas, lighthouse, config.output_dir,
                                                 on_this_machine=not config.lighthouse),
                               ports[r])
            for r in range(replicas)]


def supervise_replicas(commands: list[list[str]], config, max_restarts: int) -> int:
    """Run the replica launches under a ReplicaSupervisor until the run ends; its exit status."""
    # A replica started again near the end may outlive the others by the time it needs to heal and see the end.
    linger = config.end_linger_seconds + config.sync_grace_seconds + 15
    with hold_run_folder(config.output_dir):  # each replica's process 0 holds its own replica-<r>/ besides
        return ReplicaSupervisor(commands, config.output_dir, max_restarts, linger_seconds=linger).run()


class ReplicaSupervisor:
    """Runs N replica launches on this machine, starting a replica that failed again (it heals from the live
    ones) up to `max_restarts` times each; hands a stop request in `output_dir` to every replica and reports the
    stop back where one-folder runs report it.

    What each replica's launch is doing goes to `<output_dir>/replicas.json` whenever it changes (the app shows it):
    per replica its `state` ("running"; "rejoining" once started again, until `records_at_restart` is passed by its
    sync log; "finished"; "exited" with no restart left; "ended" when started again too late), `restarts`,
    `exit_code` and its `outages` (`after_sync`: the newest sync it took part in before it went down, and whether it
    was started again), and `final_model_from` when it did not save the final model itself.

    The run succeeds (exit 0) when any replica finished it: a replica exits 0 only after the run's last round
    committed (or after a stop), and a replica that died for good does not undo what the others committed; every
    replica folder then holds the final model (copied from a finished replica into the folders of those that did not
    save it). The closing line names every replica's exit. A replica whose worker ended on bad input is not started
    again (`Launch`); when no replica finished, the run ends with that sentence (ConfigError) instead of the closing
    line."""

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

    def _outage(self, replica: int, restarted: bool) -> dict:
        """A replica went down: after the newest sync it took part in (read from its own sync log, not the run's
        newest: the others go on syncing while its launcher notices the death), and whether it is being started
        again."""
        records = read_syncs(replica_folder(self.output_dir, replica))
        syncs = [sync_number(r) for r in records if any(  # took part, or was there and left out by a check
            m.get("replica") == replica and (m.get("participated") or m.get("excluded"))
            for m in r.get("replicas", []))]
        return {"after_sync": max(syncs, default=0), "restarted": restarted}

    def _note(self, replica: int, **changes) -> None:
        """Record a replica's new state in replicas.json (atomically: the app reads it while it changes)."""
        self.states[replica].update(changes)
        write_json(self.output_dir / REPLICAS_FILE, self.states, indent=1)

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
                processes[r].end_leftovers()
                codes[r] = 0
                self._note(r, state="ended", exit_code=0)
                print(f"[diloco] replica {r} was started again too late to rejoin: the run had finished; ended it",
                      flush=True)

    def run(self) -> int:
        def note_stop(signum, _frame) -> None:  # passed on: each replica runs in a session of its own
            self.stopping = True
            for process in processes:
                if process.poll() is None:
                    process.send_signal(signum)

        previous = {s: signal.signal(s, note_stop) for s in (signal.SIGTERM, signal.SIGINT)}
        processes = [Launch(command, new_session=True) for command in self.commands]
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
                    if code != 0 and not self.stopping and not processes[r].input_error \
                            and self.restarts[r] < self.max_restarts:
                        self.restarts[r] += 1
                        print(f"[diloco] replica {r} exited with status {code}; starting it again (restart "
                              f"{self.restarts[r]} of {self.max_restarts}); it heals from a live replica", flush=True)
                        processes[r].end_leftovers()  # a launcher killed outright leaves its trainer running
                        processes[r] = Launch(self.commands[r], new_session=True)
                        self._note(r, state="rejoining", restarts=self.restarts[r], exit_code=code,
                                   records_at_restart=len(read_syncs(replica_folder(self.output_dir, r))),
                                   outages=[*self.states[r]["outages"], self._outage(r, restarted=True)])
                        continue
                    codes[r] = code
                    outages = self.states[r]["outages"] + ([self._outage(r, restarted=False)] if code else [])
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
        bad_input = next((process.input_error for process in processes if process.input_error), None)
        if bad_input and 0 not in codes:
            raise ConfigError(bad_input)
        if 0 in codes and not any(path.exists() for path in stopped):
            self._hand_over_final_model()
        print(self.ending(codes), flush=True)
        return 0 if 0 in codes else next(code for code in codes if code)

    def _hand_over_final_model(self) -> None:
        """Every replica ends with the run's final model: one that did not finish it (started again too late, or
        out of restarts) gets a copy of the final model a finished replica saved (every finished replica saved the
        same θ_global), said on the console and in replicas.json (`final_model_from`)."""
        def model_files(folder: Path) -> list[Path]:
            return [path for pattern in MODEL_PATTERNS for path in folder.glob(pattern) if path.is_file()]

        folders = [Path(replica_folder(self.output_dir, r)) for r in range(len(self.states))]
        finished = [r for r, state in enumerate(self.states) if state["state"] == "finished"
                    and any(p.suffix == ".safetensors" for p in model_files(folders[r]))]
        if not finished:
            return
        source = finished[0]
        for r, state in enumerate(self.states):
            if state["state"] == "finished" or any(p.suffix == ".safetensors" for p in model_files(folders[r])):
                continue
            folders[r].mkdir(parents=True, exist_ok=True)
            for path in model_files(folders[source]):
                shutil.copy2(path, folders[r] / path.name)
            if (folders[source] / "merged").is_dir():  # a LoRA run's merged model
                shutil.copytree(folders[source] / "merged", folders[r] / "merged", dirs_exist_ok=True)
            self._note(r, final_model_from=source)
            why = "was started again too late to rejoin" if state["state"] == "ended" else \
                f"exited with status {state['exit_code']} and had no restart left"
            print(f"[diloco] replica {r} {why}: it did not save the final model; copied replica {source}'s into "
                  f"{folders[r]}", flush=True)

    def ending(self, codes: list[int | None]) -> str:
        """One line on how the run ended: the last round and who took part in it, and how each replica exited."""
        rounds = [r for replica in range(len(codes)) for r in read_syncs(replica_folder(self.output_dir, replica))
                  if r.get("committed", True)]
        exits = ", ".join(f"replica {r} ended late" if self.states[r]["state"] == "ended" else
                          f"replica {r} exit {code}" for r, code in enumerate(codes))
        if not rounds:
            return f"[diloco] no round committed; {exits}"
        last = max(rounds, key=sync_number)
        took_part = [m["replica"] for m in last.get("replicas", []) if m.get("participated")]
        at = f"round {last['round']}" if sync_number(last) == last["round"] else \
            f"round {last['round']} (sync {sync_number(last)})"
        return (f"[diloco] the run ended at {at} (step {last['step']}), committed by replica(s) "
                f"{', '.join(map(str, took_part))}; {exits}")


def supervise_run(run_dir: Path) -> int:
    """The app's run supervisor (`python -m hf_diloco.launch supervise RUN_DIR`, detached): run the run's command,
    then record how it ended in its run.json."""
    signal.signal(STOP_SIGNAL, signal.SIG_IGN)  # the stop signal is for the trainers
    run = _read(run_dir)
    env = {**training_env(), "HF_DILOCO_STOP_SIGNAL": "1"}
    with (run_dir / LOG_FILE).open("ab") as log:
        log.write(("$ " + shown(run.command) + "\n").encode())
        log.flush()
        # Its stdout goes to the log; its stderr passes through this process's, which is the log too (runs.start).
        launched = Launch(run.command, env=env)
        code = launched.wait()
        if launched.input_error:  # a worker's bad input: its sentence once, as the CLI says it
            log.write(f"hf-diloco: error: {launched.input_error}\n".encode())
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
    try:
        wait_for(lambda: load(run_dir).status not in ACTIVE, grace_seconds, "the run to stop", every=1.0)
        return
    except TimeoutError:
        pass
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


# --- a launched worker's end ----------------------------------------------------------------------------------------

_groups_destroyed = False  # this process destroyed its process groups at its end (a launched worker)


def destroy_process_groups() -> None:
    """Destroy this process's torch.distributed process group, if it has one (a launched worker at its end): a gloo
    process that exits with its group alive can abort at interpreter shutdown, turning a finished run into a
    failure."""
    global _groups_destroyed
    if "torch" not in sys.modules:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        _groups_destroyed = True


def exit_process(code: int | None) -> None:
    """End the process with `code`. A process of a launch whose work is done (everything saved, its process groups
    destroyed) leaves without the interpreter's teardown: gloo and FSDP2 keep C++ threads whose destruction at
    interpreter exit can abort a process that finished its run (SIGABRT, "terminate called without an active
    exception"), and its launcher would then report a finished run as failed. Output is flushed first."""
    code = 0 if code is None else code
    if not _groups_destroyed:
        sys.exit(code)
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# --- helpers for whoever starts processes ---------------------------------------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (for a launch's rendezvous; another program could take it before it starts)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, every: float = 0.5) -> Any:
    """Ask `predicate` every `every` seconds until it returns something true, and return that; TimeoutError
    naming `what` once `timeout` seconds have passed.

    >>> wait_for(lambda: 42, 1, "an answer")
    42
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(min(every, max(0.0, deadline - time.monotonic())))


if __name__ == "__main__":
    action, folder = sys.argv[1], Path(sys.argv[2])
    if action == "supervise":
        sys.exit(supervise_run(folder))
    if action == "reap":
        reap_run(folder, float(sys.argv[3]))
