"""Shared by the benchmarks: the peer task, launching runs through the CLI, tables, plots, raw JSON.

The peer task (DESIGN.md §6) is tiny-pretrain.yaml: tiny Llama (hidden 128, 4 layers, tied embeddings, seed 0),
built-in corpus in 256-token blocks with the last 5% held out, batch 8 per replica, AdamW lr 1e-3, wd 0.1,
20 warmup steps then cosine, clip 1.0. `--quick` modes shrink steps and blocks, never the method.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "tiny-pretrain.yaml"
RESULTS = REPO / "benchmarks" / "results"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_command(processes: int, overrides: list[str], prefix: list[str] | None = None,
                  launch: list[str] | None = None) -> list[str]:
    """The `hf-diloco train` command for `processes` replicas (accelerate launch over gloo when more than one)."""
    train = ["-m", "hf_diloco.cli", "train", "--config", str(RECIPE), "--disable_tqdm", "true", *overrides]
    if processes == 1 and launch is None:
        return [*(prefix or []), sys.executable, *train]
    launch = launch or ["--multi_gpu", "--num_processes", str(processes), "--num_machines", "1",
                        "--main_process_port", str(free_port())]
    return [*(prefix or []), sys.executable, "-m", "accelerate.commands.launch", *launch, "--mixed_precision", "no",
            "--dynamo_backend", "no", *train]


def run_env(threads: int = 1, **extra: str) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            **extra}


def read_run(output_dir: Path) -> dict:
    """What a finished run left behind: run_metrics.json, and for DiLoCo the summary and the rounds."""
    result = {"metrics": json.loads((output_dir / "run_metrics.json").read_text())}
    summary = output_dir / "diloco_summary.json"
    if summary.exists():
        result["summary"] = json.loads(summary.read_text())
        result["rounds"] = [json.loads(line) for line in (output_dir / "sync_rounds.jsonl").read_text().splitlines()]
    return result


def tokens_per_second(result: dict, replicas: int) -> float:
    """Steady tokens/s of a run over all its replicas (the main replica's rate; replicas step in lockstep)."""
    return result["metrics"]["steady_tokens_per_second"] * replicas


def run_training(output_dir: Path, processes: int, overrides: list[str], threads: int = 1, **kwargs) -> dict:
    """Train one configuration to completion and return its numbers plus the wall time."""
    command = train_command(processes, ["--output_dir", str(output_dir), *overrides], **kwargs)
    started = time.time()
    result = subprocess.run(command, capture_output=True, text=True, env=run_env(threads), cwd=REPO)
    if result.returncode != 0:
        sys.exit(f"benchmark run failed ({' '.join(command)}):\n{result.stderr[-3000:]}")
    return {**read_run(output_dir), "wall_seconds": time.time() - started}


def markdown_table(headers: list[str], rows: list[list]) -> str:
    def cell(value):
        if isinstance(value, float):
            return f"{value:,.4f}" if abs(value) < 10 else f"{value:,.0f}"
        return str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}"


def save(name: str, table: str, raw: dict, figure=None) -> None:
    """Print the table and write results/<name>.md, .json and .png."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d %H:%M")
    text = f"{table}\n\n_{stamp}, {machine()}_\n"
    print(text)
    (RESULTS / f"{name}.md").write_text(text)
    (RESULTS / f"{name}.json").write_text(json.dumps({"date": stamp, "machine": machine(), **raw}, indent=2) + "\n")
    if figure is not None:
        figure.savefig(RESULTS / f"{name}.png", dpi=120, bbox_inches="tight")
        print(f"plot: {RESULTS / f'{name}.png'}")
