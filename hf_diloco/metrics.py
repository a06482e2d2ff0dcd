"""Per-round metrics: `<output_dir>/sync_rounds.jsonl`, the trackers of `report_to` (diloco/<name>), a console line.

Design choices:
- Only the main process writes. Every replica's numbers reach it inside the round's sync (see comm.py), so writing
  metrics needs no collective of its own.
- A round's record is written once the round is complete: right after the sync, or after the evaluation that the
  trainer runs on that round boundary, so `eval_loss` lands in the same record.
- The JSONL file is the interface of runs: the app and the benchmarks read it. The trackers get the same numbers
  through Trainer's own integrations (hf_diloco.rounds reports them), so every `report_to` Trainer supports
  receives them and the project keeps no tracker code of its own. Floats are plain JSON numbers; NaN is written as null.
- On resume, records of rounds after the checkpoint are dropped first, since those rounds are trained again.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from .files import read_json, write_json

SYNC_ROUNDS_FILE = "sync_rounds.jsonl"
# Series keep their colour wherever they are drawn (the app's Live and Compare views, the model card's curve):
# replica i is always PALETTE[i], the held-out loss of the global model black.
PALETTE = ["#2563eb", "#ea580c", "#16a34a", "#9333ea", "#0891b2", "#ca8a04", "#db2777", "#4b5563"]
SERIES_COLORS = {"held-out (global model)": "#111827", "held-out loss": "#111827", "averaged Δ": "#111827",
                 "train loss (all processes)": "#2563eb", "train loss (mean of replicas)": "#2563eb",
                 "compute": "#2563eb", "sync": "#ea580c", "blocked": "#dc2626", "logged loss (process 0)": "#93c5fd",
                 "DDP for the same steps": "#dc2626", "DiLoCo (cumulative)": "#111827",
                 "DiLoCo (this round)": "#6b7280"}
SUMMARY_FILE = "diloco_summary.json"

# The round numbers that go to the trackers Trainer reports to (`report_to`), as diloco/<name> at the round's step.
REPORTED_KEYS = (
    "loss", "eval_loss", "pseudo_grad_norm", "bytes_per_replica", "sync_seconds", "compute_seconds", "outer_lr",
    "tokens_per_second", "cumulative_bytes_per_replica",
)


def reported_metrics(record: dict) -> dict[str, float]:
    """A round record as tracker metrics: diloco/<name> for each finite number of REPORTED_KEYS, and
    diloco/replica_<r>/loss for each replica's loss."""
    metrics = {f"diloco/{key}": float(record[key]) for key in REPORTED_KEYS
               if isinstance(record.get(key), (int, float)) and math.isfinite(record[key])}
    for rank, loss in enumerate(record.get("replica_losses", [])):
        if isinstance(loss, (int, float)) and math.isfinite(loss):
            metrics[f"diloco/replica_{rank}/loss"] = float(loss)
    return metrics


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def read_sync_rounds(output_dir: str | os.PathLike) -> list[dict]:
    """All round records of a run, in order; tolerates a half-written last line of a live run."""
    path = Path(output_dir) / SYNC_ROUNDS_FILE
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


REPLICA_PREFIX = "replica-"


def replica_folders(output_dir: str | os.PathLike) -> list[Path]:
    """The `replica-r` folders of a torchft launch's output folder (`hf-diloco launch --replicas N`), lowest replica
    id first; [] for a folder that holds its own sync_rounds.jsonl (every other run)."""
    output = Path(output_dir)
    if (output / SYNC_ROUNDS_FILE).exists():
        return []
    found = [p for p in output.glob(REPLICA_PREFIX + "*") if p.is_dir() and p.name[len(REPLICA_PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(REPLICA_PREFIX):]))


def launch_folder(folder: str | os.PathLike) -> Path:
    """The torchft launch's output folder when `folder` is one of its replica folders, else `folder` itself."""
    folder = Path(folder)
    if folder.name.startswith(REPLICA_PREFIX) and folder in replica_folders(folder.parent):
        return folder.parent
    return folder


def run_rounds(output_dir: str | os.PathLike) -> list[dict]:
    """The rounds of a run folder: its sync_rounds.jsonl, or for a torchft launch the union over its replica
    folders, one record per round number (every participant of a round writes the same membership): a committed
    record before one whose round did not commit, then the lowest replica id's. The app and the model card both
    count from this."""
    folders = replica_folders(output_dir)
    if not folders:
        return read_sync_rounds(output_dir)
    merged: dict[int, dict] = {}
    for folder in folders:
        for record in read_sync_rounds(folder):
            kept = merged.get(record["round"])
            if kept is None or (not kept.get("committed", True) and record.get("committed", True)):
                merged[record["round"]] = record
    return [merged[n] for n in sorted(merged)]


def replica_losses(record: dict) -> list[tuple[int, float]]:
    """(replica id, mean inner loss) of each replica that trained in the round (a torchft round: its members)."""
    if "members" in record:
        return [(m["replica"], m["loss_sum"] / m["steps"]) for m in record["members"]
                if m.get("participated") and m.get("steps")]
    return list(enumerate(record.get("replica_losses", [])))


def outer_rounds(rounds: list[dict]) -> int:
    """Whole outer rounds among committed round records: with streaming fragments a record syncs some fragments,
    and an outer round is over once every fragment has synced, so this is the fewest syncs of any fragment.

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


def format_round(record: dict, total_rounds: int | None) -> str:
    """One console line per round."""
    of = f"/{total_rounds}" if total_rounds else ""
    replicas = ", ".join(f"{x:.3f}" for x in record["replica_losses"])
    line = (
        f"[diloco] round {record['round']}{of} step {record['step']}: loss {record['loss']:.4f} ({replicas})"
        f" | Δ-norm {record['pseudo_grad_norm']:.4f} | sent {format_bytes(record['bytes_per_replica'])}"
        f" in {record['sync_seconds']:.2f}s | {record['tokens_per_second']:.0f} tok/s"
    )
    if record.get("eval_loss") is not None:
        line += f" | eval loss {record['eval_loss']:.4f}"
    return line


class RoundWriter:
    """Writes round records to sync_rounds.jsonl (main process only)."""

    def __init__(self, output_dir: str):
        self.path = Path(output_dir) / SYNC_ROUNDS_FILE

    def truncate_after(self, step: int) -> list[dict]:
        """Forget rounds past `step` (they are retrained after a resume); returns the rounds kept."""
        kept = [r for r in read_sync_rounds(self.path.parent) if r["step"] <= step]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        return kept

    def write(self, record: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")


def write_summary(output_dir: str, summary: dict) -> None:
    write_json(Path(output_dir) / SUMMARY_FILE, {k: _clean(v) for k, v in summary.items()})


def read_summary(output_dir: str | os.PathLike) -> dict:
    """The run's diloco_summary.json ({} before the run has ended); DamagedFile, naming it, when it is damaged."""
    return read_json(Path(output_dir) / SUMMARY_FILE, {})
