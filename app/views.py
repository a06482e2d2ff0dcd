"""What the app shows about a run, computed from its folder only (no torch, no Gradio).

Every function takes a `Run` (hf_diloco.runs) or what was read from its folder and returns plain data: HTML for the
status bar, pandas frames in long format and the Plotly figures drawn from them, rows for
the tables, the tail of the log.

Sources, all under the run's output folder: `syncs.jsonl` (one record per DiLoCo sync), `progress.json`
(step and phase, rewritten as the run trains, so progress moves between syncs), `trainer_log.jsonl` (what Trainer
logs: the only source for a DDP baseline), `run_config.json`, `diloco_summary.json` and `run_metrics.json`
(settings and totals).

An `outer_backend: torchft` run started with `hf-diloco launch --replicas N` has none of these in its output
folder: replica r writes them all into `replica-r/`, and each replica's rounds are those it took part in (one that
joined late or was started again lacks the early ones). Its syncs are read as the union over the replica folders,
one record per sync number, and everything else from the replica that is furthest along (`lead_folder`).

A JSON file that cannot be read (empty, cut short) counts as absent in the plots and tables, and the status bar
names it in one sentence with what to do (`damaged_files`), so one broken file never blanks the whole page.

A sync record needs only `round`, `step` and `loss`; a record written by an older version or by hand may lack any
other field (`ddp_bytes_per_replica`, timings, norms, ...). What it lacks is shown as "—" in the status bar and an
empty cell in the tables, its point is left out of a plot, and a running total it breaks (bytes sent, seconds
waited) is not shown at all rather than shown too small.
"""

from __future__ import annotations

import html
import re
import time
from pathlib import Path

import pandas as pd

from hf_diloco import metrics
from hf_diloco.errors import ConfigError, DamagedFile
from hf_diloco.files import read_json, read_jsonl, read_yaml
from hf_diloco.hub import RUN_CONFIG_FILE
from hf_diloco.metrics import SUMMARY_FILE, sync_number
from hf_diloco.runs import ACTIVE, LOG_FILE, PROGRESS_FILE, REPLICAS_FILE, STOPPED_FILE, TRAINER_LOG_FILE, Run

STATUS_COLORS = {"starting": "#6b7280", "running": "#2563eb", "stopping": "#d97706", "finished": "#16a34a",
                 "stopped": "#7c3aed", "failed": "#dc2626", "unfinished": "#b45309"}
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
ROUND_COLUMNS = ["round", "step", "fragments", "train loss", "eval loss", "Δ norm", "MB sent", "compression", "× fewer",
                 "sync s", "blocked s", "compute s", "tokens/s", "steps per replica",
                 "tokens per replica", "left out"]
MEMBERSHIP_COLUMNS = ["round", "step", "participants", "committed"]  # then one column per replica
REPLICA_COLUMNS = ["replica", "state", "restarts", "last round recorded"]
RUN_COLUMNS = ["run", "status", "trainer", "H", "replicas", "step", "compression", "loss", "started", "reason"]
COMPARE_COLUMNS = ["run", "trainer", "H", "replicas", "final held-out loss", "tokens/s", "MB sent per replica",
                   "wall time", "contributions left out"]
PALETTE, FIXED_COLORS = metrics.PALETTE, metrics.SERIES_COLORS  # one colour per series in the app and the card
MISSING = "—"  # a value a record does not hold, in text


# --- reading a run folder -------------------------------------------------------------------------------------


RUN_METRICS_FILE = "run_metrics.json"  # written by hf_diloco.train at the run's end
# The JSON files of a run folder (and of each replica folder), with the kind of value each holds.
JSON_FILES = {PROGRESS_FILE: dict, STOPPED_FILE: dict, SUMMARY_FILE: dict, RUN_CONFIG_FILE: dict,
              RUN_METRICS_FILE: dict, REPLICAS_FILE: list}


def _json(path: Path, kind: type = dict):
    """A JSON file of the run, for display: empty when it is missing or damaged (see damaged_files)."""
    try:
        return read_json(path, kind(), kind)
    except DamagedFile:
        return kind()


def damaged_files(run: Run) -> list[str]:
    """One sentence (hf_diloco.files) for each JSON file of the run's folders that cannot be read."""
    sentences = []
    for folder in [Path(run.output_dir), *replica_folders(run)]:
        for name, kind in JSON_FILES.items():
            try:
                read_json(folder / name, None, kind)
            except DamagedFile as error:
                sentences.append(str(error))
    return sentences


def _replica_id(folder: Path) -> int:
    return int(folder.name.split("-", 1)[1])


def replica_folders(run: Run | None) -> list[Path]:
    """The `replica-r` folders of a torchft run started with --replicas, lowest replica id first; [] for a run
    whose output folder holds its own syncs.jsonl (every other run)."""
    return metrics.replica_folders(run.output_dir) if run is not None else []


def lead_folder(run: Run) -> Path:
    """Where the run's progress, Trainer log, settings, summary and model are read from: its output folder, or for
    a torchft run the replica furthest along (the highest step; the lowest replica id among equals)."""
    folders = replica_folders(run)
    if not folders:
        return Path(run.output_dir)
    return max(folders, key=lambda f: (_json(f / PROGRESS_FILE).get("step") or 0, -_replica_id(f)))


def read_rounds(run: Run | None) -> list[dict]:
    """The run's sync records (a torchft run's merged over its replicas: `metrics.run_syncs`); a half-written
    last line of a live run is skipped."""
    return metrics.run_syncs(run.output_dir) if run is not None else []


def read_progress(run: Run | None) -> dict:
    """progress.json: {"phase", "step", "max_steps", ...}; empty before the run's first step."""
    return _json(lead_folder(run) / PROGRESS_FILE) if run is not None else {}


def read_trainer_log(run: Run | None) -> list[dict]:
    """Every dict Trainer logged (loss, eval_loss, learning_rate, ...), with its step."""
    if run is None:
        return []
    return read_jsonl(lead_folder(run) / TRAINER_LOG_FILE)


def _yaml(path: str | Path) -> dict:
    """A YAML mapping file (a recipe, an accelerate config); {} when unreadable."""
    try:
        return read_yaml(path, "settings file")
    except ConfigError:
        return {}


def recipe_value(run: Run, key: str) -> str | None:
    """A setting as the run got it: a --key override, else the recipe's `key`; for a run the app did not start,
    what its run_config.json recorded."""
    if run.found:
        config = _json(lead_folder(run) / RUN_CONFIG_FILE)
        sections = [config, *(config.get(s, {}) for s in ("training", "diloco", "run"))]
        value = next((section[key] for section in sections if isinstance(section, dict) and key in section), None)
        return None if value is None else str(value)
    values = dict(zip(run.overrides[::2], run.overrides[1::2], strict=False))
    if f"--{key}" in values:
        return values[f"--{key}"]
    value = _yaml(run.recipe).get(key)
    return None if value is None else str(value)


def max_steps(run: Run) -> int | None:
    try:
        value = int(recipe_value(run, "max_steps") or "")
    except ValueError:
        return None
    return value if value > 0 else None


def trainer_kind(run: Run) -> str:
    """"diloco" or "ddp" (the baseline Trainer)."""
    return recipe_value(run, "trainer") or "diloco"


def replicas(run: Run) -> str:
    """How many replicas the run starts: a torchft run's --replicas, else its processes (--num_processes, else the
    accelerate config's num_processes); for a run the app did not start, its replica folders, else its processes
    (run_config.json) over the processes of a replica."""
    if run.found:
        if replica_folders(run):
            return str(len(replica_folders(run)))
        processes, group = recipe_value(run, "num_processes"), recipe_value(run, "replica_group_size") or "1"
        return "" if processes is None else str(max(1, int(processes) // max(1, int(group))))
    for flag in ("--replicas", "--num_processes"):
        if flag in run.command:
            return run.command[run.command.index(flag) + 1]
    value = _yaml(run.accelerate_config).get("num_processes")
    return "" if value is None else str(value)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s"


def current_step(run: Run, rounds: list[dict], progress: dict) -> int:
    return max(progress.get("step") or 0, rounds[-1]["step"] if rounds else 0)


# --- optional fields of a sync record ---------------------------------------------------------------------------


def blocked_seconds(record: dict) -> float | None:
    """Seconds the inner loop waited for the sync (records from before overlapped syncs: the whole sync)."""
    return record.get("blocked_seconds", record.get("sync_seconds"))


def known_sum(values) -> float | None:
    """The sum, or None when a value is unknown: a total that skipped a record would be wrong."""
    values = list(values)
    return None if any(v is None for v in values) else sum(values)


def rounded(value, digits: int | None = None, scale: float = 1.0):
    """`value / scale` rounded to `digits` (an int without), None when unknown (an empty table cell)."""
    return None if value is None else round(value / scale, digits)


def rule(reason: str) -> str:
    """The contribution check that left a replica out, from the record's sentence (its words before the colon).

    >>> rule("apart: it agrees with the others far less than they with each other")
    'apart'
    """
    return reason.split(":", 1)[0]


def left_out(record: dict) -> str:
    """The contributions a sync left out, "replica 2 (apart)", and those a check only flagged (contribution_checks:
    warn), "replica 2 (apart, flagged)"; empty when none, or for a record from before the checks."""
    return ", ".join(f"replica {e['replica']} ({rule(e['reason'])}{mark})"
                     for key, mark in (("excluded", ""), ("flagged", ", flagged")) for e in record.get(key) or [])


def left_out_count(rounds: list[dict]) -> int | None:
    """Contributions the checks left out over the syncs; None when no record says (a run from before the checks)."""
    if not any("excluded" in r for r in rounds):
        return None
    return sum(len(r.get("excluded") or []) for r in rounds)


def shown(value, spec: str, scale: float = 1.0) -> str:
    """`value / scale` formatted with `spec`, "—" when unknown.

    >>> shown(4_000_000, ",.1f", 1e6), shown(None, ",.1f")
    ('4.0', '—')
    """
    return MISSING if value is None else format(value / scale, spec)


# --- status bar -------------------------------------------------------------------------------------------------


def status_html(run: Run | None) -> str:
    """The bar at the top of the page: run, state, phase, progress, loss, throughput, bytes, contributions left out
    (when any were), and why it failed."""
    if run is None:
        return "<div class='hfd-status'><b>No run selected.</b> Start one from the Launch tab.</div>"
    rounds, progress, log = read_rounds(run), read_progress(run), read_trainer_log(run)
    step, total = current_step(run, rounds, progress), max_steps(run)
    color = STATUS_COLORS.get(run.status, "#6b7280")
    elapsed = (run.ended or time.time()) - run.created
    parts = [f"<span class='hfd-badge' style='background:{color}'>{html.escape(run.status)}</span>",
             f"<b>{html.escape(run.name or run.id)}</b>"]
    if run.status in ACTIVE:  # also while stopping: a run asked to stop during start-up is still starting
        phase = progress.get("phase") or "starting"
        if phase != "training":
            parts.append(f"<i class='hfd-phase'>{html.escape(phase)}</i>")
    if total:
        parts.append(f"<progress value='{min(step, total)}' max='{total}'></progress> step {step}/{total}")
    if rounds:
        last = rounds[-1]
        sent = known_sum(r.get("bytes_per_replica") for r in rounds)
        blocked = known_sum(blocked_seconds(r) for r in rounds)
        codec = last.get("compression", "none")
        fewer = last.get("compression_ratio") or 1.0  # fp32 syncs: 1.0, nothing to say
        ratio = f" ({fewer:.1f}× fewer bytes)" if fewer > 1.05 else ""
        if is_torchft(last):
            listed = len(last["replicas"]) if "replicas" in last else MISSING
            present = f"{last.get('participants', MISSING)} of {listed}"
        else:
            present = last.get("num_replicas", MISSING)
        # With streaming fragments a record is one fragment's sync: the round count is of whole rounds.
        counted = f"{metrics.outer_rounds(rounds)} ({len(rounds)} syncs)" if streamed(rounds) \
            else last["round"]
        excluded = left_out_count(rounds)
        parts.append(f"round {counted} · loss {last['loss']:.4f} · {shown(last.get('tokens_per_second'), ',.0f')} "
                     f"tok/s · {present} replicas · sent {shown(sent, ',.1f', 1e6)} MB/replica, {codec}{ratio}"
                     f" · waited for syncs {shown(blocked, ',.1f')} s"
                     + (f" · {excluded} contribution{'s' if excluded > 1 else ''} left out" if excluded else ""))
    elif trainer_kind(run) == "ddp":
        losses = [e["loss"] for e in log if "loss" in e]
        parts.append((f"loss {losses[-1]:.4f} · " if losses else "") + "DDP baseline: no syncs "
                     "(gradients all-reduced every step)")
    parts.append(_duration(elapsed))
    if run.status == "failed":
        reason = run.reason or (f"exit code {run.exit_code}" if run.exit_code is not None else "")
        parts.append(f"<span class='hfd-reason'>{html.escape(reason)}</span>")
    if run.status == "stopped":
        parts.append(f"<span class='hfd-resume'>{html.escape(resume_hint(run))}</span>")
    parts += [f"<span class='hfd-damaged'>{html.escape(sentence)}</span>" for sentence in damaged_files(run)]
    return "<div class='hfd-status' id='hfd-status' data-status='" + html.escape(run.status) + "'>" + \
        " &nbsp;|&nbsp; ".join(parts) + "</div>"


def is_torchft(record: dict) -> bool:
    """A torchft sync's record: its participants are a quorum's, with a vote (a torch record's are every replica)."""
    return record.get("outer_backend") == "torchft"


def streamed(rounds: list[dict]) -> bool:
    """Whether the records are streaming fragment syncs (some record carries a fragment other than 0)."""
    return any(max(r.get("fragments") or [0]) > 0 for r in rounds)


def resume_hint(run: Run) -> str:
    """What a stopped run kept and how to go on from it: its command again, resuming from the newest checkpoint."""
    stopped = _json(Path(run.output_dir) / STOPPED_FILE) or _json(lead_folder(run) / STOPPED_FILE)
    step, checkpoint = stopped.get("step"), stopped.get("checkpoint")
    if not checkpoint:
        return f"stopped at step {step}; no checkpoint was kept (the recipe saves none)." if step is not None \
            else "stopped."
    import shlex

    command = " ".join(shlex.quote(part) for part in [*run.command, "--resume_from_checkpoint", "latest"])
    return f"stopped at step {step}; {checkpoint} kept in {run.output_dir}. To resume from it: {command}"


# --- live plots ---------------------------------------------------------------------------------------------------
# Every figure the app draws is a Plotly figure (gr.Plot): one library for Live and Compare, with log axes where
# bytes span orders of magnitude, markers so a one-point series shows, and each series in its fixed colour, the
# same as in the model card's curve (metrics.SERIES_COLORS, replica i PALETTE[i]).


def _frame(rows: list[dict], x: str, y: str, series: str) -> pd.DataFrame:
    """A long-format frame (x, y, series) whose column types hold even when empty."""
    frame = pd.DataFrame(rows, columns=[x, y, series])
    return frame.astype({x: "float64", y: "float64", series: "string"})


def series_names(frame: pd.DataFrame, series: str) -> list[str]:
    return sorted(set(frame[series].dropna()))


def colors(names: list[str]) -> dict[str, str]:
    """A fixed colour per series: `replica i` → PALETTE[i], named series their own colour."""
    chosen = {}
    for name in names:
        match = re.search(r"(\d+)$", name)
        chosen[name] = FIXED_COLORS.get(name) or PALETTE[int(match.group(1)) % len(PALETTE) if match else
                                                        len(chosen) % len(PALETTE)]
    return chosen


DASHES = {"DDP for the same steps": "dash", "DiLoCo (this sync)": "dot", "logged loss (process 0)": "dot"}


def _layout(figure, title: str, x_title: str, y_title: str, x_range=None, log_x=False, log_y=False,
            empty: str = ""):
    """Titles, rounded ticks (3 significant digits), a legend below, a fixed height; `empty` is written across an
    empty figure."""
    figure.update_layout(title={"text": title, "font": {"size": 13}}, template="plotly_white", height=320,
                         margin={"l": 55, "r": 15, "t": 40, "b": 30}, hovermode="closest",
                         legend={"orientation": "h", "y": -0.38, "font": {"size": 10}})
    padded = [x_range[0] - 0.02 * x_range[1], 1.02 * x_range[1]] if x_range and not log_x else None
    figure.update_xaxes(title_text=x_title, type="log" if log_x else "linear", tickformat="~s" if log_x else "~r",
                        range=padded)
    figure.update_yaxes(title_text=y_title, type="log" if log_y else "linear", tickformat=".3~g")
    if empty:
        figure.add_annotation(text=empty, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper",
                              font={"size": 13, "color": "#6b7280"})
        figure.update_xaxes(visible=False)
        figure.update_yaxes(visible=False)
    return figure


def series_figure(frame: pd.DataFrame, series: str, *, title: str, x_title: str, y_title: str, kind: str = "lines",
                  x_range=None, log_y: bool = False, empty: str = ""):
    """One trace per series of a long-format frame (x, y, series): lines with markers, points, or stacked bars."""
    import plotly.graph_objects as go

    x, y = frame.columns[0], frame.columns[1]
    figure = go.Figure()
    names = series_names(frame, series)
    for name, color in colors(names).items():
        part = frame[frame[series] == name]
        if kind == "bars":
            figure.add_bar(x=part[x], y=part[y], name=name, marker_color=color)
        else:
            figure.add_scatter(x=part[x], y=part[y], name=name, mode="markers" if kind == "points" else "lines+markers",
                               line={"color": color, "dash": DASHES.get(name, "solid"), "width": 2},
                               marker={"color": color, "size": 7 if kind == "points" else 5})
    if kind == "bars":
        figure.update_layout(barmode="stack", bargap=0.15)
    return _layout(figure, title, x_title, y_title, x_range, log_y=log_y, empty="" if names else empty)


def loss_frame(rounds: list[dict], trainer_log: list[dict]) -> pd.DataFrame:
    """Inner loss per replica per round and held-out loss (DiLoCo), with the loss Trainer logs every
    `logging_steps` on process 0 beside them; or Trainer's logged losses (DDP baseline).

    A round's inner loss is the mean over its steps; a replica with one round so far is drawn as a flat segment over
    that round's steps, so that a one-round run shows a line too. A torchft round lists only its participants'
    losses, so there each loss is named by its member's replica id.
    """
    evals = [{"step": e["step"], "loss": e["eval_loss"]} for e in trainer_log if e.get("eval_loss") is not None]
    logged = [{"step": e["step"], "loss": e["loss"]} for e in trainer_log if e.get("loss") is not None]
    if rounds:
        rows = [{"step": r["step"], "loss": loss, "replica": f"replica {i}"}
                for r in rounds for i, loss in metrics.replica_losses(r)]
        if len(rounds) == 1:
            # sync_steps: the steps before the sync (older runs wrote round_steps, the oldest inner_steps)
            first = rounds[0]
            taken = first.get("sync_steps", first.get("round_steps", first.get("inner_steps", first["step"])))
            rows += [{**row, "step": first["step"] - taken} for row in rows]
        held_out = evals or [{"step": r["step"], "loss": r["eval_loss"]} for r in rounds
                             if r.get("eval_loss") is not None]
        rows += [{**e, "replica": "held-out (global model)"} for e in held_out]
        rows += [{**e, "replica": "logged loss (process 0)"} for e in logged]
    else:
        rows = [{**e, "replica": "train loss (all processes)"} for e in logged]
        rows += [{**e, "replica": "held-out loss"} for e in evals]
    return _frame(sorted(rows, key=lambda row: row["step"]), "step", "loss", "replica")


def norm_frame(rounds: list[dict]) -> pd.DataFrame:
    """Pseudo-gradient norms per sync, at the sync's step (with streaming, one sync per fragment)."""
    rows = [{"step": r["step"], "norm": r["pseudo_grad_norm"], "of": "averaged Δ"} for r in rounds
            if r.get("pseudo_grad_norm") is not None]
    rows += [{"step": r["step"], "norm": n, "of": f"replica {i}"}
             for r in rounds for i, n in enumerate(r.get("replica_pseudo_grad_norms", []))]
    return _frame(rows, "step", "norm", "of")


def agreement_frame(rounds: list[dict], summary: dict | None = None) -> pd.DataFrame:
    """cos(Δ_i, Δ) per replica, at the step of the sync it measures (it is reported with the next sync; the last
    sync's arrives in the run's summary when it ends). Runs written before syncs had their own name keep the sync
    number under agreement_round / last_round_agreement."""
    steps = {sync_number(r): r["step"] for r in rounds}
    measured = [(r.get("agreement_sync", r.get("agreement_round")), r["replica_agreement"]) for r in rounds
                if "replica_agreement" in r]
    summary = summary or {}
    last = summary.get("last_sync_agreement") or summary.get("last_round_agreement")
    if last and "replica_agreement" in last:
        measured.append((last.get("sync", last.get("round")), last["replica_agreement"]))
    rows = [{"step": steps[at], "cosine": c, "replica": f"replica {i}"} for at, values in measured if at in steps
            for i, c in enumerate(values)]
    return _frame(rows, "step", "cosine", "replica")


def read_summary(run: Run | None) -> dict:
    """The run's diloco_summary.json, once it has ended ({} before)."""
    return _json(lead_folder(run) / SUMMARY_FILE) if run is not None else {}


def time_frame(rounds: list[dict]) -> pd.DataFrame:
    """Per sync: inner compute seconds and the seconds the inner loop was blocked waiting for the sync (an
    overlapped sync's transfer hides behind compute and blocks only for what is left)."""
    rows = [{"step": r["step"], "seconds": value, "part": part} for r in rounds for part, value in (
        ("compute", r.get("compute_seconds")), ("blocked", blocked_seconds(r))) if value is not None]
    return _frame(rows, "step", "seconds", "part")


def bytes_rows(rounds: list[dict]) -> pd.DataFrame:
    """Cumulative MB sent per replica by DiLoCo, and what DDP would have sent for the same steps. A cumulative
    series is drawn only when every record holds its field (a running total with a gap would be too small); a
    sync's own bytes wherever its record has them."""
    rows = []
    cumulative = (("DiLoCo (cumulative)", "bytes_per_replica"), ("DDP for the same steps", "ddp_bytes_per_replica"))
    for series, key in cumulative:
        if all(r.get(key) is not None for r in rounds):
            sent = 0.0
            for r in rounds:
                sent += r[key] / 1e6
                rows.append({"step": r["step"], "MB": sent, "traffic": series})
    rows += [{"step": r["step"], "MB": r["bytes_per_replica"] / 1e6, "traffic": "DiLoCo (this sync)"} for r in rounds
             if r.get("bytes_per_replica") is not None]
    frame = _frame(rows, "step", "MB", "traffic")
    return frame[frame["MB"] > 0]  # nothing sent has no place on a log scale


def live_figures(run: Run | None, rounds: list[dict], trainer_log: list[dict], summary: dict) -> dict:
    """The Live tab's figures: loss, bytes, pseudo-gradient norms, agreement, compute and blocked time."""
    total = max_steps(run) if run is not None else None
    steps = [0, total] if total else None
    waiting = "waiting for the first sync round"
    ddp = run is not None and not rounds and trainer_kind(run) == "ddp"
    return {
        "loss": series_figure(loss_frame(rounds, trainer_log), "replica", x_range=steps, x_title="step",
                              y_title="loss", title="Inner loss per replica · held-out loss of the global model",
                              empty="waiting for the first loss"),
        "bytes": series_figure(bytes_rows(rounds), "traffic", x_range=steps, x_title="step", log_y=True,
                               y_title="MB per replica (log)", title="MB sent per replica vs DDP",
                               empty="no syncs: the DDP baseline all-reduces gradients at every step" if ddp
                               else waiting),
        "norm": series_figure(norm_frame(rounds), "of", kind="points", x_range=steps, x_title="step of the sync",
                              y_title="‖Δ‖", title="Pseudo-gradient norm per sync", empty=waiting),
        "agreement": series_figure(agreement_frame(rounds, summary), "replica", kind="points", x_range=steps,
                                   x_title="step of the round", y_title="cosine",
                                   title="Agreement cos(Δ_replica, Δ_mean)", empty=waiting),
        "time": series_figure(time_frame(rounds), "part", kind="bars", x_title="step of the sync", y_title="seconds",
                              title="Compute vs blocked (waiting for a sync)", empty=waiting),
    }


def round_rows(rounds: list[dict]) -> pd.DataFrame:
    """The sync table (ROUND_COLUMNS), newest first; its last column names the contributions each sync left out."""
    def ratio(r: dict):
        value = r.get("compression_ratio")
        return round(value, 1) if value else None

    fragments = max((max(r.get("fragments") or [0]) for r in rounds), default=0) + 1

    def synced(r: dict) -> str:  # which fragments a sync carried: blank without streaming, "all" for a full sync
        ids = r.get("fragments") or [0]
        return "" if fragments == 1 else "all" if len(ids) == fragments else ",".join(map(str, ids))

    def per_replica(r: dict, key: str, shown=str) -> str:  # each replica's steps or tokens since its last sync,
        rows = sorted(r.get("replicas", []), key=lambda m: m["replica"])  # where they differ (– : absent)
        if len({m.get(key) for m in rows if m.get("participated")}) < 2 and all(m.get("participated")
                                                                               for m in rows):
            return ""
        return " · ".join(shown(m.get(key, 0)) if m.get("participated") else "–" for m in rows)

    def thousands(tokens: int) -> str:
        return f"{tokens / 1000:.1f}k" if tokens >= 1000 else str(tokens)

    rows = [[r["round"], r["step"], synced(r), round(r["loss"], 4), rounded(r.get("eval_loss"), 4),
             rounded(r.get("pseudo_grad_norm"), 4), rounded(r.get("bytes_per_replica"), 2, 1e6),
             r.get("compression", "none"), ratio(r), rounded(r.get("sync_seconds"), 3),
             rounded(blocked_seconds(r), 3), rounded(r.get("compute_seconds"), 2),
             rounded(r.get("tokens_per_second")), per_replica(r, "steps"), per_replica(r, "tokens", thousands),
             left_out(r)]
            for r in reversed(rounds)]
    return pd.DataFrame(rows, columns=ROUND_COLUMNS)


def member_cell(member: dict | None, down: str = "") -> str:
    """One replica in one torchft round: "✓ 14 steps", "healed" (it took θ_global from a live peer), "✓ 9 steps,
    1 sync late" (its base was behind), "excluded (apart)" (in time, but a contribution check left it out, by the
    rule named), "absent" (alive but not in time), or, with `down`, why its process was not there at all
    ("down, restarting", "down")."""
    if member and member.get("excluded"):
        return f"excluded ({rule(member['excluded'])})"
    if not member or not member.get("participated"):
        return down or "absent"
    healed, late = member.get("healed"), member.get("staleness", 0)
    parts = [f"✓ {member.get('steps', 0)} steps"] if member.get("steps") or not healed else []
    parts += ["healed"] if healed else []
    parts += [f"{late} sync{'s' if late > 1 else ''} late"] if late else []
    return ", ".join(parts)


def read_replica_states(run: Run | None) -> list[dict]:
    """A torchft launch's replicas.json (written by its launcher as replicas go down and come back); [] else."""
    return _json(Path(run.output_dir) / REPLICAS_FILE, list) if run is not None else []


def _down_rounds(state: dict, torchft: list[dict]) -> dict[int, str]:
    """The rounds in which a replica's process was down, with why: from each outage (the run's round when it went
    down) to the first committed round it was back in: it healed from a live peer (a restarted replica holds nothing
    else) and took part, or a contribution check left it out. A replica killed inside a sync can be listed in that
    sync by the peers its row had reached, whether the sync then rolled back or committed, before its own log has
    it: neither is its return."""
    replica, down = state.get("replica"), {}
    for outage in state.get("outages", []):
        after = outage.get("after_sync", outage.get("after_round", 0))  # after_round: launches before the rename
        back = next((sync_number(r) for r in torchft if sync_number(r) > after and r.get("committed", True) and any(
            m["replica"] == replica and (m.get("participated") and m.get("healed") or m.get("excluded"))
            for m in r.get("replicas", []))), None)
        for r in torchft:
            if sync_number(r) > after and (back is None or sync_number(r) < back):
                down[sync_number(r)] = "down, restarting" if outage.get("restarted") else "down"
    return down


def membership_rows(rounds: list[dict], replicas: int = 0, states: list[dict] = ()) -> pd.DataFrame:
    """Who took part in each torchft round, newest first: round, step, participants, whether it committed, then a
    cell per replica (at least `replicas` of them, the run's count); `states` (replicas.json) tells a replica whose
    process was down from one that was only late. Empty for any other run."""
    torchft = [r for r in rounds if is_torchft(r)]
    ids = {m["replica"] for r in torchft for m in r.get("replicas", [])}
    columns = [f"replica {i}" for i in range(max([replicas, *(i + 1 for i in ids)]))] if torchft else []
    down = {state["replica"]: _down_rounds(state, torchft) for state in states if "replica" in state}
    rows = []
    for r in reversed(torchft):
        by_replica = {m["replica"]: m for m in r.get("replicas", [])}
        rows.append([r["round"], r["step"], r.get("participants"), "yes" if r.get("committed", True) else "no",
                     *(member_cell(by_replica.get(i), down.get(i, {}).get(sync_number(r), ""))
                       for i in range(len(columns)))])
    return pd.DataFrame(rows, columns=MEMBERSHIP_COLUMNS + columns)


def replica_rows(run: Run | None) -> pd.DataFrame:
    """One row per replica of a torchft launch: its state (running; restarting, until it has taken part in a round
    again, then rejoined; finished; exited with its status; ended when started again after the run was over),
    restarts and the last round it recorded. Empty for any other run."""
    rows = []
    folders = {_replica_id(f): f for f in replica_folders(run)}
    for state in read_replica_states(run):
        replica = state.get("replica")
        records = metrics.read_syncs(folders[replica]) if replica in folders else []
        shown = {"running": "running", "finished": "finished", "ended": "ended (started after the run was over)",
                 "exited": f"exited (status {state.get('exit_code')}, no restart left)"}.get(state.get("state"), "")
        if state.get("state") == "rejoining":
            shown = "rejoined" if len(records) > state.get("records_at_restart", 0) else "restarting"
        rows.append([replica, shown, state.get("restarts", 0), records[-1]["round"] if records else None])
    return pd.DataFrame(rows, columns=REPLICA_COLUMNS)


def log_tail(run: Run | None, lines: int = 200) -> str:
    """The last complete lines of the log; progress-bar redraws (carriage returns) keep only their last state."""
    if run is None:
        return ""
    path = Path(run.folder) / LOG_FILE
    if run.found:
        return (f"This run was not started from the app: its console is where it was started. Its files are in "
                f"{run.output_dir}.")
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


# --- runs and comparing them ----------------------------------------------------------------------------------


def runs_table(runs: list[Run]) -> pd.DataFrame:
    rows = []
    for run in runs:
        rounds = read_rounds(run)
        log = read_trainer_log(run) if not rounds else []
        losses = [e["loss"] for e in log if e.get("loss") is not None]
        loss = rounds[-1]["loss"] if rounds else (losses[-1] if losses else None)
        kind = trainer_kind(run)
        rows.append([run.id, run.status, kind, recipe_value(run, "inner_steps") or "" if kind == "diloco" else "",
                     replicas(run), current_step(run, rounds, read_progress(run)),
                     (rounds[-1].get("compression") if rounds else None) or recipe_value(run, "compression")
                     or ("none" if kind == "diloco" else ""),
                     round(loss, 4) if loss is not None else None,
                     time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(run.created)),
                     run.reason if run.status == "failed" else ""])
    return pd.DataFrame(rows, columns=RUN_COLUMNS)


def _processes(run: Run, config: dict, progress: dict | None = None) -> int:
    """Processes that train at once: a torchft run's replicas (each its own launch of one), else the launch's."""
    if replica_folders(run):
        return int(replicas(run) or len(replica_folders(run)))
    return int(config.get("num_processes") or (progress or {}).get("world_size") or 1)


def held_out_curve(run: Run) -> pd.DataFrame:
    """Held-out loss against tokens trained (all processes) and MB sent per replica, for comparing runs."""
    config, progress, rounds = _json(lead_folder(run) / RUN_CONFIG_FILE), read_progress(run), read_rounds(run)
    training = config.get("training", {})
    processes = _processes(run, config, progress)
    tokens_per_step = int(training.get("per_device_train_batch_size") or 0) * int(
        training.get("gradient_accumulation_steps") or 1) * int(config.get("run", {}).get("block_size") or 0) \
        * processes
    evals = [(e["step"], e["eval_loss"]) for e in read_trainer_log(run) if e.get("eval_loss") is not None]
    if not evals:
        evals = [(r["step"], r["eval_loss"]) for r in rounds if r.get("eval_loss") is not None]
    rows = []
    counted = [r for r in rounds if r.get("committed", True) is not False and "tokens" in r]
    for step, loss in evals:
        if rounds:
            sent = known_sum(r.get("bytes_per_replica") for r in rounds if r["step"] <= step)
        else:
            sent = step * float(progress.get("ddp_bytes_per_step") or 0)
        # Tokens as trained: each round's record counts the tokens its replicas trained (a replica that was down or
        # absent trained none); a run without rounds (DDP) trains every process every step.
        tokens = sum(r["tokens"] for r in counted if r["step"] <= step) if counted else step * tokens_per_step
        rows.append({"run": run.name or run.id, "step": step, "tokens": tokens,
                     "MB": sent / 1e6 if sent is not None else None, "loss": loss})
    return pd.DataFrame(rows, columns=["run", "step", "tokens", "MB", "loss"]).astype({"MB": "float64"})


def compare_figure(runs: list[Run]):
    """Held-out loss against tokens trained and against MB sent per replica (log scale), one colour per run."""
    from plotly.subplots import make_subplots

    figure = make_subplots(rows=1, cols=2, horizontal_spacing=0.1,
                           subplot_titles=("Held-out loss vs tokens trained", "Held-out loss vs MB sent per replica"))
    for i, run in enumerate(runs):
        curve = held_out_curve(run)
        color, label = PALETTE[i % len(PALETTE)], run.name or run.id
        sent = curve[curve["MB"] > 0]  # nothing sent yet has no place on a log scale
        for column, part, x in ((1, curve, "tokens"), (2, sent, "MB")):
            figure.add_scatter(x=part[x], y=part["loss"], name=label, legendgroup=label, showlegend=column == 1,
                               mode="lines+markers", line={"color": color, "width": 2}, marker={"color": color,
                                                                                               "size": 6},
                               row=1, col=column)
    figure.update_layout(template="plotly_white", height=360, margin={"l": 55, "r": 15, "t": 40, "b": 40},
                         legend={"orientation": "h", "y": -0.22, "font": {"size": 10}})
    figure.update_xaxes(title_text="tokens trained (all replicas)", tickformat="~s", row=1, col=1)
    figure.update_xaxes(title_text="MB sent per replica (log)", type="log", row=1, col=2)
    figure.update_yaxes(title_text="held-out loss", tickformat=".3~g")
    return figure


def compare_rows(runs: list[Run]) -> pd.DataFrame:
    rows = []
    for run in runs:
        output = lead_folder(run)
        summary, metrics = _json(output / SUMMARY_FILE), _json(output / RUN_METRICS_FILE)
        curve, rounds, kind = held_out_curve(run), read_rounds(run), trainer_kind(run)
        processes = _processes(run, _json(output / RUN_CONFIG_FILE))
        if summary.get("tokens_per_second"):
            speed = summary["tokens_per_second"]
        elif metrics.get("steady_tokens_per_second"):
            speed = metrics["steady_tokens_per_second"] * processes  # the processes step in lockstep
        else:
            speed = None
        sent = curve["MB"].iloc[-1] if len(curve) else (
            rounded(known_sum(r.get("bytes_per_replica") for r in rounds), 2, 1e6) if rounds else None)
        sent = None if pd.isna(sent) else sent  # NaN, None: unknown (a record without its bytes)
        wall = (run.ended or time.time()) - run.created
        rows.append([run.name or run.id, kind, recipe_value(run, "inner_steps") if kind == "diloco" else "",
                     replicas(run), round(curve["loss"].iloc[-1], 4) if len(curve) else None,
                     round(speed) if speed else None, round(sent, 2) if sent is not None else None,
                     _duration(wall), left_out_count(rounds)])
    return pd.DataFrame(rows, columns=COMPARE_COLUMNS)


def tensorboard_hint(run: Run | None) -> str:
    if run is None:
        return ""
    # A torchft run's replicas each log under replica-r/runs; TensorBoard finds them all below the output folder.
    replicas = replica_folders(run)
    logdir = Path(run.output_dir) if replicas else Path(run.output_dir) / "runs"
    # Trainer writes event files under <output>/runs only with report_to tensorboard: otherwise nothing to show.
    if not any((folder / "runs").is_dir() for folder in replicas or [Path(run.output_dir)]):
        return ""
    return f"TensorBoard for this run: `tensorboard --logdir {logdir}`"


def card_preview(card: str) -> tuple[str, str]:
    """(metadata, body) of a model card: the YAML front matter apart, and images dropped (the curve is shown
    beside the card; a relative image path would be a broken image in the page)."""
    metadata, body = "", card
    if card.startswith("---\n") and "\n---\n" in card[4:]:
        metadata, body = card[4:].split("\n---\n", 1)
    body = "\n".join(line for line in body.splitlines() if not re.match(r"\s*!\[[^\]]*\]\([^)]*\)\s*$", line))
    return metadata.strip(), body.strip()


def plan_markdown(prediction: dict) -> str:
    """`hf-diloco plan --json` as the Launch tab shows it: what a round costs, one row per way to sync, and the
    cheapest setting that meets the target."""
    def mb(value: float) -> str:
        return f"{value / 1e6:,.2f}"

    rows = ["| method | codec | streamed | H | F | τ | MB per replica per round | wire s | blocked s | utilisation |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for row in prediction["rows"]:
        tau = row.get("sync_delay")
        rows.append(f"| {row['method']} | {row['codec']} | {'yes' if row['streaming'] else 'no'} | "
                    f"{row.get('inner_steps', '')} | {row.get('fragments', '')} | {'' if tau is None else tau} | "
                    f"{mb(row['bytes_per_replica_per_round'])} | {row['wire_seconds']:.2f} | "
                    f"{row['blocked_seconds']:.2f} | {100 * row['utilisation']:.1f}% |")
    best = prediction["recommendation"]
    verdict = "meets" if best.get("meets_target") else "is the best found; nothing tried meets"
    link = prediction["link"]
    header = (f"**Predicted** for {prediction['replicas']} replica(s) over {link['bits_per_second'] / 1e6:g} Mbit/s "
              f"with {1000 * link['latency_seconds']:g} ms a hop: "
              f"{prediction['compute_seconds_per_round']:.2f} s of compute per round, "
              f"memory per device {prediction['memory_per_device']}.")
    advice = (f"**Recommended:** H = {best['inner_steps']}, codec {best['codec']}, F = {best['fragments']}, "
              f"τ = {best['sync_delay'] if best.get('sync_delay') is not None else 0}: "
              f"{100 * best['utilisation']:.1f}% utilisation, {mb(best['bytes_per_replica_per_round'])} MB per "
              f"replica per round; it {verdict} the {100 * prediction['target_utilisation']:.0f}% target.")
    return "\n".join([header, "", *rows, "", advice])
