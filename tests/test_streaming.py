"""Streamed corpora (`streaming: true`, or a `datasets.IterableDataset` handed to DiLoCoTrainer) across real
replica processes: each replica reads its own part, no document twice in an epoch and none held out, and a corpus
larger than the processes' memory trains."""

import json
from pathlib import Path

import pytest
from helpers import accelerate_launch

SCRIPT = Path(__file__).parent / "scripts" / "stream_run.py"
BLOCK = 32


def write_documents(path: Path, count: int) -> None:
    """`count` documents of exactly BLOCK - 1 bytes, so that with the byte tokenizer and EOS each is one block."""
    path.write_text("".join(json.dumps({"text": f"doc-{i:05d} ".ljust(BLOCK - 1, "x")}) + "\n"
                            for i in range(count)))


MODES = ["cli, one file: every other document", "python, 4 shards: 2 each", "sft, one file of conversations"]


@pytest.fixture(scope="module")
def streams(tmp_path_factory) -> dict[str, tuple[list[list[int]], set[int], int]]:
    """mode → (each rank's documents in the order it trained on them, the held-out documents, one epoch's rows),
    the three modes trained in turn by one launch of two processes."""
    folder = tmp_path_factory.mktemp("streams")

    def common(name: str) -> list[str]:
        return ["--streaming", "true", "--eval_blocks", "4", "--max_steps", "12", "--inner_steps", "4",
                "--per_device_train_batch_size", "2", "--eval_strategy", "no", "--output_dir",
                str(folder / name / "run"), "--save_strategy", "no", "--save_every_rounds", "0", "--report_to",
                "none", "--disable_tqdm", "true"]

    chats, corpus = folder / "chats.jsonl", folder / "corpus.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q-{i:05d}"},
                                                      {"role": "assistant", "content": "a"}]}) + "\n"
                             for i in range(40)))
    write_documents(corpus, 40)
    runs = {
        MODES[0]: {"mode": "cli", "args": ["--dataset_name", str(corpus), "--block_size", str(BLOCK), *common("cli")]},
        MODES[1]: {"mode": "python", "documents": 40, "shards": 4, "inner_steps": 4, "max_steps": 12, "batch": 2},
        MODES[2]: {"mode": "cli", "args": ["--config", "recipes/sft-lora.yaml", "--dataset_name", str(chats),
                                           "--max_length", "64", *common("sft")]},
    }
    outs = {mode: folder / f"mode{i}" for i, mode in enumerate(runs)}
    for out in outs.values():
        out.mkdir()
    result = accelerate_launch([str(SCRIPT), json.dumps([{"out": str(outs[m]), **s} for m, s in runs.items()])],
                               timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    held_out = {MODES[0]: (set(range(4)), 18), MODES[1]: (set(), 20), MODES[2]: (set(range(4)), 18)}
    return {mode: ([[d for step in json.loads((outs[mode] / f"rank{r}.json").read_text()) for d in step]
                    for r in range(2)], *held_out[mode]) for mode in runs}


@pytest.mark.process
@pytest.mark.parametrize("mode", MODES)
def test_each_replica_trains_its_own_part_of_a_stream_once_per_epoch(streams, mode):
    """40 one-block documents, 2 replicas, batch 2. `hf-diloco train` on one jsonl file (datasets gives each
    replica every other document) holding out the first 4; DiLoCoTrainer handed a stream of 4 shards (each replica
    reads two whole shards); `trainer: sft` (recipes/sft-lora.yaml) on 40 conversations in one jsonl file, the
    first 4 held out. Within its first epoch a replica trains on each document of its part once, the parts are
    disjoint and together cover every training document; the second epoch reads the same part again."""
    seen, held_out, epoch = streams[mode]
    assert [len(s) for s in seen] == [24, 24]  # 12 steps of 2 rows
    first = [s[:epoch] for s in seen]
    for part in first:
        assert len(set(part)) == epoch, f"a document was trained on twice in one epoch: {sorted(part)}"
    assert not set(first[0]) & set(first[1]), "the replicas' parts overlap"
    assert set(first[0]) | set(first[1]) == set(range(40)) - held_out
    for part, whole in zip(seen, first, strict=True):
        assert part[epoch:] == whole[: len(part) - epoch], "the second epoch reads the part in the same order"


LIMIT = 1_200_000_000  # bytes for the launcher and both replicas together (they take about 0.93 GB here)


@pytest.mark.process
def test_a_streamed_corpus_larger_than_the_processes_memory_trains(tmp_path, memory_limit):
    """A 1.3 GB text corpus (1.3 million 1 KB documents) streamed by `hf-diloco train` on 2 replicas whose launch
    runs in a memory cgroup of 1.2 GB: it trains its 20 steps (2 rounds) and exits 0; the group never held more
    than its limit (the kernel would have ended a replica) and holding the corpus would not fit."""
    import os
    import subprocess
    import sys

    from helpers import ACCELERATE_CPU_2PROC, env, free_port

    group = memory_limit(LIMIT)
    corpus = tmp_path / "corpus.txt"
    filler = "streamed text " * 72
    with corpus.open("w") as out:
        for start in range(0, 1_300_000, 10_000):
            out.write("".join(f"{i:07d} {filler}\n" for i in range(start, start + 10_000)))
    assert corpus.stat().st_size > LIMIT
    settings = {"out": str(tmp_path), "mode": "cli", "record": False, "args": [
        "--dataset_name", str(corpus), "--streaming", "true", "--eval_blocks", "8", "--block_size", "256",
        "--max_steps", "20", "--inner_steps", "10", "--per_device_train_batch_size", "4", "--eval_strategy", "no",
        "--output_dir", str(tmp_path / "run"), "--save_strategy", "no", "--save_every_rounds", "0",
        "--report_to", "none", "--disable_tqdm", "true"]}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE_CPU_2PROC),
               "--main_process_port", str(free_port()), str(SCRIPT), json.dumps(settings)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, env=env(), timeout=300,
                                preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())))
        peak = int((group / "memory.max_usage_in_bytes").read_text())
    finally:
        corpus.unlink()
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "run_metrics.json").read_text())["global_step"] == 20
    assert peak <= LIMIT


def test_a_stream_split_for_another_layout_is_refused_and_one_split_for_this_replica_kept():
    """DiLoCoTrainer splits a stream for its replica itself; one the user split already is kept when it is this
    replica's part and refused in one sentence when it was split for another number of replicas."""
    from datasets import Dataset
    from datasets.distributed import split_dataset_by_node

    from hf_diloco.config import ConfigError
    from hf_diloco.data import split_stream

    stream = Dataset.from_dict({"x": list(range(12))}).to_iterable_dataset(num_shards=2)
    assert [r["x"] for r in split_stream(stream, 1, 2)] == list(range(6, 12))
    mine = split_dataset_by_node(stream, rank=1, world_size=2)
    assert split_stream(mine, 1, 2) is mine
    with pytest.raises(ConfigError, match="split as part 1 of 3, and this process trains data shard 1 of 2"):
        split_stream(split_dataset_by_node(stream, rank=1, world_size=3), 1, 2)
