"""Corpora become fixed-length blocks with a held-out tail; local files load through datasets."""

import json

import pytest

from hf_diloco.config import ConfigError, RunArguments
from hf_diloco.data import build_datasets, builtin_corpus, load_text_dataset, split_held_out, tokenize_into_blocks
from hf_diloco.models import PRESETS, build_preset, byte_tokenizer, load_model_and_tokenizer


def test_builtin_corpus_is_the_pydoc_topics():
    from pydoc_data.topics import topics

    corpus = builtin_corpus()
    assert len(corpus) == len(topics)
    assert sum(len(t) for t in corpus["text"]) == sum(len(t) for t in topics.values())


def test_blocks_are_exact_length_and_preserve_the_byte_stream():
    tokenizer = byte_tokenizer()
    from datasets import Dataset

    texts = ["hello world", "second document here"]
    blocks = tokenize_into_blocks(Dataset.from_dict({"text": texts}), tokenizer, block_size=8)
    stream = [b for t in texts for b in list(t.encode()) + [-2]]  # -2 marks EOS before the +3 id shift
    expected = [x + 3 if x >= 0 else tokenizer.eos_token_id for x in stream]
    assert len(blocks) == len(expected) // 8
    assert [t for ids in blocks["input_ids"] for t in ids] == expected[: len(blocks) * 8]
    assert blocks["labels"] == blocks["input_ids"]


def test_an_in_memory_corpus_is_tokenized_once_and_read_back_from_the_cache(tmp_path, monkeypatch):
    """The built-in corpus's blocks are written to `<datasets cache>/hf_diloco/` on first use and mapped from there
    afterwards (the tokenizer is not called again); other texts, another block size or another tokenizer get a file
    of their own; the cached blocks equal blocks tokenized with caching off; and a cache folder that cannot be
    written leaves the blocks in memory."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path))
    corpus, tokenizer = builtin_corpus(), byte_tokenizer()
    first = tokenize_into_blocks(corpus, tokenizer, block_size=64)
    files = sorted((tmp_path / "hf_diloco").glob("blocks-*.arrow"))
    assert len(files) == 1 and first.cache_files[0]["filename"] == str(files[0])

    calls = []
    tokenize = type(tokenizer).__call__
    with monkeypatch.context() as patch:
        patch.setattr(type(tokenizer), "__call__", lambda *a, **k: calls.append(1) or tokenize(*a, **k))
        again = tokenize_into_blocks(corpus, tokenizer, block_size=64)
        assert calls == [] and again.cache_files[0]["filename"] == str(files[0])
        tokenize_into_blocks(builtin_corpus().select(range(10)), tokenizer, block_size=64)
        assert calls == [1], "another corpus is tokenized"
        text_file = tmp_path / "corpus.txt"
        text_file.write_text("\n".join(builtin_corpus()["text"][:10]))
        from_file = [tokenize_into_blocks(load_text_dataset(str(text_file)), tokenizer, 64) for _ in range(2)]
        assert calls == [1, 1], "a corpus read from files: datasets' own cache, once"
        assert from_file[0].cache_files == from_file[1].cache_files != []

    tokenize_into_blocks(corpus, tokenizer, block_size=32)
    other = byte_tokenizer()
    other.eos_token = other.pad_token  # another end-of-text id: other blocks
    tokenize_into_blocks(corpus, other, block_size=64)
    assert len(list((tmp_path / "hf_diloco").glob("blocks-*.arrow"))) == 4

    datasets.disable_caching()
    try:
        fresh = tokenize_into_blocks(corpus, tokenizer, block_size=64)
    finally:
        datasets.enable_caching()
    assert fresh.cache_files == [] and fresh["input_ids"] == again["input_ids"]

    (tmp_path / "a-file").write_text("")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "a-file"))  # no folder can go there
    unwritable = tokenize_into_blocks(corpus, tokenizer, block_size=64)
    assert unwritable.cache_files == [] and unwritable["input_ids"] == again["input_ids"]


def test_held_out_split_is_the_last_blocks():
    from datasets import Dataset

    blocks = Dataset.from_dict({"input_ids": [[i] for i in range(100)]})
    train, held_out = split_held_out(blocks, 0.05)
    assert train["input_ids"][-1] == [94] and held_out["input_ids"] == [[95], [96], [97], [98], [99]]


def test_builtin_datasets_for_the_tiny_preset():
    model, tokenizer = load_model_and_tokenizer("tiny-llama")
    assert model.config.vocab_size == len(tokenizer) == 259
    assert 1.0e6 < sum(p.numel() for p in model.parameters()) < 1.2e6
    train, held_out = build_datasets(RunArguments(), tokenizer)
    assert len(held_out) == round(0.05 * (len(train) + len(held_out)))
    assert all(len(ids) == 256 for ids in held_out["input_ids"])


def test_presets_are_identical_for_a_seed_and_the_20m_preset_has_20m_params():
    tokenizer = byte_tokenizer()
    a, b = build_preset("tiny-llama", tokenizer, seed=3), build_preset("tiny-llama", tokenizer, seed=3)
    assert all((x == y).all() for x, y in zip(a.parameters(), b.parameters(), strict=True))
    big = build_preset("llama-20m", tokenizer)
    assert 18e6 < sum(p.numel() for p in big.parameters()) < 22e6
    assert {"tiny-llama", "llama-20m", "llama-150m"} <= set(PRESETS)


@pytest.mark.parametrize("suffix", [".jsonl", ".txt", ".csv", ".parquet"])
def test_local_files_load_whole_and_streamed(tmp_path, suffix):
    path = tmp_path / f"corpus{suffix}"
    lines = [f"document number {i} with some text" for i in range(20)]
    if suffix == ".jsonl":
        path.write_text("\n".join(json.dumps({"text": line}) for line in lines))
    elif suffix == ".csv":
        path.write_text("text\n" + "\n".join(lines))
    elif suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": lines}), path)
    else:
        path.write_text("\n".join(lines))
    assert load_text_dataset(str(path))["text"] == lines
    assert [row["text"] for row in load_text_dataset(str(path), streaming=True)] == lines


def test_local_folder_loads(tmp_path):
    (tmp_path / "a.txt").write_text("first file\n")
    (tmp_path / "b.txt").write_text("second file\n")
    assert sorted(load_text_dataset(str(tmp_path))["text"]) == ["first file", "second file"]


def test_saved_model_directory_loads_through_auto_classes(tmp_path):
    model, tokenizer = load_model_and_tokenizer("tiny-llama")
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded, loaded_tokenizer = load_model_and_tokenizer(str(tmp_path))
    assert len(loaded_tokenizer) == 259
    assert all((x == y).all() for x, y in zip(model.parameters(), loaded.parameters(), strict=True))


def test_missing_text_column_names_the_columns(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"body": "x"}))
    with pytest.raises(ConfigError, match="body"):
        load_text_dataset(str(path))


def test_a_streamed_file_holds_out_its_first_documents_and_trains_on_the_rest(tmp_path):
    """Streaming holds out the first documents (each of 106 tokens with EOS: 3 blocks of 32 need one) and cuts the
    others into the blocks loading would give them; a later copy of a held-out document is not trained on."""
    path = tmp_path / "corpus.jsonl"
    texts = [f"streamed document {i:02d} " * 5 for i in range(30)] + ["streamed document 00 " * 5]
    path.write_text("\n".join(json.dumps({"text": text}) for text in texts))
    tokenizer = byte_tokenizer()
    train, held_out = build_datasets(RunArguments(dataset_name=str(path), block_size=32, streaming=True,
                                                  eval_blocks=3), tokenizer)
    first, rest = tmp_path / "first.txt", tmp_path / "rest.txt"
    first.write_text(texts[0])
    rest.write_text("\n".join(texts[1:30]))
    assert held_out["input_ids"] == tokenize_into_blocks(load_text_dataset(str(first)), tokenizer, 32)["input_ids"]
    assert [b["input_ids"] for b in train] == tokenize_into_blocks(load_text_dataset(str(rest)), tokenizer,
                                                                   32)["input_ids"]
    assert len(held_out) == 3


def test_streamed_dataset_without_text_column_is_refused(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"body": "x"}))
    with pytest.raises(ConfigError, match="body"):
        build_datasets(RunArguments(dataset_name=str(path), streaming=True), byte_tokenizer())


def test_non_iid_with_a_streamed_dataset_is_refused_from_python_too(tmp_path):
    """The Python path (DiLoCoTrainer with an iterable dataset) says why in one sentence instead of silently
    falling back to i.i.d. shards."""
    import pytest
    from datasets import IterableDataset
    from helpers import pattern_blocks, tiny_llama
    from transformers import default_data_collator

    from hf_diloco import DiLoCoConfig, DiLoCoTrainer
    from hf_diloco.errors import ConfigError

    def blocks():
        for block in pattern_blocks(16):
            yield {"input_ids": block, "labels": block}

    config = DiLoCoConfig(output_dir=str(tmp_path), data_sharding="non_iid", max_steps=2, inner_steps=1,
                          report_to="none", save_every_rounds=0)
    trainer = DiLoCoTrainer(model=tiny_llama(), args=config, train_dataset=IterableDataset.from_generator(blocks),
                            data_collator=default_data_collator)
    with pytest.raises(ConfigError, match="non_iid cuts the corpus into one contiguous slice per replica"):
        trainer.train()


def test_chat_data_becomes_text_through_the_chat_template(tmp_path):
    """A local `messages` file (the column named or found), and the built-in chat data, are rendered by the
    tokenizer's chat template (the byte tokenizer's built-in one); a tokenizer without a template is refused in
    one sentence rather than fed the turns' repr."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    rows = [{"messages": [{"role": "user", "content": f"question {i}"},
                          {"role": "assistant", "content": f"answer {i}"}]} for i in range(4)]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tokenizer = byte_tokenizer()
    for column in ("text", "messages"):
        texts = load_text_dataset(str(path), text_column=column, tokenizer=tokenizer)[column]
        assert texts[2] == "<|user|>\nquestion 2</s>\n<|assistant|>\nanswer 2</s>\n"
    built_in = load_text_dataset("builtin-chat", tokenizer=tokenizer)
    assert len(built_in) > 1500 and built_in[0]["text"].startswith("<|user|>\nFrom the Python reference on ")
    plain = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]")))
    with pytest.raises(ConfigError, match="holds conversations .* and this tokenizer has none"):
        load_text_dataset(str(path), tokenizer=plain)
