"""Per-sync metrics: `<output_dir>/syncs.jsonl`, the trackers of `report_to` (diloco/<name>), a console line.

One record per sync (one fragment's exchange and outer step; with F = 1 fragment a sync is a whole round), carrying
its `sync` number and the `round` it belongs to (see hf_diloco.schedule). Records written before the two had
separate names have only `round`, counting syncs: `sync_number` reads either.

Design choices:
- Only the main process writes. Every replica's numbers reach it inside the sync's collectives (see comm.py), so
  writing metrics adds no collective across replicas (a sharded replica's members add up their shards' norms with
  one small all-reduce inside the replica).
- A sync's record is written once the sync has landed: right after it, or after the evaluation that the trainer
  runs on that boundary, so `eval_loss` lands in the same record.
- The JSONL file is the interface of runs: the app and the benchmarks read it. The trackers get the same numbers
  through Trainer's own integrations (hf_diloco.engine reports them), so every `report_to` Trainer supports
  receives them and the project keeps no tracker code of its own. Floats are plain JSON numbers; NaN is written as null.
- On resume, records of syncs after the checkpoint are dropped first, since those steps are trained again.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from .files import append_jsonl, read_json, read_jsonl, replace_text, write_json

SYNCS_FILE = "syncs.jsonl"
# What runs of earlier versions wrote, and still read: the file was sync_rounds.jsonl, and a record's rows per replica
# were `members` (a name that now means the processes of one replica).
EARLIER_SYNCS_FILE = "sync_rounds.jsonl"
EARLIER_KEYS = {"members": "replicas"}
# Series keep their colour wherever they are drawn (the app's Live and Compare views, the model card's curve):
# replica i is always PALETTE[i], the held-out loss of the global model black.
PALETTE = ["#2563eb", "#ea580c", "#16a34a", "#9333ea", "#0891b2", "#ca8a04", "#db2777", "#4b5563"]
SERIES_COLORS = {"held-out (global model)": "#111827", "held-out loss": "#111827", "averaged Δ": "#111827",
                 "train loss (all processes)": "#2563eb", "train loss (mean of replicas)": "#2563eb",
                 "compute": "#2563eb", "sync": "#ea580c", "blocked": "#dc2626", "logged loss (process 0)": "#93c5fd",
                 "DDP for the same steps": "#dc2626", "DiLoCo (cumulative)": "#111827",
                 "DiLoCo (this sync)": "#6b7280"}
SUMMARY_FILE = "diloco_summary.json"

# The numbers of a sync that go to the trackers Trainer reports to (`report_to`), as diloco/<name> at its step.
REPORTED_KEYS = (
    "loss", "eval_loss", "pseudo_grad_norm", "bytes_per_replica", "sync_seconds", "compute_seconds", "outer_lr",
    "tokens_per_second", "cumulative_bytes_per_replica",
)


def reported_metrics(record: dict) -> dict[str, float]:
    """A sync record as tracker metrics: diloco/<name> for each finite number of REPORTED_KEYS, and
    diloco/replica_<r>/loss for each replica's loss."""
    metrics = {f"diloco/{key}": float(record[key]) for key in REPORTED_KEYS
               if isinstance(record.get(key), (int, float)) and math.isfinite(record[key])}
    for rank, loss in enumerate(record.get("replica_losses", [])):
        if isinstance(loss, (int, float)) and math.isfinite(loss):
            metrics[f"diloco/replica_{rank}/loss"] = float(loss)
    if isinstance(record.get("excluded"), list):  # contributions left out by a check
        metrics["diloco/excluded"] = float(len(record["excluded"]))
    return metrics


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def syncs_file(output_dir: str | os.PathLike) -> Path:
    """The run's syncs.jsonl, or the sync_rounds.jsonl a run of an earlier version wrote instead."""
    path = Path(output_dir) / SYNCS_FILE
    earlier = path.with_name(EARLIER_SYNCS_FILE)
    return earlier if not path.exists() and earlier.exists() else path


def read_syncs(output_dir: str | os.PathLike) -> list[dict]:
    """All sync records of a run, in order: every whole line (hf_diloco.files.read_jsonl: a half-written last line
    of a live run is left out, a line torn by a kill is skipped with a warning and the records after it read).
    Records an earlier version wrote are read under today's names (EARLIER_SYNCS_FILE, EARLIER_KEYS)."""
    return [{EARLIER_KEYS.get(key, key): value for key, value in record.items()}
            for record in read_jsonl(syncs_file(output_dir))]


REPLICA_PREFIX = "replica-"


def replica_folders(output_dir: str | os.PathLike) -> list[Path]:
    """The `replica-r` folders of a torchft launch's output folder (`hf-diloco launch --replicas N`), lowest replica
    id first; [] for a folder that holds its own syncs.jsonl (every other run)."""
    output = Path(output_dir)
    if syncs_file(output).exists():
        return []
    found = [p for p in output.glob(REPLICA_PREFIX + "*") if p.is_dir() and p.name[len(REPLICA_PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(REPLICA_PREFIX):]))


def launch_folder(folder: str | os.PathLike) -> Path:
    """The torchft launch's output folder when `folder` is one of its replica folders, else `folder` itself."""
    folder = Path(folder)
    if folder.name.startswith(REPLICA_PREFIX) and folder in replica_folders(folder.parent):
        return folder.parent
    return folder


def sync_number(record: dict) -> int:
    """A record's sync number: `sync`, or in records written before syncs and rounds had separate names, `round`
    (which counted syncs then).

    >>> sync_number({"sync": 5, "round": 3}), sync_number({"round": 4})
    (5, 4)
    """
    return record.get("sync", record["round"])


def run_syncs(output_dir: str | os.PathLike) -> list[dict]:
    """The sync records of a run folder: its syncs.jsonl, or for a torchft launch the union over its replica
    folders, one record per sync number (every participant of a sync writes the same membership): a committed
    record before one whose sync did not commit, then the lowest replica id's. The app and the model card both
    count from this."""
    folders = replica_folders(output_dir)
    if not folders:
        return read_syncs(output_dir)
    merged: dict[int, dict] = {}
    for folder in folders:
        for record in read_syncs(folder):
            kept = merged.get(sync_number(record))
            if kept is None or (not kept.get("committed", True) and record.get("committed", True)):
                merged[sync_number(record)] = record
    return [merged[n] for n in sorted(merged)]


def replica_losses(record: dict) -> list[tuple[int, float]]:
    """(replica id, mean inner loss) of each replica that trained before the sync (on torchft: its members)."""
    if "replicas" in record:
        return [(m["replica"], m["loss_sum"] / m["steps"]) for m in record["replicas"]
                if m.get("participated") and m.get("steps")]
    return list(enumerate(record.get("replica_losses", [])))


def outer_rounds(rounds: list[dict]) -> int:
    """Whole rounds among committed sync records: with streaming fragments a sync carries some fragments, and a
    round is over once every fragment has synced, so this is the fewest syncs of any fragment. (Counted from the
    fragments rather than read from `round`, so that records written before `round` meant a whole round count
    alike.)

    >>> outer_rounds([{"fragments": [0]}, {"fragments": [1]}, {"fragments": [0]}, {"fragments": [0, 1]}])
    2
    >>> outer_rounds([{"fragments": [0]}, {"fragments": [0], "committed": False}, {}])
    2
    """
    synced: dict[int, int] = {}
    for record in rounds:
        if record.get("committed", True) is False:
            continue
        for fragment in record.get("fragments") or [0]:
            synced[fragment] = synced.get(fragment, 0) + 1
    return min(synced.values()) if synced else 0


def format_bytes(n: float) -> str:
    """Bytes in decimal units, as the logs and the app show them.

    >>> format_bytes(3_500_000)
    '3.50 MB'
    >>> format_bytes(999)
    '999 B'
    """
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def format_sync(record: dict, total_syncs: int | None, num_fragments: int = 1) -> str:
    """One console line per sync: "round 3/12" where a sync is a round, else "sync 5/12 (round 3, fragment 0)"."""
    of = f"/{total_syncs}" if total_syncs else ""
    if num_fragments == 1:
        which = f"round {record['round']}{of}"
    else:
        synced = record.get("fragments") or []
        part = "every fragment" if len(synced) == num_fragments else \
            "fragment" + "s" * (len(synced) > 1) + " " + ", ".join(map(str, synced))
        which = f"sync {sync_number(record)}{of} (round {record['round']}, {part})"
    replicas = ", ".join(f"{x:.3f}" for x in record["replica_losses"])
    line = (
        f"[diloco] {which} step {record['step']}: loss {record['loss']:.4f} ({replicas})"
        f" | Δ-norm {record['pseudo_grad_norm']:.4f} | sent {format_bytes(record['bytes_per_replica'])}"
        f" in {record['sync_seconds']:.2f}s | {record['tokens_per_second']:.0f} tok/s"
    )
    if record.get("eval_loss") is not None:
        line += f" | eval loss {record['eval_loss']:.4f}"
    for key, said in (("excluded", "left out"), ("flagged", "flagged")):
        named = [f"replica {e['replica']} ({e['reason'].split(':')[0]})" for e in record.get(key) or []]
        if named:
            line += f" | {said}: {', '.join(named)}"
    return line


class SyncWriter:
    """Writes sync records to syncs.jsonl (main process only)."""

    def __init__(self, output_dir: str):
        self.path = Path(output_dir) / SYNCS_FILE
        earlier = syncs_file(output_dir)
        if earlier != self.path:  # resuming a run an earlier version wrote: its records go on under today's names
            replace_text(self.path, "".join(json.dumps(r) + "\n" for r in read_syncs(output_dir)))
            earlier.unlink()

    def truncate_after(self, step: int) -> list[dict]:
        """Forget syncs past `step` (their steps are retrained after a resume); returns the records kept."""
        kept = [r for r in read_syncs(self.path.parent) if r["step"] <= step]
        replace_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        return kept

    def write(self, record: dict) -> None:
        append_jsonl(self.path, {k: _clean(v) for k, v in record.items()})


def write_summary(output_dir: str, summary: dict) -> None:
    write_json(Path(output_dir) / SUMMARY_FILE, {k: _clean(v) for k, v in summary.items()})


def read_summary(output_dir: str | os.PathLike) -> dict:
    """The run's diloco_summary.json ({} before the run has ended); DamagedFile, naming it, when it is damaged."""
    return read_json(Path(output_dir) / SUMMARY_FILE, {})
