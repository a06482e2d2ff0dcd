"""Shared helpers: launch real processes the way users do, and tiny deterministic models and data."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from hf_diloco.launch import free_port, wait_for  # noqa: F401  (what every test starts and watches processes with)

REPO = Path(__file__).resolve().parents[1]
ACCELERATE_CPU_2PROC = REPO / "accelerate_configs" / "cpu-2proc.yaml"
ACCELERATE_CPU_4PROC = REPO / "accelerate_configs" / "cpu-4proc.yaml"
TORCHFT_REPLICA = REPO / "accelerate_configs" / "torchft-replica.yaml"  # one process per replica
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


def train_runs_command(runs: list[dict], config: Path, processes: int | None = None) -> list[str]:
    """The launch that trains `runs` (tests/scripts/train_runs.py) as `hf-diloco launch` starts its processes."""
    from hf_diloco.runs import LAUNCHER

    return [sys.executable, "-m", LAUNCHER, "--config_file", str(config), "--main_process_port", str(free_port()),
            *(["--num_processes", str(processes)] if processes else []),
            str(REPO / "tests" / "scripts" / "train_runs.py"), json.dumps(runs)]


def train_runs(runs: list[dict], config: Path = ACCELERATE_CPU_2PROC, processes: int | None = None,
               environ: dict[str, str] | None = None, timeout: int = 1200) -> subprocess.CompletedProcess:
    """Several `hf-diloco train` runs in one launch (tests/scripts/train_runs.py: each {"name", "recipe", "args",
    "env"}, trained in turn by the same processes, through what `hf-diloco train` runs), started as `hf-diloco
    launch` starts its processes (hf_diloco.accelerate_launch with `config`, `processes` of them if given). The
    launch's own checks are tests/test_launch_checks.py's. Asserts it exits 0; returns it."""
    result = subprocess.run(train_runs_command(runs, config, processes), cwd=REPO, env={**env(), **(environ or {})},
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result


def start_train_runs(runs: list[dict], config: Path, log: Path) -> subprocess.Popen:
    """`train_runs` started in the background, its console to `log` (torchft replicas: one launch each, together)."""
    return subprocess.Popen(train_runs_command(runs, config), cwd=REPO, env=env(), stdout=log.open("w"),
                            stderr=subprocess.STDOUT)


# Runs of tests/scripts/replica_run.py that several modules train in one launch per accelerate config (the start-up
# of a launch is most of a tiny run's time). A module declares its runs when it is imported (`share`), which pytest
# does for every collected module before any test runs; the session fixture `shared_runs` (tests/conftest.py)
# trains every declared run of a config, in declaration order (`first`: ahead of the rest), the first time a test
# asks for one, and gives each module its own: name → (folder, every rank's record).
SHARED: dict[Path, dict[str, tuple[bool, Callable[[Path], dict[str, dict]]]]] = {}


def share(key: str, runs: Callable[[Path], dict[str, dict]] | dict[str, dict], config: Path = ACCELERATE_CPU_2PROC,
          first: bool = False) -> None:
    """Declare the runs module `key` reads through `shared_runs(key, config)`: name → settings, or a function that
    makes them given their folder (models to write first). `first`: trained before the others' runs (runs whose
    timing is measured, in processes fresh from start)."""
    SHARED.setdefault(config, {})[key] = (first, runs if callable(runs) else lambda _folder: runs)


def train_shared(folder: Path, config: Path) -> dict[str, dict[str, tuple[Path, list[dict]]]]:
    """Every run declared for `config`, in one launch: key → name → (folder, every rank's record)."""
    declared = sorted(SHARED.get(config, {}).items(), key=lambda item: not item[1][0])
    runs = {key: make(folder / key) for key, (_, make) in declared}
    trained = replica_runs(folder, {f"{key}/{name}": settings for key, named in runs.items()
                                    for name, settings in named.items()}, config, timeout=1500)
    return {key: {name: (folder / key / name, trained[f"{key}/{name}"]) for name in named}
            for key, named in runs.items()}


def replica_runs(folder: Path, runs: dict[str, dict], config: Path = ACCELERATE_CPU_2PROC, timeout: int = 600,
                 script: str = "replica_run.py") -> dict[str, list[dict]]:
    """Several runs of tests/scripts/replica_run.py (or `script`, which takes a list of runs alike) in one
    `accelerate launch`, trained in turn by the same processes (a launch of the tiny model spends most of its time
    starting Pythons): `runs` maps a name to its settings, each run writes into `folder / name`. Returns name →
    every rank's record."""
    import yaml

    processes = yaml.safe_load(Path(config).read_text())["num_processes"]
    payload = [{**settings, "out": str(folder / name)} for name, settings in runs.items()]
    for run in payload:
        Path(run["out"]).mkdir(parents=True, exist_ok=True)
    result = accelerate_launch([str(REPO / "tests" / "scripts" / script), json.dumps(payload)], timeout=timeout,
                               config=config)
    assert result.returncode == 0, f"replica runs failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return {name: [json.loads((folder / name / f"rank{r}.json").read_text()) for r in range(processes)]
            for name in runs}


def hf_diloco(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "hf_diloco.cli", *args], timeout)


def cli(*args: str, environ: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`hf-diloco ARGS` run inside this process, from the repository as `hf_diloco` runs it, with `environ` added to
    the environment: its exit status, stdout and stderr as the process would give them. For what starts nothing (a
    refusal, a dry run, help): the code path is the command's own (`hf_diloco.cli.main`, as the app's checker runs
    it), without the seconds a new interpreter spends importing torch."""
    from hf_diloco.checker import run_inside

    with contextlib.chdir(REPO):
        answer = run_inside(list(args), environ)
    return subprocess.CompletedProcess(["hf-diloco", *args], answer["returncode"], answer["stdout"], answer["stderr"])


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


def is_launcher(argv: list[str]) -> bool:
    """Whether a process's command line is an accelerate launcher's (as the tests or hf-diloco start one)."""
    return "accelerate.commands.launch" in argv or "hf_diloco.accelerate_launch" in argv


class ListenerWatch:
    """Every listener of a running launch, read by listeners_while_running in a thread beside whatever the test does
    with the launch (kill a replica, look for a token): `result()` once the launch has exited."""

    def __init__(self, launcher):
        import threading

        self.found = None
        self.thread = threading.Thread(target=self._watch, args=(launcher,), daemon=True)
        self.thread.start()

    def _watch(self, launcher) -> None:
        self.found = listeners_while_running(launcher)

    def result(self) -> tuple[set[str], dict[int, set[int]], dict[int, bool]]:
        self.thread.join(timeout=30)
        assert self.found is not None, "the launch was still running"
        return self.found


def listeners_while_running(launcher) -> tuple[set[str], dict[int, set[int]], dict[int, bool]]:
    """Every listener of `launcher` (a Popen) and its processes, read with psutil every 0.1 s until it exits: the
    addresses listened on, the ports of each training process (pid -> ports), and for each port whether a
    connection to this machine's external address, tried as soon as the port was seen, was accepted."""
    import contextlib
    import socket
    import time

    import psutil

    external = next(a.address for addresses in psutil.net_if_addrs().values() for a in addresses
                    if a.family == socket.AF_INET and not a.address.startswith("127."))
    addresses: set[str] = set()
    ports: dict[int, set[int]] = {}
    reachable: dict[int, bool] = {}
    try:
        while launcher.poll() is None:
            with contextlib.suppress(psutil.Error):
                for process in [psutil.Process(launcher.pid), *psutil.Process(launcher.pid).children(recursive=True)]:
                    with contextlib.suppress(psutil.Error):
                        listening = [c.laddr for c in process.net_connections(kind="inet")
                                     if c.status == psutil.CONN_LISTEN]
                        addresses.update(a.ip for a in listening)
                        for port in {a.port for a in listening} - reachable.keys():
                            with socket.socket() as probe:
                                probe.settimeout(2)
                                reachable[port] = probe.connect_ex((external, port)) == 0
                        argv = process.cmdline()
                        if "train" in argv and not is_launcher(argv):
                            ports.setdefault(process.pid, set()).update(a.port for a in listening)
            time.sleep(0.1)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    return addresses, ports, reachable


def replica_training_pid(output_dir: Path, replica: int) -> int | None:
    """The pid of a torchft replica's training process (not its accelerate launcher) writing
    `<output_dir>/replica-<replica>`."""
    import psutil

    for process in psutil.process_iter(["cmdline"]):
        argv = process.info["cmdline"] or []
        if "hf_diloco.cli" in argv and "train" in argv and not is_launcher(argv) \
                and str(Path(output_dir) / f"replica-{replica}") in argv:
            return process.pid
    return None


@contextlib.contextmanager
def lighthouse(min_replicas: int, grace: float, heartbeat: float = 2.0, log: Path | None = None):
    """`hf-diloco lighthouse` on a free port of 127.0.0.1, logging to a file; yields its address."""
    port = free_port()
    log = log or Path(os.environ.get("TMPDIR", "/tmp")) / f"lighthouse-{port}.log"
    process = subprocess.Popen(
        [sys.executable, "-m", "hf_diloco.cli", "lighthouse", "--host", "127.0.0.1", "--port", str(port),
         "--min-replicas", str(min_replicas), "--grace-seconds", str(grace), "--heartbeat-timeout", str(heartbeat)],
        stdout=log.open("w"), stderr=subprocess.STDOUT, env=env(), cwd=REPO)
    try:
        wait_for(lambda: "Lighthouse on" in log.read_text(), 60, "the Lighthouse to start")
        yield f"http://127.0.0.1:{port}"
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=20)


def corrupted_corpora(folder: Path) -> dict[str, Path]:
    """The built-in corpus as JSON lines, and its corrupted copies: `garbage`, the documents that make up replica 0's
    third of the blocks (non_iid) replaced by random printable characters of the same length (the other replicas'
    blocks and the held-out set, the last 5%, are untouched); `garbage-half`, the same for replica 0's half at M = 2;
    `permuted`, every character mapped through one fixed permutation, as data read with another tokenizer would be,
    and `permuted-third`, only replica 0's third so. Name → path."""
    import json
    import random

    from hf_diloco.data import builtin_corpus

    folder.mkdir(parents=True, exist_ok=True)
    texts = list(builtin_corpus()["text"])
    rng = random.Random(0)
    codes = list(range(32, 127))
    random.Random(1).shuffle(codes)
    mapping = {chr(32 + i): chr(c) for i, c in enumerate(codes)}
    total, seen = sum(map(len, texts)), 0
    copies: dict[str, list[str]] = {"clean": texts, "garbage": [], "garbage-half": [], "permuted": [],
                                    "permuted-third": []}
    for text in texts:
        seen += len(text)
        noise = "".join(chr(rng.randint(32, 126)) for _ in text)
        permuted = "".join(mapping.get(ch, ch) for ch in text)
        copies["garbage"].append(noise if seen <= 0.30 * total else text)
        copies["garbage-half"].append(noise if seen <= 0.45 * total else text)
        copies["permuted"].append(permuted)
        copies["permuted-third"].append(permuted if seen <= 0.30 * total else text)
    paths = {}
    for name, corpus in copies.items():
        paths[name] = folder / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps({"text": text}) + "\n" for text in corpus))
    return paths


# Tiny models of each architecture the matrix covers, built from small configs (vocabulary: the byte tokenizer's).
ARCHITECTURES = {
    "llama": ("LlamaConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, tie_word_embeddings=True)),
    "gpt2": ("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, n_positions=256)),
    "qwen3": ("Qwen3Config", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16)),
    "qwen3-moe": ("Qwen3MoeConfig", dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                         num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         decoder_sparse_step=1)),
    "gemma3": ("Gemma3TextConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16)),
    "mistral": ("MistralConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)),
    "bert-masked-lm": ("BertConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4)),
    "t5": ("T5Config", dict(d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16)),
}


def tiny_model_folder(kind: str, folder: Path, tokenizer: bool = True) -> Path:
    """A freshly initialised tiny model of architecture `kind` (ARCHITECTURES), saved with `save_pretrained` to
    `folder` as a user's own model would be, with the byte tokenizer beside it unless `tokenizer` is False."""
    import torch
    import transformers

    from hf_diloco.models import byte_tokenizer

    config_class, settings = ARCHITECTURES[kind]
    byte = byte_tokenizer()
    config = getattr(transformers, config_class)(vocab_size=len(byte), pad_token_id=byte.pad_token_id,
                                                 bos_token_id=byte.eos_token_id, eos_token_id=byte.eos_token_id,
                                                 **settings)
    head = {"bert-masked-lm": transformers.BertForMaskedLM, "t5": transformers.T5ForConditionalGeneration}.get(
        kind, transformers.AutoModelForCausalLM)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = head.from_config(config) if head is transformers.AutoModelForCausalLM else head(config)
    model.save_pretrained(folder)
    if tokenizer:
        byte.save_pretrained(folder)
    return folder
