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

SYNC_ROUNDS_FILE = "sync_rounds.jsonl"
SUMMARY_FILE = "diloco_summary.json"

# Scalars mirrored to TensorBoard as diloco/<name>.
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
    path = Path(output_dir) / SUMMARY_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({k: _clean(v) for k, v in summary.items()}, indent=2) + "\n")
