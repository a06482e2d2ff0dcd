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

import hashlib
import os

import numpy as np
import torch
from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict, load_dataset, load_from_disk
from torch.utils.data import Sampler

from .config import ConfigError, RunArguments, first_line
from .tasks import (
    DIGITS,
    IMAGE_CLASSIFICATION,
    IMAGE_SIZE,
    MASKED_LM,
    SEQ2SEQ,
    SEQUENCE_CLASSIFICATION,
    TASKS,
    Task,
)

BUILTIN = "builtin"
STREAM_BATCH = 100  # documents a streamed corpus is tokenized in at a time
FILE_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def builtin_corpus() -> Dataset:
    """The stdlib's pydoc topics as a dataset with columns `topic` and `text`."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    return Dataset.from_dict({"topic": names, "text": [topics[name] for name in names]})


BUILTIN_CHAT = "builtin-chat"
BUILTIN_PREFERENCES = "builtin-preferences"
BUILTINS = (BUILTIN, BUILTIN_CHAT, BUILTIN_PREFERENCES)


def _reference_passages() -> list[tuple[str, str]]:
    """(title, passage) of every paragraph of the built-in corpus between 40 and 600 characters, in topic order:
    the title is the topic's first line (e.g. "Customizing attribute access")."""
    passages = []
    for text in builtin_corpus()["text"]:
        title = text.strip().splitlines()[0].strip()
        for paragraph in text.split("\n\n")[1:]:
            paragraph = paragraph.strip("\n")
            if 40 <= len(paragraph) <= 600 and not set(paragraph) <= set("*=-~ "):
                passages.append((title, paragraph))
    return passages


def _question(title: str, index: int) -> str:
    return f"From the Python reference on \"{title}\", what does passage {index + 1} say?"


def builtin_chat() -> Dataset:
    """A chat dataset written from the built-in corpus, no download: one conversation per passage, in `messages`
    format (a user asks for a passage of a reference topic by its title and number, the assistant answers with it),
    about 2,000 rows; the same on every machine.

    Returns:
        Dataset: one column, `messages` (a list of turns, each with a role and its content), which TRL's
            SFTTrainer takes as it is.

    Examples:
        >>> chats = builtin_chat()
        >>> first = chats[0]
        >>> chats.column_names, [turn["role"] for turn in first["messages"]]
        (['messages'], ['user', 'assistant'])
    """
    rows, count = [], {}
    for title, passage in _reference_passages():
        index = count[title] = count.get(title, -1) + 1
        rows.append({"messages": [{"role": "user", "content": _question(title, index)},
                                  {"role": "assistant", "content": passage}]})
    return Dataset.from_list(rows)


def builtin_preferences() -> Dataset:
    """A preference dataset written from the built-in corpus, no download, in TRL's conversational format: for each
    passage's question, `chosen` answers with the passage and `rejected` with a passage of another topic (the one
    half the corpus further on).

    Returns:
        Dataset: `prompt`, `chosen` and `rejected` (each a list of turns), which TRL's DPOTrainer takes as it is.

    Examples:
        >>> builtin_preferences().column_names
        ['prompt', 'chosen', 'rejected']
    """
    passages = _reference_passages()
    rows, count, half = [], {}, len(passages) // 2
    for i, (title, passage) in enumerate(passages):
        index = count[title] = count.get(title, -1) + 1
        other_title, other = passages[(i + half) % len(passages)]
        if other_title == title:
            continue
        rows.append({"prompt": [{"role": "user", "content": _question(title, index)}],
                     "chosen": [{"role": "assistant", "content": passage}],
                     "rejected": [{"role": "assistant", "content": other}]})
    return Dataset.from_list(rows)


def load_raw_dataset(name: str, config: str | None = None, streaming: bool = False) -> Dataset | IterableDataset:
    """A dataset as it is stored: a built-in one or a local/Hub one (its train split); with `streaming` an
    `IterableDataset` (a built-in one in 2 shards, so that 2 replicas each read their own)."""
    builtins = {BUILTIN: builtin_corpus, BUILTIN_CHAT: builtin_chat, BUILTIN_PREFERENCES: builtin_preferences}
    if name in builtins:
        return builtins[name]().to_iterable_dataset(num_shards=2) if streaming else builtins[name]()
    return _load(name, config, streaming=streaming)


def load_text_dataset(name: str, config: str | None = None, text_column: str = "text", tokenizer=None,
                      streaming: bool = False) -> Dataset | IterableDataset:
    """Load a corpus and check it has `text_column`. Chat data (a `messages` column of {"role", "content"} turns,
    or `text_column` holding such turns) becomes text through the tokenizer's chat template, as TRL renders it.
    With `streaming`, an `IterableDataset` read as it is used (the built-in corpora are streamed from memory)."""
    dataset = load_raw_dataset(name, config, streaming=streaming)
    first = _first_row(dataset)  # read once: a stream opens its source again for every read
    columns = dataset.column_names if dataset.column_names is not None else None if first is None else list(first)
    chat = _chat_column(first, columns, text_column)
    if chat is not None:
        from .models import give_chat_template

        if tokenizer is None or not give_chat_template(tokenizer):
            raise ConfigError(f"dataset {name!r} holds conversations ({chat!r}), which the tokenizer's chat template "
                              f"turns into text, and this tokenizer has none; give it one (a tokenizer folder with "
                              f"chat_template) or use a text column.")
        render = {} if streaming else {"desc": "Applying the chat template"}
        return dataset.map(lambda row: {text_column: tokenizer.apply_chat_template(row[chat], tokenize=False)},
                           remove_columns=columns, **render)
    _check_text_column(name, columns, text_column)
    return dataset


def _first_row(dataset: Dataset | IterableDataset) -> dict | None:
    if isinstance(dataset, IterableDataset):
        return next(iter(dataset.take(1)), None)
    return dataset[0] if len(dataset) else None


def _columns(dataset: Dataset | IterableDataset) -> list[str] | None:
    """The dataset's columns; for a stream whose features are unknown until read (json), those of its first row."""
    if dataset.column_names is not None:
        return dataset.column_names
    first = _first_row(dataset)
    return list(first) if first is not None else None


def _chat_column(first: dict | None, columns: list[str] | None, text_column: str) -> str | None:
    """The column of conversations to render, if the dataset (whose first row is `first`) is chat data:
    `text_column` when it holds lists of turns, else `messages` when there is no `text_column`."""
    for column in (text_column, "messages"):
        if column in (columns or []) and (column == text_column or text_column not in columns):
            value = (first or {}).get(column)
            if isinstance(value, list) and value and isinstance(value[0], dict) and "content" in value[0]:
                return column
    return None


def check_dataset(run: RunArguments) -> None:
    """What can be known of the corpus named by `run` without loading it, in the sentence training would end with:
    the built-in corpus, or a local file or folder that exists, can be read and has `text_column` or conversations
    (a `messages` column of turns), the columns a TRL trainer reads (TRL_FORMATS), or those of its task (COLUMNS;
    asked of its first row, streamed; a `save_to_disk` folder is memory-mapped). The same check serves a training
    launch, its dry run and the app's preview. A Hub dataset is not asked for: the processes that train
    fetch it."""
    name, path = run.dataset_name, os.path.expanduser(run.dataset_name)
    if name in BUILTINS:
        columns = load_raw_dataset(name).column_names
        if name != BUILTIN:
            return  # conversations or preferences: rendered by the chat template, checked where they are
    elif os.path.exists(path) or name.startswith((".", "/", "~")):
        dataset = _load(name, run.dataset_config, streaming=run.streaming or not _saved_to_disk(path))
        try:  # a streamed json or csv file names its columns in its rows
            first = _first_row(dataset)
        except Exception as error:  # datasets raises many types; the user needs the one-line reason
            raise ConfigError(f"could not load dataset {name!r}: {first_line(error)}.") from None
        columns = dataset.column_names if dataset.column_names is not None else list(first) if first else None
        if columns is None:  # an empty file: nothing to check
            return
    else:
        return
    if run.task in COLUMNS:
        if name not in BUILTINS:
            _check_task_columns(name, columns, run.task)
            if run.task == SEQUENCE_CLASSIFICATION:  # its labels name or number the classes
                class_names(run, TASKS[run.task])
        return
    if run.trainer in TRL_FORMATS:
        _check_trl_columns(name, columns, run.trainer)
    elif name not in BUILTINS and _chat_column(first, columns, run.text_column) is not None:
        return  # conversations, rendered by the tokenizer's chat template (load_text_dataset)
    else:
        _check_text_column(name, columns, run.text_column)


# The column sets TRL's trainers read (any one of them): SFT's text, conversations, or prompt and completion
# (each plain or conversational); DPO's preference pairs.
TRL_FORMATS = {"sft": (("text",), ("messages",), ("prompt", "completion")), "dpo": (("prompt", "chosen", "rejected"),
                                                                                    ("chosen", "rejected"))}


def _check_trl_columns(name: str, columns: list[str], trainer: str) -> None:
    """ConfigError when dataset `name` has none of the column sets trainer `trainer` reads (TRL_FORMATS)."""
    if any(set(wanted) <= set(columns) for wanted in TRL_FORMATS[trainer]):
        return
    shown = " or ".join(" and ".join(wanted) for wanted in TRL_FORMATS[trainer])
    raise ConfigError(f"trainer {trainer} reads the columns {shown} of its dataset, and {name!r} has none of those "
                      f"(it has {', '.join(columns) or 'none'}).")


def _saved_to_disk(path: str) -> bool:
    """Whether `path` is a folder written by `Dataset.save_to_disk`."""
    return os.path.isdir(path) and os.path.exists(os.path.join(path, "dataset_info.json"))


def _load(name: str, config: str | None, streaming: bool = False):
    """A local file (by extension), a `save_to_disk` folder, a data folder, or a Hub id; the train split."""
    path = os.path.expanduser(name)
    try:
        if os.path.isfile(path):
            builder = FILE_BUILDERS.get(os.path.splitext(path)[1].lower())
            if builder is None:
                raise ConfigError(
                    f"dataset file {name!r} has an unknown extension; use one of {', '.join(FILE_BUILDERS)}."
                )
            loaded = load_dataset(builder, data_files=path, streaming=streaming)
        elif _saved_to_disk(path) and not streaming:
            loaded = load_from_disk(path)
        elif os.path.isdir(path) or not name.startswith((".", "/", "~")):
            loaded = load_dataset(path if os.path.isdir(path) else name, config, streaming=streaming)
        else:
            raise ConfigError(f"dataset path {name!r} does not exist.")
    except ConfigError:
        raise
    except Exception as error:  # datasets raises many types; the user needs the one-line reason
        raise ConfigError(f"could not load dataset {name!r}: {first_line(error)}.") from None
    if isinstance(loaded, (DatasetDict, IterableDatasetDict)):
        loaded = loaded["train" if "train" in loaded else next(iter(loaded))]
    return loaded


def _check_text_column(name: str, columns: list[str] | None, text_column: str) -> None:
    if columns is not None and text_column not in columns:
        raise ConfigError(
            f"dataset {name!r} has no text column {text_column!r} (its columns: {', '.join(columns)}); "
            f"set text_column to the column that holds the text."
        )


def _texts_to_blocks(texts: list[str], tokenizer, block_size: int) -> dict:
    """Tokenize, join with EOS, cut into `block_size` blocks (the remainder is dropped); labels = inputs."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    flat = [token for ids in tokenizer(texts, add_special_tokens=False)["input_ids"] for token in ids + eos]
    usable = len(flat) - len(flat) % block_size
    blocks = [flat[i : i + block_size] for i in range(0, usable, block_size)]
    return {"input_ids": blocks, "labels": [list(b) for b in blocks]}


def tokenize_into_blocks(dataset: Dataset, tokenizer, block_size: int, text_column: str = "text") -> Dataset:
    """Token blocks of exactly `block_size` ids, with `labels` equal to `input_ids`.

    The whole corpus is one map batch, so block boundaries do not depend on a batch size. The blocks are tokenized
    once per machine: a corpus read from files is cached by datasets itself, and one held in memory (the built-in
    corpus) is kept in datasets' cache folder under a name made from its texts, the tokenizer, the block size and
    the code that cuts the blocks, so every later process (each replica of every run) maps that file instead of
    tokenizing again. `datasets.disable_caching()` turns both off; a cache folder that cannot be written leaves the
    blocks in memory.
    """
    return dataset.map(
        lambda batch: _texts_to_blocks(batch[text_column], tokenizer, block_size),
        batched=True, batch_size=None, remove_columns=dataset.column_names,
        desc=f"Tokenizing into {block_size}-token blocks",
        cache_file_name=blocks_cache_file(dataset, tokenizer, block_size, text_column),
    )


def blocks_cache_file(dataset: Dataset, tokenizer, block_size: int, text_column: str) -> str | None:
    """Where the blocks of an in-memory corpus are cached (`<datasets cache>/hf_diloco/blocks-<key>.arrow`), or
    None where datasets caches by itself (a corpus read from files), caching is off or the folder cannot be
    written. The key covers everything the blocks depend on; datasets writes the file under a temporary name and
    renames it, so processes that tokenize at the same moment never read a partial file."""
    import datasets
    from datasets.fingerprint import Hasher

    if dataset.cache_files or not datasets.is_caching_enabled():
        return None
    key = Hasher.hash([dataset[text_column], tokenizer, block_size, _texts_to_blocks])
    folder = os.path.join(datasets.config.HF_DATASETS_CACHE, "hf_diloco")
    try:
        os.makedirs(folder, exist_ok=True)
        if not os.access(folder, os.W_OK):
            return None
    except OSError:  # a cache folder that cannot be written: tokenize in memory, as without a cache
        return None
    return os.path.join(folder, f"blocks-{key}.arrow")


def split_held_out(blocks: Dataset, eval_fraction: float) -> tuple[Dataset, Dataset | None]:
    """(train, eval): the last `eval_fraction` of the blocks is held out."""
    n_eval = int(round(len(blocks) * eval_fraction))
    if n_eval == 0:
        return blocks, None
    n_train = len(blocks) - n_eval
    if n_train < 1:
        raise ConfigError(f"the corpus gives only {len(blocks)} blocks: too few to hold out {eval_fraction:.0%}.")
    return blocks.select(range(n_train)), blocks.select(range(n_train, len(blocks)))


def build_streaming_datasets(run: RunArguments, tokenizer,
                             shard: tuple[int, int] | None = None) -> tuple[IterableDataset, Dataset | None]:
    """A streamed corpus as (train, eval), read as it is used: memory holds one batch of documents, never the corpus.

    Held out: the first documents of the stream, as many as give `eval_blocks` blocks, kept in memory as a
    `Dataset`. Training reads all the others, less any whose text equals a held-out document's, so
    no held-out text is trained on, whichever order a replica reads its part in. With `shard` = (index, count) the
    documents are split with datasets' `split_dataset_by_node` before they are tokenized, so each replica tokenizes
    only its own: whole files where their number divides by `count`, else every count-th document. Texts are cut
    into blocks STREAM_BATCH (100) documents at a time (a block never spans two such batches, so at most one block
    of tokens per batch is dropped; a batch of long documents stays small in memory).
    """
    stream = load_text_dataset(run.dataset_name, run.dataset_config, run.text_column, tokenizer, streaming=True)
    column, held, tokens = run.text_column, [], 0
    for row in stream if run.eval_blocks > 0 else ():
        held.append(row[column])
        tokens += len(tokenizer(row[column], add_special_tokens=False)["input_ids"]) + 1
        if tokens >= run.eval_blocks * run.block_size:
            break
    eval_dataset = None
    if run.eval_blocks > 0:
        blocks = _texts_to_blocks(held, tokenizer, run.block_size)
        if not blocks["input_ids"]:
            raise ConfigError(f"dataset {run.dataset_name!r} has fewer than {run.block_size} tokens of text.")
        eval_dataset = Dataset.from_dict({k: v[: run.eval_blocks] for k, v in blocks.items()})
    kept = {_key(text) for text in held}
    train = stream.filter(lambda row: _key(row[column]) not in kept) if kept else stream
    train = split_stream(train, *shard) if shard else train
    train = train.map(lambda batch: _texts_to_blocks(batch[column], tokenizer, run.block_size),
                      batched=True, batch_size=STREAM_BATCH, remove_columns=_columns(stream))
    return train, eval_dataset


def held_out_stream(run: RunArguments, shard: tuple[int, int] | None = None) -> tuple[IterableDataset, Dataset]:
    """Rows streamed as they are stored (TRL's trainers tokenize them), as (train, eval): the first `eval_blocks`
    rows held out in memory, the others (less any equal to a held-out row) split by `shard` as
    `build_streaming_datasets` splits documents."""
    stream = load_raw_dataset(run.dataset_name, run.dataset_config, streaming=True)
    held = list(stream.take(run.eval_blocks))
    if run.eval_blocks > 0 and not held:
        raise ConfigError(f"dataset {run.dataset_name!r} has no rows.")
    kept = {_key(row) for row in held}
    train = stream.filter(lambda row: _key(row) not in kept) if kept else stream
    return split_stream(train, *shard) if shard else train, Dataset.from_list(held) if held else None


def split_stream(stream: IterableDataset, index: int, count: int) -> IterableDataset:
    """Data shard `index` of `count` of a stream (a replica's part; see `trainer.data_shard`), cut by datasets'
    `split_dataset_by_node`: whole files where their number divides by `count`, else every count-th row. A stream
    already split so is kept; one split for another shard is refused."""
    from . import compat

    done = compat.node_split(stream)
    if done is not None:
        if done != (index, count):
            raise ConfigError(f"the training stream was split as part {done[0]} of {done[1]}, and this process "
                              f"trains data shard {index} of {count}; pass the stream whole and DiLoCo splits it.")
        return stream
    if count == 1:
        return stream
    from datasets.distributed import split_dataset_by_node

    return split_dataset_by_node(stream, rank=index, world_size=count)


def _key(value) -> bytes:
    """A digest of a text or a row, equal for equal values."""
    import json

    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def build_datasets(run: RunArguments, tokenizer, shard: tuple[int, int] | None = None):
    """Load, tokenize and split the corpus named by `run`: (train, eval or None). A streamed corpus is split
    between replicas here when `shard` (this replica's index, the number of replicas) is given.

    Args:
        run: the data fields (`dataset_name`: "builtin", a local file or folder, or a Hub dataset;
            `dataset_config`, `text_column`, `block_size`, `eval_fraction`, `streaming`, ...).
        tokenizer (PreTrainedTokenizerBase): the model's tokenizer.
        shard: (this replica's index, the number of replicas), for a streamed corpus only; a map-style one is
            split between replicas by the trainer's sampler instead.

    Returns:
        tuple[Dataset, Dataset | None]: (train, eval), datasets of `block_size`-token blocks with `input_ids` and
            `labels`; eval is None with `eval_fraction` 0 (a streamed corpus holds none out).

    Examples:
        >>> from hf_diloco.models import byte_tokenizer
        >>> train, held_out = build_datasets(RunArguments(dataset_name="builtin", block_size=64), byte_tokenizer())
        >>> first = train[0]
        >>> len(first["input_ids"]), sorted(first), len(held_out) < len(train)
        (64, ['input_ids', 'labels'], True)
    """
    if run.streaming:
        return build_streaming_datasets(run, tokenizer, shard)
    dataset = load_text_dataset(run.dataset_name, run.dataset_config, run.text_column, tokenizer)
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


# --- the other tasks' rows (hf_diloco.tasks) --------------------------------------------------------------------------

# The digits in a 3x5 font, row by row (1: ink).
FONT = {
    0: "111101101101111", 1: "010110010010111", 2: "111001111100111", 3: "111001111001111", 4: "101101111001001",
    5: "111100111001111", 6: "111100111101111", 7: "111001010010010", 8: "111101111101111", 9: "111101111001111",
}


def builtin_digits(count: int = 2000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(images [count, 1, 8, 8] float32 in [0, 1], labels [count]): each digit of the 3x5 font drawn at one of four
    places near the middle of the 8x8 frame (its top-left corner in rows 1-2, columns 2-3), with Gaussian noise
    (σ 0.15), labels cycling 0-9. The same arrays for the same seed on every machine."""
    rng = np.random.default_rng(seed)
    images = np.zeros((count, 1, IMAGE_SIZE, IMAGE_SIZE), dtype=np.float32)
    labels = np.arange(count) % DIGITS
    for i, digit in enumerate(labels):
        glyph = np.array([int(c) for c in FONT[digit]], dtype=np.float32).reshape(5, 3)
        top, left = 1 + rng.integers(0, 2), 2 + rng.integers(0, 2)
        images[i, 0, top:top + 5, left:left + 3] = glyph
    images += rng.normal(0, 0.15, images.shape).astype(np.float32)
    return np.clip(images, 0, 1), labels


def builtin_pairs() -> list[tuple[str, str]]:
    """(passage, title) for seq2seq: each passage of the built-in corpus and the title of its topic."""
    return [(passage, title) for title, passage in _reference_passages()]


def builtin_labelled_texts() -> list[tuple[str, int]]:
    """(text, label) for classification: the corpus's passages, every other one reversed letter by letter
    (label 1) and the others as written (label 0): a classifier must tell written prose from its mirror image."""
    passages = [passage for _title, passage in _reference_passages()]
    return [(text[::-1], 1) if i % 2 else (text, 0) for i, text in enumerate(passages)]


TARGET_LENGTH = 64  # tokens of a seq2seq target (a title: the byte tokenizer's bytes)
# The columns a dataset of the user's gives each task (input, target); masked LM reads text_column, as causal LM.
COLUMNS = {SEQ2SEQ: ("source", "target"), SEQUENCE_CLASSIFICATION: ("text", "label"),
           IMAGE_CLASSIFICATION: ("image", "label")}


def _check_task_columns(name: str, columns: list[str] | None, task: str) -> None:
    """ConfigError when dataset `name` lacks a column task `task` reads (COLUMNS)."""
    missing = [c for c in COLUMNS[task] if columns is not None and c not in columns]
    if missing:
        raise ConfigError(f"task {task} reads columns {' and '.join(COLUMNS[task])} of its dataset, and {name!r} has "
                          f"no {', '.join(missing)} (it has {', '.join(columns) or 'none'})"
                          + (": a folder of images needs one sub-folder per class." if task == IMAGE_CLASSIFICATION
                             else "."))


BUILTIN_TEXT_LABELS = ["written", "mirrored"]  # builtin_labelled_texts: label 0 as written, 1 reversed


def class_names(run, task: Task) -> list[str] | None:
    """The classes of a classifier's data in id order (the model's `id2label`): the built-in data's (written and
    mirrored prose; the digits "0" to "9"), a `ClassLabel` column's names (an image folder's sub-folders), the
    sorted distinct values of a `label` column of strings, or "0" to "K-1" for integer labels, K the largest + 1.
    None for a task without classes. ConfigError for a negative label or labels neither all integers nor all
    strings."""
    if not task.new_head:
        return None
    if run.dataset_name == BUILTIN:
        return [str(d) for d in range(DIGITS)] if task.name == IMAGE_CLASSIFICATION else list(BUILTIN_TEXT_LABELS)
    dataset = load_raw_dataset(run.dataset_name, run.dataset_config)
    _check_task_columns(run.dataset_name, dataset.column_names or [], task.name)
    names = getattr((dataset.features or {}).get("label"), "names", None)
    if names:
        return list(names)
    values = dataset["label"]
    if not values:
        raise ConfigError(f"dataset {run.dataset_name!r} holds no rows.")
    if all(isinstance(v, str) for v in values):
        return sorted(set(values))
    if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
        if min(values) < 0:
            raise ConfigError(f"dataset {run.dataset_name!r} has label {min(values)}: integer labels number the "
                              f"classes from 0 (or give the classes' names as strings).")
        return [str(i) for i in range(int(max(values)) + 1)]
    odd = next(v for v in values if not isinstance(v, (str, int, np.integer)) or isinstance(v, bool))
    raise ConfigError(f"dataset {run.dataset_name!r} has labels that are not all class numbers (0, 1, ...) or all "
                      f"class names (e.g. {odd!r}); a classifier's label is one or the other.")


def _rows(run, task: Task) -> list[tuple]:
    """The task's (input, target) rows: built-in, or the two columns COLUMNS names of the dataset run names. A
    classifier's rows of the user's are shuffled once with a fixed seed (the same order on every replica), as its
    images are, so that the held-out tail of a file kept in the order of its labels is not one class."""
    if run.dataset_name == BUILTIN:
        return builtin_pairs() if task.name == SEQ2SEQ else builtin_labelled_texts()
    dataset = load_raw_dataset(run.dataset_name, run.dataset_config)
    wanted = COLUMNS[task.name]
    _check_task_columns(run.dataset_name, dataset.column_names or [], task.name)
    rows = list(zip(dataset[wanted[0]], dataset[wanted[1]], strict=True))
    if task.name == SEQUENCE_CLASSIFICATION:
        rows = [rows[i] for i in np.random.default_rng(0).permutation(len(rows))]
    return rows


def user_images(run, model_config) -> tuple[np.ndarray, np.ndarray]:
    """(images [count, channels, size, size] float32 in [0, 1], labels [count]) from the user's dataset: a folder
    with one sub-folder of images per class (datasets' imagefolder), a `save_to_disk` folder or a Hub id, with
    columns `image` and `label`. Each image is converted to the model's channels (gray for 1, else RGB) and resized
    to its `image_size`; no other normalisation. The rows are shuffled once with a fixed seed (the same order on
    every replica), so the held-out tail is not one class. ConfigError when a label is outside the model's
    classes."""
    from PIL import Image

    dataset = load_raw_dataset(run.dataset_name, run.dataset_config)
    _check_task_columns(run.dataset_name, dataset.column_names or [], IMAGE_CLASSIFICATION)
    size = int(getattr(model_config, "image_size", IMAGE_SIZE))
    channels = int(getattr(model_config, "num_channels", 1))
    classes = int(getattr(model_config, "num_labels", DIGITS))
    labels = np.asarray(dataset["label"], dtype=np.int64)
    if len(labels) == 0:
        raise ConfigError(f"dataset {run.dataset_name!r} holds no images.")
    if labels.min() < 0 or labels.max() >= classes:
        raise ConfigError(f"dataset {run.dataset_name!r} has labels {labels.min()} to {labels.max()}, but the model "
                          f"predicts {classes} classes (0 to {classes - 1}); give it a model with as many classes as "
                          f"the dataset has.")
    mode = "L" if channels == 1 else "RGB"
    images = np.stack([np.asarray(image.convert(mode).resize((size, size), Image.Resampling.BILINEAR),
                                  dtype=np.float32).reshape(size, size, channels).transpose(2, 0, 1) / 255.0
                       for image in dataset["image"]])
    order = np.random.default_rng(0).permutation(len(labels))
    return images[order], labels[order]


def _ids(tokenizer, texts: list[str], length: int, pad_with: int) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids cut or padded to `length` (an EOS ends every text that fits), and their attention masks."""
    encoded = tokenizer(texts, truncation=True, max_length=length)["input_ids"]
    ids = [row + [pad_with] * (length - len(row)) for row in encoded]
    mask = [[1] * len(row) + [0] * (length - len(row)) for row in encoded]
    return ids, mask


def build_task_datasets(run, task: Task, tokenizer, model_config=None):
    """(train, eval or None) for a task other than causal-lm: rows as the task's model takes them, fixed shapes,
    the last `eval_fraction` of the rows held out. `model_config`: the model's, for a dataset of images of the
    user's (their size, channels and classes) and for class names (`label2id`; `class_names`).

    Args:
        run (RunArguments): the data fields, as for `build_datasets` (`dataset_name` "builtin" writes the task's
            built-in rows).
        task: hf_diloco.tasks.get_task(name): masked-lm, sequence-classification, seq2seq or image-classification.
        tokenizer (PreTrainedTokenizerBase | None): the model's tokenizer (None for an image classifier).
        model_config (PretrainedConfig | None): the model's config, where the rows depend on it (images; a
            classifier's class names).

    Returns:
        tuple[Dataset, Dataset | None]: (train, eval), datasets whose rows the task's collator batches as they are
            (`task_collator`); eval is None with `eval_fraction` 0.

    Examples:
        >>> from hf_diloco.models import byte_tokenizer
        >>> from hf_diloco.tasks import get_task
        >>> train, _ = build_task_datasets(RunArguments(dataset_name="builtin", block_size=64),
        ...                                get_task("sequence-classification"), byte_tokenizer())
        >>> first = train[0]
        >>> sorted(first), len(first["input_ids"])
        (['attention_mask', 'input_ids', 'labels'], 64)
    """
    if task.name == MASKED_LM:  # the corpus in blocks, as for causal LM; the collator makes masks and labels
        train, held = build_datasets(run, tokenizer)
        return tuple(None if part is None else part.remove_columns("labels") for part in (train, held))
    if task.name == IMAGE_CLASSIFICATION:
        images, labels = builtin_digits() if run.dataset_name == BUILTIN else user_images(run, model_config)
        rows = Dataset.from_dict({"pixel_values": images, "labels": labels})
    else:
        rows = _rows(run, task)
        inputs, targets = [r[0] for r in rows], [r[1] for r in rows]
        ids, mask = _ids(tokenizer, inputs, run.block_size, tokenizer.pad_token_id)
        columns = {"input_ids": ids, "attention_mask": mask}
        if task.name == SEQ2SEQ:
            labels, _ = _ids(tokenizer, targets, TARGET_LENGTH, -100)
            columns["labels"] = labels
        else:  # a class's name (a string) or number
            ids = getattr(model_config, "label2id", None) or {}
            columns["labels"] = [ids[label] if isinstance(label, str) else int(label) for label in targets]
        rows = Dataset.from_dict(columns)
    rows.set_format("torch")
    return split_held_out(rows, run.eval_fraction)
