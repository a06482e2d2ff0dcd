"""What the app shows about a run, computed from its folder only (no torch, no Gradio).

Every function takes a `Run` (hf_diloco.runs) and returns plain data: HTML for the status bar, pandas frames in
long format for the plots, rows for the round table, the tail of the log.
"""

from __future__ import annotations

import html
import re
import time
from pathlib import Path

import pandas as pd

from hf_diloco.metrics import read_sync_rounds
from hf_diloco.runs import LOG_FILE, Run

STATUS_COLORS = {"starting": "#6b7280", "running": "#2563eb", "stopping": "#d97706", "finished": "#16a34a",
                 "stopped": "#7c3aed", "failed": "#dc2626"}
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
ROUND_COLUMNS = ["round", "step", "train loss", "eval loss", "Δ norm", "MB sent", "sync s", "compute s", "tokens/s"]


def read_rounds(run: Run | None) -> list[dict]:
    """The run's sync_rounds.jsonl; a half-written last line of a live run is skipped."""
    return read_sync_rounds(run.output_dir) if run is not None else []


def max_steps(run: Run) -> int | None:
    """max_steps from the overrides, else from the recipe (a plain `key: value` line)."""
    values = dict(zip(run.overrides[::2], run.overrides[1::2], strict=False))
    if "--max_steps" in values:
        return int(values["--max_steps"])
    try:
        for line in Path(run.recipe).read_text().splitlines():
            if line.startswith("max_steps:"):
                return int(line.split(":", 1)[1].split("#")[0])
    except (OSError, ValueError):
        pass
    return None


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s"


def status_html(run: Run | None) -> str:
    """The bar at the top of the page: run, state, progress, throughput, bytes."""
    if run is None:
        return "<div class='hfd-status'><b>No run selected.</b> Start one from the Launch tab.</div>"
    rounds = read_rounds(run)
    step = rounds[-1]["step"] if rounds else 0
    total = max_steps(run)
    color = STATUS_COLORS.get(run.status, "#6b7280")
    elapsed = (run.ended or time.time()) - run.created
    parts = [f"<span class='hfd-badge' style='background:{color}'>{html.escape(run.status)}</span>",
             f"<b>{html.escape(run.id)}</b>"]
    if total:
        parts.append(f"<progress value='{step}' max='{total}'></progress> step {step}/{total}")
    if rounds:
        last = rounds[-1]
        sent = sum(r["bytes_per_replica"] for r in rounds)
        parts.append(f"round {last['round']} · loss {last['loss']:.4f} · {last['tokens_per_second']:,.0f} tok/s"
                     f" · {last['num_replicas']} replicas · sent {sent / 1e6:,.1f} MB/replica")
    parts.append(f"{_duration(elapsed)}")
    if run.exit_code not in (None, 0):
        parts.append(f"exit code {run.exit_code}")
    return "<div class='hfd-status' id='hfd-status' data-status='" + html.escape(run.status) + "'>" + \
        " &nbsp;|&nbsp; ".join(parts) + "</div>"


def replica_loss_frame(rounds: list[dict]) -> pd.DataFrame:
    rows = [{"step": r["step"], "loss": loss, "replica": f"replica {i}"}
            for r in rounds for i, loss in enumerate(r["replica_losses"])]
    rows += [{"step": r["step"], "loss": r["eval_loss"], "replica": "held-out (global model)"}
             for r in rounds if r.get("eval_loss") is not None]
    return pd.DataFrame(rows, columns=["step", "loss", "replica"])


def norm_frame(rounds: list[dict]) -> pd.DataFrame:
    rows = [{"round": r["round"], "norm": r["pseudo_grad_norm"], "of": "averaged Δ"} for r in rounds]
    rows += [{"round": r["round"], "norm": n, "of": f"replica {i}"}
             for r in rounds for i, n in enumerate(r.get("replica_pseudo_grad_norms", []))]
    return pd.DataFrame(rows, columns=["round", "norm", "of"])


def agreement_frame(rounds: list[dict]) -> pd.DataFrame:
    rows = [{"round": r["agreement_round"], "cosine": c, "replica": f"replica {i}"}
            for r in rounds if "replica_agreement" in r for i, c in enumerate(r["replica_agreement"])]
    return pd.DataFrame(rows, columns=["round", "cosine", "replica"])


def bytes_frame(rounds: list[dict]) -> pd.DataFrame:
    rows, diloco, ddp = [], 0.0, 0.0
    for r in rounds:
        diloco += r["bytes_per_replica"] / 1e6
        ddp += r["ddp_bytes_per_replica"] / 1e6
        rows += [{"step": r["step"], "MB": diloco, "traffic": "DiLoCo (cumulative)"},
                 {"step": r["step"], "MB": ddp, "traffic": "DDP for the same steps"},
                 {"step": r["step"], "MB": r["bytes_per_replica"] / 1e6, "traffic": "DiLoCo (this round)"}]
    return pd.DataFrame(rows, columns=["step", "MB", "traffic"])


def time_frame(rounds: list[dict]) -> pd.DataFrame:
    rows = [{"round": r["round"], "seconds": r[key], "part": part}
            for r in rounds for key, part in (("compute_seconds", "compute"), ("sync_seconds", "sync"))]
    return pd.DataFrame(rows, columns=["round", "seconds", "part"])


def round_rows(rounds: list[dict]) -> pd.DataFrame:
    rows = [[r["round"], r["step"], round(r["loss"], 4),
             round(r["eval_loss"], 4) if r.get("eval_loss") is not None else None,
             round(r["pseudo_grad_norm"], 4), round(r["bytes_per_replica"] / 1e6, 2), round(r["sync_seconds"], 3),
             round(r["compute_seconds"], 2), round(r["tokens_per_second"])] for r in reversed(rounds)]
    return pd.DataFrame(rows, columns=ROUND_COLUMNS)


def log_tail(run: Run | None, lines: int = 200) -> str:
    """The last complete lines of the log; progress-bar redraws (carriage returns) keep only their last state."""
    if run is None:
        return ""
    path = Path(run.folder) / LOG_FILE
    if not path.exists():
        return ""
    with path.open("rb") as f:
        f.seek(0, 2)
        f.seek(max(0, f.tell() - 256_000))
        text = f.read().decode(errors="replace")
    complete = text[: text.rfind("\n") + 1] if "\n" in text else ""
    # split on newlines only: a carriage return is a redraw of the same line, of which only the last state counts
    cleaned = [line.split("\r")[-1] for line in ANSI_ESCAPE.sub("", complete).split("\n")]
    return "\n".join([line for line in cleaned if line.strip()][-lines:])


def runs_table(runs: list[Run]) -> pd.DataFrame:
    rows = []
    for run in runs:
        rounds = read_rounds(run)
        rows.append([run.id, run.status, Path(run.recipe).name, rounds[-1]["step"] if rounds else 0,
                     round(rounds[-1]["loss"], 4) if rounds else None,
                     time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(run.created))])
    return pd.DataFrame(rows, columns=["run", "status", "recipe", "step", "loss", "started"])


def tensorboard_hint(run: Run | None) -> str:
    if run is None:
        return ""
    return f"TensorBoard for this run: `tensorboard --logdir {Path(run.output_dir) / 'runs'}`"
