"""Round checkpoints: when a `checkpoint-<step>` folder is complete, which one to resume from, and which to keep.

Trainer names and writes checkpoints as it always does (`checkpoint-<step>`); a folder under that name may
therefore be half written, by a process killed while saving. This module is what tells the two apart.

Design choices:
- A checkpoint is complete when its marker, `diloco_complete.json`, is there and every file the marker lists is
  there with the size it lists. The process that saves for a filesystem (`should_save`) writes the marker last,
  after every process has said through the rendezvous store that its part is written; it waits for that in a
  background thread (`Marking`), so a replica that saved before the others trains on instead of waiting for the
  slowest to write. Listing the files makes a
  deletion that is not ours (Trainer's own clean-up at the end of training with `save_total_limit: 1`, an `rm -r`
  stopped midway) read as incomplete too, whatever order the files went in.
- Folders written by earlier versions have no marker; they were complete by construction (those versions wrote
  under `tmp-checkpoint-<step>` and renamed when done), and plain Trainer's (the `trainer: ddp` baseline) write
  `trainer_state.json` last. Such a folder counts as complete when it holds `trainer_state.json` and every
  `replica-<rank>/` in it (the name earlier versions gave a process's part) holds its `complete` part marker.
  So that a folder this version is still writing never passes that test, the saving process writes a note,
  `diloco_saving`, first, before any process writes into the folder, and removes it after the marker.
- Removal is atomic: a folder leaves the `checkpoint-*` names in one rename (to `tmp-checkpoint-removed-<name>`),
  then its files are deleted. Nothing named `tmp-checkpoint-*` is a checkpoint; resume deletes such folders.
- Every file the marker lists carries its CRC-32 too. Resuming from the newest checkpoint (`auto`, `latest`)
  first reads it back (`damage`): a file whose bytes changed at the same size (a disk, a copy gone wrong) makes the
  checkpoint unusable, and the resume falls back to the newest one before it that reads back whole, saying so in
  one line; the damaged folder stays where it is (until the resumed run saves that step again). Each process
  reads the same files and comes to the same answer on its own.
- Rotation (`save_total_limit`) keeps the newest `limit` complete checkpoints and the best one; folders that are not
  complete are left to resume, which removes them with a notice.
- Standard library only: the checks that run before anything is built (hf_diloco.train.resolve_checkpoint, also
  run by `hf-diloco launch`) need nothing heavier.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

CHECKPOINT_PREFIX = "checkpoint-"  # Trainer's PREFIX_CHECKPOINT_DIR plus its "-"
MARKER_FILE = "diloco_complete.json"  # written last: the checkpoint is complete
SAVING_FILE = "diloco_saving"  # written first: this version is writing the folder (no earlier-version test applies)
TEMPORARY_PREFIX = "tmp-checkpoint-"  # not a checkpoint: one being removed, or an earlier version's unfinished save
# One process's part: its inner optimizer, scheduler and DiLoCo state, by global process rank ("replica-<id>" names
# a torchft replica's own output folder; earlier versions named these parts "replica-<rank>", still read).
PART_DIR = "process-{rank}"
OUTER_STATE_FILE = "diloco_outer.pt"  # θ_global and the outer optimizer: one copy (sharded: one per shard)
REPLICA_STATE_FILE = "diloco_replica.pt"  # what only one replica knows (SyncEngine.state_dict), in each process's part
EARLIER_PART_DIR = "replica-{rank}"
PART_COMPLETE_FILE = "complete"  # in process-<rank>/: this process's part of the checkpoint is written
TRAINER_STATE_FILE = "trainer_state.json"  # Trainer's TRAINER_STATE_NAME


def step_of(folder: Path) -> int | None:
    """The step of a `checkpoint-<step>` folder name, or None for any other name.

    >>> step_of(Path("run/checkpoint-120")), step_of(Path("run/tmp-checkpoint-removed-checkpoint-10"))
    (120, None)
    """
    digits = folder.name.removeprefix(CHECKPOINT_PREFIX)
    return int(digits) if folder.name.startswith(CHECKPOINT_PREFIX) and digits.isdigit() else None


def begin(folder: Path) -> None:
    """Before any process writes `folder` (the saving process, then a barrier): clear it and leave the note.

    A folder of the same name is an earlier attempt's (a run resumed from an older checkpoint, or one killed while
    saving this step); writing over it would mix two saves under an old marker, so it is removed first.
    """
    if folder.exists():
        remove(folder)
    folder.mkdir(parents=True)
    (folder / SAVING_FILE).touch()


def finish_part(replica_dir: Path) -> None:
    """This process's part of the checkpoint (its `process-<rank>/`) is written."""
    replica_dir.mkdir(parents=True, exist_ok=True)
    (replica_dir / PART_COMPLETE_FILE).touch()


def mark_complete(folder: Path, step: int, processes: int) -> None:
    """Write the marker (once every process's part is written), listing every file and its size; then drop the
    note. A marker cut short by a kill does not parse, so the folder still reads as incomplete. Every listed file
    and folder is flushed to disk (fsync) before the marker is written, and the marker after: after a power loss a
    file the kernel had not written yet can come back zero-filled at its full size, which the size check alone
    would take for complete."""
    listed = [p for p in sorted(folder.rglob("*"))
              if p.is_file() and p.relative_to(folder).as_posix() not in (SAVING_FILE, MARKER_FILE)]
    for path in [*listed, *sorted(p for p in folder.rglob("*") if p.is_dir()), folder]:
        _flush(path)
    files = {p.relative_to(folder).as_posix(): p.stat().st_size for p in listed}
    marker = {"step": step, "processes": processes, "files": files,
              "crc32": {p.relative_to(folder).as_posix(): _crc32(p) for p in listed}}
    (folder / MARKER_FILE).write_text(json.dumps(marker, indent=1) + "\n")
    _flush(folder / MARKER_FILE)
    (folder / SAVING_FILE).unlink(missing_ok=True)
    _flush(folder)


class Marking:
    """The marker of the newest checkpoint this process saved for its filesystem, written in a background thread
    once `written()` says every process's part is there (then the checkpoint is rotated), so that the replica that
    saves trains on meanwhile. One at a time and in order: the next save and the end of training `join` the one
    before. A part that never comes (a process that died) leaves the folder without its marker, incomplete, as a
    kill while saving does."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None

    def start(self, folder: Path, step: int, processes: int, written: Callable[[], bool],
              then: Callable[[], object]) -> None:
        self.join()

        def mark() -> None:
            if written():
                mark_complete(folder, step, processes)
                then()
            else:
                print(f"[diloco] {folder.name} stays incomplete: not every process wrote its part in time",
                      flush=True)

        self._thread = threading.Thread(target=mark, name=f"diloco-mark-{folder.name}", daemon=True)
        self._thread.start()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def _crc32(path: Path) -> int:
    import zlib

    value = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 24):
            value = zlib.crc32(chunk, value)
    return value


def damage(folder: Path) -> str | None:
    """Why a complete checkpoint cannot be resumed from, or None: a listed file whose CRC-32 is not the one its
    marker holds (checkpoints written before markers held one: sizes only, as `is_complete` checks)."""
    try:
        sums = json.loads((folder / MARKER_FILE).read_text()).get("crc32", {})
        for name, expected in sums.items():
            if _crc32(folder / name) != expected:
                return f"{name} does not hold the bytes that were saved"
    except (OSError, ValueError, AttributeError) as error:
        return f"its files cannot be read back ({type(error).__name__})"
    return None


def _flush(path: Path) -> None:
    """fsync a file or a folder (a folder's entries: the names of the files in it)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def is_complete(folder: Path) -> bool:
    """Whether `folder` holds a whole checkpoint: its marker and every file the marker lists, at its size; or,
    without a marker, an earlier version's folder (no note, `trainer_state.json`, every replica part marked)."""
    marker = folder / MARKER_FILE
    if marker.is_file():
        try:
            files = json.loads(marker.read_text())["files"]
            return all((folder / name).stat().st_size == size for name, size in files.items())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return False
    if (folder / SAVING_FILE).exists() or not (folder / TRAINER_STATE_FILE).is_file():
        return False
    # Written before the marker existed: earlier versions renamed a checkpoint into place only once every part was
    # written, and plain Trainer writes trainer_state.json last; a folder without replica parts is plain Trainer's.
    return all((part / PART_COMPLETE_FILE).is_file() for part in folder.glob(EARLIER_PART_DIR.format(rank="*")))


def part_dir(checkpoint: str | Path, rank: int) -> Path:
    """Where process `rank` keeps its part of `checkpoint`: `process-<rank>/`, or `replica-<rank>/` in a checkpoint
    an earlier version wrote."""
    folder = Path(checkpoint) / PART_DIR.format(rank=rank)
    earlier = Path(checkpoint) / EARLIER_PART_DIR.format(rank=rank)
    return earlier if not folder.exists() and earlier.exists() else folder


def checkpoint_folders(run_dir: Path) -> list[Path]:
    """Every `checkpoint-<step>` folder in run_dir, complete or not, oldest step first."""
    found = [p for p in run_dir.glob(f"{CHECKPOINT_PREFIX}*") if p.is_dir() and step_of(p) is not None]
    return sorted(found, key=step_of)


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """The complete checkpoints in run_dir, oldest step first."""
    return [p for p in checkpoint_folders(run_dir) if is_complete(p)]


def newest_complete(run_dir: Path, report=None) -> Path | None:
    """The complete checkpoint with the highest step that reads back whole (`damage`): where a resume starts.
    `report`, if given, is told of each newer one passed over, in one line."""
    for folder in reversed(complete_checkpoints(run_dir)):
        wrong = damage(folder) if (folder / MARKER_FILE).is_file() else None
        if wrong is None:
            return folder
        if report is not None:
            report(f"[diloco] not resuming from {folder.name}: {wrong}")
    return None


def leftovers(run_dir: Path) -> list[Path]:
    """What processes that stopped while saving or removing a checkpoint left in run_dir: `checkpoint-<step>`
    folders that are not complete, and `tmp-checkpoint-*` folders. Only safe to remove when no process of the run
    is saving, that is before training starts."""
    incomplete = [p for p in checkpoint_folders(run_dir) if not is_complete(p)]
    return incomplete + sorted(p for p in run_dir.glob(f"{TEMPORARY_PREFIX}*") if p.is_dir())


def remove(folder: Path) -> None:
    """Delete a checkpoint so that no instant shows a `checkpoint-<step>` with files missing: it is first renamed
    out of the `checkpoint-*` names (one atomic rename, into the temporary names a resume clears away), then its
    files are removed. A folder already under a temporary name is deleted where it is."""
    if not folder.name.startswith(TEMPORARY_PREFIX):
        trash = folder.with_name(f"{TEMPORARY_PREFIX}removed-{folder.name}")
        folder.rename(trash)
        folder = trash
    shutil.rmtree(folder, ignore_errors=True)


def rotate(run_dir: Path, limit: int, best: str | None = None) -> list[Path]:
    """`save_total_limit`: remove every complete checkpoint but the newest `limit` and the best one; returns
    the folders removed. Incomplete folders are neither counted nor removed here (resume removes them)."""
    complete = complete_checkpoints(run_dir)
    best_name = Path(best).name if best else None
    removed = [p for p in complete[:-limit] if p.name != best_name] if limit > 0 else []
    for folder in removed:
        remove(folder)
    return removed


def save_diloco_state(checkpoint: str, part: Path, replica_state: dict, outer_state, *, sharded: bool,
                      first_replica: bool, should_save: bool) -> None:
    """A checkpoint's DiLoCo state beside Trainer's: this process's `replica_state` in its `part` folder, and
    θ_global with the outer optimizer (`outer_state()`, None before training) once: by the saving process in the
    checkpoint folder, or with sharded replicas by replica 0's member j, shard j beside its part (which member j of
    every replica reads on resume)."""
    import torch

    if replica_state:
        torch.save(replica_state, part / REPLICA_STATE_FILE)
    if outer_state is not None and sharded and first_replica:
        torch.save(outer_state(), part / OUTER_STATE_FILE)
    elif outer_state is not None and not sharded and should_save:
        torch.save(outer_state(), Path(checkpoint) / OUTER_STATE_FILE)


def load_diloco_state(checkpoint: str, part: Path, *, member: int, sharded: bool) -> tuple[dict | None, dict | None]:
    """(this replica's state, the outer state) a checkpoint holds, each None where it has none (a checkpoint of
    plain Trainer). Tensors only: nothing in a checkpoint is unpickled beyond them."""
    import torch

    replica_file = part / REPLICA_STATE_FILE
    outer_file = (part_dir(checkpoint, member) if sharded else Path(checkpoint)) / OUTER_STATE_FILE
    return (torch.load(replica_file, weights_only=True) if replica_file.exists() else None,
            torch.load(outer_file, weights_only=True) if outer_file.exists() else None)
