"""Text corpora as `datasets.Dataset`s, tokenized into fixed-length blocks with a held-out tail.

Design choices:
- The built-in corpus is the stdlib's `pydoc_data.topics` (≈ 465k characters of Python reference prose, present on
  every CPython), one row per topic in sorted order: no download, identical on every machine.
- Any other corpus goes through `datasets.load_dataset`: a local file (by extension), a local folder, a folder
  written by `save_to_disk`, or a Hub id.
- Texts are joined with EOS and cut into `block_size` blocks (the remainder is dropped); labels are the inputs
  (the model shifts them). The last `eval_fraction` of the blocks is held out, so evaluation text is never trained
  on and is the same for every replica count.
- Sharding across replicas needs no communication. i.i.d. (default): Accelerate hands each process every M-th batch
  of one seeded shuffle. Non-i.i.d.: `ReplicaSliceSampler` gives replica r the r-th contiguous slice of the
  corpus (the built-in corpus is in topic order, so each replica gets its own topics), shuffled within the slice.
"""

from __future__ import annotations

import os

import torch
from datasets import Dataset, DatasetDict, load_dataset, load_from_disk
from torch.utils.data import Sampler

from .config import ConfigError, RunArguments

BUILTIN = "builtin"
FILE_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def builtin_corpus() -> Dataset:
    """The stdlib's pydoc topics as a dataset with columns `topic` and `text`."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    return Dataset.from_dict({"topic": names, "text": [topics[name] for name in names]})


def load_text_dataset(name: str, config: str | None = None, text_column: str = "text") -> Dataset:
    """Load a corpus and check it has `text_column`."""
    if name == BUILTIN:
        dataset = builtin_corpus()
    else:
        dataset = _load(name, config)
    if text_column not in dataset.column_names:
        raise ConfigError(
            f"dataset {name!r} has no text column {text_column!r} (its columns: {', '.join(dataset.column_names)}); "
            f"set text_column to the column that holds the text."
        )
    return dataset


def _load(name: str, config: str | None) -> Dataset:
    path = os.path.expanduser(name)
    try:
        if os.path.isfile(path):
            builder = FILE_BUILDERS.get(os.path.splitext(path)[1].lower())
            if builder is None:
                raise ConfigError(
                    f"dataset file {name!r} has an unknown extension; use one of {', '.join(FILE_BUILDERS)}."
                )
            loaded = load_dataset(builder, data_files=path)
        elif os.path.isdir(path) and os.path.exists(os.path.join(path, "dataset_info.json")):
            loaded = load_from_disk(path)
        elif os.path.isdir(path):
            loaded = load_dataset(path, config)
        elif name.startswith((".", "/", "~")):
            raise ConfigError(f"dataset path {name!r} does not exist.")
        else:
            loaded = load_dataset(name, config)
    except ConfigError:
        raise
    except Exception as error:  # datasets raises many types; the user needs the one-line reason
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(f"could not load dataset {name!r}: {reason}") from None
    if isinstance(loaded, DatasetDict):
        split = "train" if "train" in loaded else next(iter(loaded))
        loaded = loaded[split]
    return loaded


def tokenize_into_blocks(dataset: Dataset, tokenizer, block_size: int, text_column: str = "text") -> Dataset:
    """Token blocks of exactly `block_size` ids, with `labels` equal to `input_ids`."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

    def tokenize(batch):
        ids = tokenizer(batch[text_column], add_special_tokens=False)["input_ids"]
        return {"ids": [x + eos for x in ids]}

    def group(batch):
        flat = [token for ids in batch["ids"] for token in ids]
        usable = len(flat) - len(flat) % block_size
        blocks = [flat[i : i + block_size] for i in range(0, usable, block_size)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    tokenized = dataset.map(tokenize, batched=True, remove_columns=dataset.column_names, desc="Tokenizing")
    # One batch for the whole corpus keeps the block boundaries independent of map's batch size.
    return tokenized.map(
        group, batched=True, batch_size=None, remove_columns=["ids"], desc=f"Grouping into {block_size}-token blocks"
    )


def split_held_out(blocks: Dataset, eval_fraction: float) -> tuple[Dataset, Dataset | None]:
    """(train, eval): the last `eval_fraction` of the blocks is held out."""
    n_eval = int(round(len(blocks) * eval_fraction))
    if n_eval == 0:
        return blocks, None
    n_train = len(blocks) - n_eval
    if n_train < 1:
        raise ConfigError(f"the corpus gives only {len(blocks)} blocks: too few to hold out {eval_fraction:.0%}.")
    return blocks.select(range(n_train)), blocks.select(range(n_train, len(blocks)))


def build_streaming_datasets(run: RunArguments, tokenizer):
    """A streamed corpus as (train, eval) iterable datasets: the first `eval_blocks` blocks are held out.

    Texts are tokenized and cut into blocks 1,000 documents at a time (a block never spans two such batches).
    """
    name = run.dataset_name
    path = os.path.expanduser(name)
    try:
        if os.path.isfile(path):
            builder = FILE_BUILDERS.get(os.path.splitext(path)[1].lower(), "text")
            stream = load_dataset(builder, data_files=path, split="train", streaming=True)
        else:
            stream = load_dataset(name, run.dataset_config, split="train", streaming=True)
    except Exception as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(f"could not stream dataset {name!r}: {reason}") from None
    columns = stream.column_names
    if columns is not None and run.text_column not in columns:
        raise ConfigError(
            f"dataset {name!r} has no text column {run.text_column!r} (its columns: {', '.join(columns)}); "
            f"set text_column to the column that holds the text."
        )
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

    def to_blocks(batch):
        ids = tokenizer(batch[run.text_column], add_special_tokens=False)["input_ids"]
        flat = [token for x in ids for token in x + eos]
        usable = len(flat) - len(flat) % run.block_size
        blocks = [flat[i : i + run.block_size] for i in range(0, usable, run.block_size)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    blocks = stream.map(to_blocks, batched=True, batch_size=1000, remove_columns=columns)
    return blocks.skip(run.eval_blocks), blocks.take(run.eval_blocks)


def build_datasets(run: RunArguments, tokenizer) -> tuple[Dataset, Dataset | None]:
    """Load, tokenize and split the corpus named by `run`."""
    if run.streaming:
        return build_streaming_datasets(run, tokenizer)
    dataset = load_text_dataset(run.dataset_name, run.dataset_config, run.text_column)
    blocks = tokenize_into_blocks(dataset, tokenizer, run.block_size, run.text_column)
    if len(blocks) == 0:
        raise ConfigError(f"dataset {run.dataset_name!r} has fewer than {run.block_size} tokens of text.")
    return split_held_out(blocks, run.eval_fraction)


class ReplicaSliceSampler(Sampler[int]):
    """Replica `rank` of `world` reads only the rank-th contiguous slice of the examples, reshuffled every epoch.

    Slices have equal length (the last `num_examples % world` examples are left out), so every replica runs the
    same number of steps per epoch and they reach each sync together.

    >>> list(ReplicaSliceSampler(10, rank=1, world=2, seed=0, shuffle=False))
    [5, 6, 7, 8, 9]
    """

    def __init__(self, num_examples: int, rank: int, world: int, seed: int, shuffle: bool = True):
        self.length = num_examples // world
        if self.length == 0:
            raise ConfigError(f"{num_examples} training examples cannot be split between {world} replicas.")
        self.start = rank * self.length
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        if not self.shuffle:
            return iter(range(self.start, self.start + self.length))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter((torch.randperm(self.length, generator=generator) + self.start).tolist())

    def __len__(self) -> int:
        return self.length
