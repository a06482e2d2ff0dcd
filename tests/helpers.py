"""Shared helpers: launch real processes the way users do, and tiny deterministic models and data."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hf_diloco.launch import free_port, wait_for  # noqa: F401  (what every test starts and watches processes with)

REPO = Path(__file__).resolve().parents[1]
ACCELERATE_CPU_2PROC = REPO / "accelerate_configs" / "cpu-2proc.yaml"
ACCELERATE_CPU_4PROC = REPO / "accelerate_configs" / "cpu-4proc.yaml"
# The name of the all-gather into one tensor that hf_diloco.comm.gather_into calls on this torch.
GATHER = "all_gather_single" if hasattr(__import__("torch.distributed").distributed, "all_gather_single") \
    else "all_gather_into_tensor"


def env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1"}


def run(command: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, env=env(), timeout=timeout, cwd=REPO)
    return result


def accelerate_launch(target: list[str], timeout: int = 300, config: Path = ACCELERATE_CPU_2PROC):
    """`accelerate launch` with CPU processes (gloo) on a free port; `target` is a script or `-m module` args."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
               "--main_process_port", str(free_port()), *target]
    return run(command, timeout)


def hf_diloco(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "hf_diloco.cli", *args], timeout)


def tiny_llama(seed: int = 0, vocab: int = 64, positions: int = 16):
    """A 2-layer Llama small enough that tests train it in seconds."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=positions, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def pattern_blocks(n: int = 64, length: int = 16, vocab: int = 64) -> list[list[int]]:
    """Learnable sequences (arithmetic progressions mod vocab), so the loss visibly falls."""
    return [[(i * 7 + t * (1 + i % 3)) % vocab for t in range(length)] for i in range(n)]


def pattern_dataset(n: int = 64, length: int = 16, vocab: int = 64):
    from datasets import Dataset

    blocks = pattern_blocks(n, length, vocab)
    return Dataset.from_dict({"input_ids": blocks, "labels": blocks})


def replica_training_pid(output_dir: Path, replica: int) -> int | None:
    """The pid of a torchft replica's training process (not its accelerate launcher) writing
    `<output_dir>/replica-<replica>`."""
    import psutil

    for process in psutil.process_iter(["cmdline"]):
        argv = process.info["cmdline"] or []
        if "hf_diloco.cli" in argv and "train" in argv and "accelerate.commands.launch" not in argv \
                and str(Path(output_dir) / f"replica-{replica}") in argv:
            return process.pid
    return None
