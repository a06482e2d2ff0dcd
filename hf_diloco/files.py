"""Reading and writing the files runs are made of: JSON in a run folder, YAML recipes and accelerate configs.

    read_json(path, default)    a JSON file of a run folder (run.json, progress.json, stopped.json, replicas.json,
                                run_config.json, diloco_summary.json, ...)
    write_json(path, value)     written whole: a temporary file renamed over the old one
    read_jsonl(path)            the records of a JSON-lines log (syncs.jsonl, trainer_log.jsonl): every whole
                                line; a damaged one is skipped with one warning naming it
    append_jsonl(path, value)   one record more, on a line of its own even after a writer killed mid-line
    replace_text(path, text)    a file rewritten whole, as write_json writes
    read_yaml(path, what)       a recipe or an accelerate config: a mapping of settings
    hold_run_folder(folder)     the lock one run holds on its output folder for its life (`check_run_folder_free`)

Design choices:
- One reader per format, so a damaged file reads the same wherever it is read: one sentence that names the file,
  what is wrong with it and what to do (DamagedFile, a ConfigError: the CLI prints it and exits 2, the app shows
  it). Nothing here deletes or rewrites a file it could not read.
- A missing file is not damage: the caller says what its absence means (`default`). An empty or malformed one is.
- Imports nothing heavy: the app reads runs through it.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from .errors import ConfigError, DamagedFile, first_line

logger = logging.getLogger(__name__)

REQUIRED = object()  # read_json's default: a missing file is an error (FileNotFoundError)
WHAT_TO_DO = "restore it from a copy, or move it out of the way to go on without it"


def read_json(path: str | os.PathLike, default: Any = REQUIRED, kind: type = dict) -> Any:
    """The `kind` (a JSON object unless told) held by the JSON file `path`; `default` when there is no such file.

    Raises DamagedFile, in one sentence naming the file, when it is empty, not valid JSON, or not a `kind`.

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> read_json(folder / "progress.json", {})
    {}
    >>> _ = (folder / "stopped.json").write_text("")
    >>> read_json(folder / "stopped.json", {})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    hf_diloco.errors.DamagedFile: .../stopped.json is empty; restore it from a copy, or move it out of the way to ...
    """
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        if default is REQUIRED:
            raise
        return default
    except (OSError, ValueError) as error:  # unreadable, or not text at all
        raise DamagedFile(f"{path} cannot be read ({first_line(error)}); {WHAT_TO_DO}.") from None
    if not text.strip():
        raise DamagedFile(f"{path} is empty; {WHAT_TO_DO}.")
    try:
        value = json.loads(text)
    except ValueError as error:
        raise DamagedFile(f"{path} is not valid JSON ({first_line(error)}); {WHAT_TO_DO}.") from None
    if not isinstance(value, kind):
        wanted = {dict: "a JSON object", list: "a JSON list"}.get(kind, kind.__name__)
        raise DamagedFile(f"{path} holds {type(value).__name__} {str(value)[:40]!r} instead of {wanted}; "
                          f"{WHAT_TO_DO}.")
    return value


def write_json(path: str | os.PathLike, value: Any, indent: int | None = 2) -> None:
    """Write `value` to `path` whole: readers (the app, a push) see the old file or the new one, never half of one."""
    replace_text(path, json.dumps(value, indent=indent) + "\n")


def replace_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` whole, through a temporary file renamed over the old one: a reader, or a process
    killed while writing, sees the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    temporary.replace(path)


_warned: set[tuple[str, int]] = set()  # (file, line) of damaged lines already reported by this process


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The records of the JSON-lines file `path`, in order ([] when there is none). A line that is not a JSON
    object is skipped, once reported per process in one warning naming the file and the line, and the lines after
    it are still read (a writer killed mid-line leaves a torn line, and the one restarted appends after it). A
    last line without its newline is being written: left out, silently.

    >>> import tempfile
    >>> path = Path(tempfile.mkdtemp()) / "log.jsonl"
    >>> _ = path.write_text('{"step": 1}\\n{"st\\n{"step": 3}\\n{"step": 4')
    >>> [r["step"] for r in read_jsonl(path)]   # line 2 torn by a kill, line 4 still being written
    [1, 3]
    """
    path = Path(path)
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return []
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict):
            records.append(record)
        elif number < len(lines) and (str(path), number) not in _warned:  # not the unfinished last line
            _warned.add((str(path), number))
            logger.warning("%s: line %d is damaged (not a JSON object); it is skipped and the lines after it are "
                           "read.", path, number)
    return records


def append_jsonl(path: str | os.PathLike, value: dict) -> None:
    """Append `value` to the JSON-lines file `path` as one line. A file whose last line has no newline (its writer
    was killed mid-line) gets one first, so the new record is not glued to the torn one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("ab") as f:
        if f.tell() > 0:
            with path.open("rb") as tail:
                tail.seek(-1, os.SEEK_END)
                torn = tail.read(1) != b"\n"
            if torn:
                f.write(b"\n")
        f.write((json.dumps(value) + "\n").encode())


def read_yaml(path: str | os.PathLike, what: str, holds: str = "field names to values") -> dict:
    """The mapping in the YAML file `path` ({} for an empty file), which is a `what` ("recipe", "accelerate
    config"); a ConfigError naming it when it does not exist, is not valid YAML, or is not a mapping of `holds`.
    Callers for whom an unreadable file means "no settings" catch ConfigError."""
    import yaml

    shown = f"{what} {str(path)!r}"
    try:
        values = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{shown} does not exist.") from None
    except (OSError, ValueError) as error:  # a folder, unreadable, or not text
        raise ConfigError(f"{shown} cannot be read ({first_line(error)}).") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{shown} is not valid YAML ({first_line(error)}).") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"{shown} must be a mapping of {holds}.")
    return values


LOCK_FILE = ".hf-diloco.lock"


def _lock(folder: Path):
    """(the open lock file, None) when this process now holds the folder's lock, else (None, who holds it)."""
    import fcntl

    folder.mkdir(parents=True, exist_ok=True)
    handle = open(folder / LOCK_FILE, "a+")  # noqa: SIM115 (held open for the run's life, or closed below)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        return None, holder
    return handle, None


def _in_use(folder: Path, holder: str) -> ConfigError:
    return ConfigError(f"output_dir {str(folder)!r} is in use by another run ({holder}); wait for it to end, stop "
                       f"it, or choose another output_dir.")


class hold_run_folder:  # noqa: N801 (a context manager, used as `with hold_run_folder(...)`)
    """One run per output folder: the process that writes a run's folder (process 0 of a launch, member 0 of a
    torchft replica) holds an exclusive lock on `<folder>/.hf-diloco.lock` for the run's life, which the system
    releases however the process ends. A second run into the folder is refused in one sentence (ConfigError) before
    it touches anything: no clean-up of a live run's checkpoint in progress, no second writer of its logs."""

    def __init__(self, folder: str | Path):
        import socket

        self.folder = Path(folder)
        self.handle, holder = _lock(self.folder)
        if self.handle is None:
            raise _in_use(self.folder, holder)
        self.handle.seek(0)
        self.handle.truncate()
        self.handle.write(f"process {os.getpid()} on {socket.gethostname()}\n")
        self.handle.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.handle.close()  # (the lock goes with it; the file stays, empty of meaning)


def check_run_folder_free(folder: str | Path) -> None:
    """ConfigError, naming who holds it, when a live run holds `folder` (checked by the launcher before any worker
    starts, and before resume's clean-up of a folder's incomplete checkpoints)."""
    if not Path(folder).is_dir():
        return
    handle, holder = _lock(Path(folder))
    if handle is None:
        raise _in_use(Path(folder), holder)
    handle.close()
