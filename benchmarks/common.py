"""Shared by the benchmarks: the peer task, named variants, launching runs, the loop clock, spreads, reports.

Design choices:
- The peer task (DESIGN.md §6) is recipes/tiny-pretrain.yaml: tiny Llama (hidden 128, 4 layers, tied embeddings,
  seed 0, 256 positions), built-in corpus in 256-token blocks with the last 5% held out, batch 8 per replica,
  AdamW lr 1e-3 wd 0.1, 20 warmup steps then cosine, clip 1.0, DiLoCo H = 50, outer Nesterov SGD lr 0.7 momentum
  0.9. Every benchmark runs it through the CLI; `--quick` modes shrink steps, never the method.
- One clock for every row: tokens/s = tokens trained ÷ `train_runtime`, Trainer's wall time of its training loop
  (from just before the first step to the end of the last, the initial broadcast and every sync included). It is
  the same code for DiLoCoTrainer, plain Trainer baselines and the peers, none of which can start it late.
- A variant is a name and the CLI overrides it adds (`--compression int8 ...`); benchmarks take a list of them,
  so a codec or streaming row is one line in VARIANTS. Overrides are checked against the library's fields before
  anything runs, so a variant whose field does not exist yet fails in a second, not after an hour.
- A ratio's baseline runs in the same invocation, interleaved with what it divides and repeated; `spread` gives
  the median and the [min, max] of the repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this tree's hf_diloco, whichever the environment has installed
from hf_diloco.files import read_json  # noqa: E402
from hf_diloco.launch import free_port  # noqa: E402, F401  (the benchmarks' rendezvous ports)
from hf_diloco.metrics import read_summary, read_syncs  # noqa: E402

RECIPE = REPO / "recipes" / "tiny-pretrain.yaml"
RESULTS = REPO / "benchmarks" / "results"
BATCH, BLOCK = 8, 256  # the peer task's batch per replica and tokens per block (the recipe's values)

# Named variants of DiLoCo: name -> extra `hf-diloco train` flags. A codec or streaming row is one line here; the
# benchmarks run the ones named in their --variants (default: fp32 only, which is what fits the 30-minute full set).
# A variant with `--sync_delay` above 0 overlaps its sync with compute; the WAN benchmark bounds it accordingly.
VARIANTS: dict[str, list[str]] = {
    "fp32": [],  # the paper's DiLoCo: blocking fp32 all-reduce of the pseudo-gradients
    "bf16": ["--compression", "bf16"],
    "int8": ["--compression", "int8"],
    "int4+EF": ["--compression", "int4", "--error_feedback", "true"],
    "sparse+EF": ["--compression", "sparse", "--error_feedback", "true"],
    "streaming P=2 tau=5": ["--num_fragments", "2", "--sync_delay", "5", "--fragment_alpha", "0.5"],
    # SparseLoCo's own settings: the error-feedback accumulator (β = 0.95) plays momentum's role, outer SGD lr 1.
    "SparseLoCo": ["--compression", "sparse", "--error_feedback", "true", "--error_feedback_decay", "0.95",
                   "--outer_lr", "1.0", "--outer_momentum", "0.0"],
    # Streaming DiLoCo over a slow link: 5 fragments (embeddings + one per layer of the tiny Llama; H = 50 needs
    # H % F == 0, so the paper's F = 4 becomes 5 here), each overlapped with 2 inner steps, int4 + error feedback.
    "stream F=5 tau=2 int4+EF": ["--num_fragments", "5", "--sync_delay", "2", "--compression", "int4",
                                 "--error_feedback", "true"],
    # The same with τ chosen per fragment from its measured exchanges, and the end staggered (final_sync auto).
    "stream F=5 tau=auto int4+EF": ["--num_fragments", "5", "--sync_delay", "auto", "--compression", "int4",
                                    "--error_feedback", "true"],
    "stream F=5 tau=auto sparse+EF": ["--num_fragments", "5", "--sync_delay", "auto", "--compression", "sparse",
                                      "--error_feedback", "true"],
    # The same rounds on the torchft backend (a Lighthouse on the first host, one replica launch per host).
    "torchft fp32": ["--outer_backend", "torchft"],
    "torchft stream F=5 tau=2 int4+EF": ["--outer_backend", "torchft", "--num_fragments", "5", "--sync_delay", "2",
                                         "--compression", "int4", "--error_feedback", "true"],
}


# --- variants ----------------------------------------------------------------------------------------------------


def add_variant_arguments(parser: argparse.ArgumentParser, default: list[str] | None) -> None:
    """--variants and --variant; a default of None leaves the choice to the benchmark (it says so in its help)."""
    parser.add_argument("--variants", nargs="+", default=default, metavar="NAME",
                        help=f"named variants from common.VARIANTS (known: {', '.join(VARIANTS)}; default: "
                             f"{' '.join(default) if default else 'the task' + chr(39) + 's own list'})")
    parser.add_argument("--variant", action="append", default=[], metavar="'NAME=--field value ...'",
                        help="an extra variant given inline, e.g. 'int8=--compression int8' (repeatable)")


def selected_variants(args: argparse.Namespace) -> dict[str, list[str]]:
    """The variants asked for, each checked against the library's fields (exits with one sentence if not)."""
    chosen = {}
    for name in args.variants:
        if name not in VARIANTS:
            sys.exit(f"unknown variant {name!r}; known: {', '.join(VARIANTS)} (or give one inline with --variant).")
        chosen[name] = VARIANTS[name]
    for spec in args.variant:
        name, sep, flags = spec.partition("=")
        if not sep or not name.strip():
            sys.exit(f"--variant {spec!r} must look like 'NAME=--field value ...'.")
        chosen[name.strip()] = shlex.split(flags)
    for name, overrides in chosen.items():
        check_overrides(overrides, f"variant {name!r}")
    return chosen


def check_overrides(overrides: list[str], what: str) -> None:
    """Parse the recipe plus `overrides` as `hf-diloco train` would; exit with its one-sentence error if bad."""
    from hf_diloco.config import ConfigError
    from hf_diloco.recipes import parse_train_args

    try:
        parse_train_args(str(RECIPE), ["--output_dir", "unused", *overrides])
    except ConfigError as error:
        sys.exit(f"{what}: {error}")


def overlaps_compute(overrides: list[str]) -> bool:
    """Whether the variant's sync runs in the background of later inner steps (`--sync_delay` above 0, or auto)."""
    for i, flag in enumerate(overrides):
        value = flag.partition("=")[2] if "=" in flag else (overrides[i + 1] if i + 1 < len(overrides) else "0")
        if flag.split("=")[0] == "--sync_delay" and (value == "auto" or float(value) > 0):
            return True
    return False


# --- launching runs -----------------------------------------------------------------------------------------------


def train_command(processes: int, overrides: list[str], prefix: list[str] | None = None,
                  launch: list[str] | None = None, recipe: Path = RECIPE) -> list[str]:
    """The `hf-diloco train` command of `recipe` for `processes` replicas (accelerate launch over gloo when more
    than one)."""
    train = ["-m", "hf_diloco.cli", "train", "--config", str(recipe), "--disable_tqdm", "true", *overrides]
    if processes == 1 and launch is None:
        return [*(prefix or []), sys.executable, *train]
    launch = launch or ["--multi_gpu", "--num_processes", str(processes), "--num_machines", "1",
                        "--main_process_port", str(free_port())]
    return [*(prefix or []), sys.executable, "-m", "accelerate.commands.launch", *launch, "--mixed_precision", "no",
            "--dynamo_backend", "no", *train]


def run_env(threads: int = 1, **extra: str) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            **extra}


class RunFailed(RuntimeError):
    """A benchmark run exited non-zero; the message holds the command and the end of its output."""


class Processes:
    """Processes started together; their output is read as it comes (`on_line` sees the first one's lines)."""

    def __init__(self, commands: list[list[str]], cwd: Path = REPO, on_line: Callable[[str], None] | None = None):
        self.commands = commands
        # Each in its own session, so that a failure or an interrupt can end the launcher and its children together.
        self.procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                       env=run_env(1), cwd=cwd, start_new_session=True) for c in commands]
        self.tails: list[list[str]] = [[] for _ in commands]
        self.readers = [threading.Thread(target=self._read, args=(i, on_line if i == 0 else None), daemon=True)
                        for i in range(len(commands))]
        for reader in self.readers:
            reader.start()

    def _read(self, index: int, on_line) -> None:
        for line in self.procs[index].stdout:
            if on_line is not None:
                on_line(line)
            tail = self.tails[index]
            tail.append(line)
            del tail[:-60]

    def stop(self, grace_seconds: float = 10) -> None:
        """End every process (a server the runs needed): SIGTERM, then SIGKILL after the grace period."""
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.time() + grace_seconds
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def wait(self, timeout: float = 1800) -> None:
        """Wait for all; if one fails (or time runs out) end the others, then raise RunFailed."""
        deadline = time.time() + timeout
        try:
            while any(p.poll() is None for p in self.procs):
                if time.time() > deadline or any(p.poll() not in (None, 0) for p in self.procs):
                    break
                time.sleep(0.2)
        finally:
            for proc in self.procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        for reader in self.readers:
            reader.join(timeout=5)
        failed = [i for i, p in enumerate(self.procs) if p.returncode != 0]
        if failed:
            first = min(failed, key=lambda i: self.procs[i].returncode == -signal.SIGKILL)  # not one we ended
            raise RunFailed(f"benchmark run failed (exit {self.procs[first].returncode}: "
                            f"{shlex.join(self.commands[first])}):\n{''.join(self.tails[first])[-3000:]}")


def run_training(output_dir: Path, processes: int, overrides: list[str]) -> dict:
    """Train one configuration to completion on this machine and return what it left behind."""
    Processes([train_command(processes, ["--output_dir", str(output_dir), *overrides])]).wait()
    return read_run(output_dir)


def run_concurrently(jobs: list[tuple[Path, int, list[str]]], cores: int = os.cpu_count() or 2,
                     recipes: list[Path] | None = None) -> list[dict]:
    """Run (output_dir, processes, overrides) jobs, as many at a time as fit one process per core; for runs whose
    loss is measured, not their speed. `recipes`: each job's recipe (tiny-pretrain.yaml by default)."""
    results: dict[int, dict] = {}
    pending = list(enumerate(jobs))
    running: list[tuple[int, int, Processes]] = []
    while pending or running:
        while pending and (not running or sum(p for _, p, _ in running) + pending[0][1][1] <= cores):
            index, (out, processes, overrides) = pending.pop(0)
            print(f"  start {out.name} ({processes} process{'es' if processes > 1 else ''})", flush=True)
            command = train_command(processes, ["--output_dir", str(out), *overrides],
                                    recipe=recipes[index] if recipes else RECIPE)
            running.append((index, processes, Processes([command])))
        time.sleep(0.5)
        for item in [r for r in running if all(p.poll() is not None for p in r[2].procs)]:
            running.remove(item)
            item[2].wait()
            results[item[0]] = read_run(jobs[item[0]][0])
    return [results[i] for i in range(len(jobs))]


def read_run(output_dir: Path) -> dict:
    """What a finished run left behind: run_metrics.json, and for DiLoCo the summary and the rounds."""
    result = {"metrics": read_json(output_dir / "run_metrics.json")}
    summary = read_summary(output_dir)
    if summary:
        result["summary"], result["rounds"] = summary, read_syncs(output_dir)
    return result


def loop_seconds(result: dict) -> float:
    """Trainer's wall time of the training loop (the one clock of every benchmark)."""
    return float(result["metrics"]["train_runtime"])


def loop_tokens_per_second(result: dict, replicas: int) -> float:
    """Tokens all replicas trained ÷ the loop's wall time."""
    return result["metrics"]["global_step"] * BATCH * BLOCK * replicas / loop_seconds(result)


def dropped_tokens(replica_folders: list[Path], whole_sync: bool = False) -> int:
    """Tokens of the steps an overlapped sync's mix landing (α 0) dropped: replica k's records (in
    `replica_folders[k]`) give, per committed sync, its `in_flight_steps`, trained after the launch and counted in
    the next committed sync's tokens, while the landing took them out of its parameters; at its tokens per step
    there (none where it sat that sync out: those tokens were never merged). `whole_sync`: the torch backend's one
    folder, whose records carry replica 0's `in_flight_steps` only; every replica trained the same seconds while
    the sync was in flight (they land together), so the next sync's tokens are taken in replica 0's share."""
    dropped = 0
    for k, folder in enumerate(replica_folders):
        records = [r for r in read_syncs(folder) if r.get("committed", True)]
        for record, following in zip(records, records[1:], strict=False):
            own = next((m for m in following["replicas"] if m["replica"] == k and m.get("steps")), None)
            if record.get("in_flight_steps") and own:
                share = min(1.0, record["in_flight_steps"] / own["steps"])
                dropped += round(share * (following["tokens"] if whole_sync else own["tokens"]))
    return dropped


def parameter_hash(model_dir: Path) -> str:
    """SHA-256 over a saved model's parameters (names, shapes, fp32 bytes), in the model's order."""
    import hashlib

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(f"{name}{tuple(param.shape)}".encode())
        digest.update(param.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


# --- statistics and reports ------------------------------------------------------------------------------------


def spread(values: list[float]) -> dict:
    """Median and [min, max] of repeated measurements."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": list(values)}


def spread_errors(spreads: list[dict], scale: float = 1.0) -> list[list[float]]:
    """The [below, above] distances from each spread's median to its min and max, as matplotlib's xerr/yerr take
    them (times `scale`, e.g. 100 for percentages)."""
    return [[scale * (s["median"] - s["min"]) for s in spreads], [scale * (s["max"] - s["median"]) for s in spreads]]


def spread_bars(labels: list[str], spreads: list[dict], colors: list[str], ylabel: str, title: str,
                size: tuple[float, float]):
    """A bar per spread at its median, with [min, max] error bars; returns (figure, axes). More than six bars are
    drawn across, one under the other, so that their labels stay readable (`size`'s width kept)."""
    if len(labels) > 6:
        fig, ax = pyplot().subplots(figsize=(max(size[0], 9.0), 0.45 * len(labels) + 1.2))
        ax.barh(labels, [s["median"] for s in spreads], xerr=spread_errors(spreads), capsize=4, color=colors)
        ax.invert_yaxis()  # the first label on top, as in the table
        ax.set_xlabel(ylabel)
    else:
        fig, ax = pyplot().subplots(figsize=size)
        ax.bar(labels, [s["median"] for s in spreads], yerr=spread_errors(spreads), capsize=4, color=colors)
        ax.set_ylabel(ylabel)
    ax.set_title(title)
    return fig, ax


def show(s: dict, pattern: str = "{:,.0f}") -> str:
    """'median [min, max]' of a spread."""
    return f"{pattern.format(s['median'])} [{pattern.format(s['min'])}, {pattern.format(s['max'])}]"


def markdown_table(headers: list[str], rows: list[list]) -> str:
    def cell(value):
        if isinstance(value, float):
            return f"{value:,.4f}" if abs(value) < 10 else f"{value:,.0f}"
        return str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def machine() -> str:
    try:
        load = f"load average at start {os.getloadavg()[0]:.2f}"
    except OSError:
        load = "load average unknown"
    return f"{platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}, {load}"


MACHINE_AT_START = machine()


def work_folder(base: Path, quick: bool, resume: bool) -> Path:
    """A benchmark's scratch folder (`base`/quick or /full), emptied first unless `resume` reads back what an
    interrupted invocation finished there."""
    work = base / ("quick" if quick else "full")
    if work.exists() and not resume:
        subprocess.run(["rm", "-rf", str(work)], check=True)
    return work


def curve_panels(panels: dict[str, list[tuple[dict, str, str]]], xlabel: str, ylabel: str):
    """One panel per name, each drawing its curves ({x: y}, label, colour) with markers; shared y axis, the first
    panel's legend. Returns the figure."""
    figure, axes = pyplot().subplots(1, len(panels), figsize=(4 * len(panels), 3.4), sharey=True, squeeze=False)
    for ax, (name, curves) in zip(axes[0], panels.items(), strict=True):
        for curve, label, color in curves:
            ax.plot(sorted(curve), [curve[x] for x in sorted(curve)], label=label, color=color, marker=".")
        ax.set_title(name)
        ax.set_xlabel(xlabel)
    axes[0][0].set_ylabel(ylabel)
    axes[0][0].legend(fontsize=8)
    return figure


def save(name: str, table: str, raw: dict, figure=None, quick: bool = False, seconds: float | None = None,
         folder: Path = RESULTS) -> None:
    """Print the table and write <folder>/<name>.md, .json and .png (results/ by default; a quick run says so in all
    three)."""
    folder.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    mode = "quick run (--quick: fewer steps, same method)" if quick else "full run"
    took = f", {seconds:.0f} s" if seconds is not None else ""
    text = f"{table}\n\n_{mode}, {stamp}, {MACHINE_AT_START}{took}_\n"
    print(text)
    (folder / f"{name}.md").write_text(text)
    meta = {"date": stamp, "machine": MACHINE_AT_START, "quick": quick, "seconds": seconds}
    (folder / f"{name}.json").write_text(json.dumps({**meta, **raw}, indent=2) + "\n")
    if figure is not None:
        if quick:
            figure.text(0.99, 0.01, "quick run", ha="right", va="bottom", fontsize=8, color="#888")
        figure.savefig(folder / f"{name}.png", dpi=120, bbox_inches="tight")
        print(f"plot: {folder / f'{name}.png'}")


def skip(benchmark: str, reason: str) -> None:
    """A benchmark that cannot run on this machine says why in one sentence and exits 0 without results."""
    print(f"{benchmark}: skipped: {reason}", flush=True)
    sys.exit(0)


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
