"""Models and tokenizers users bring: a model that is not a causal language model, and a tokenizer that cannot be
loaded, is empty or does not fit the model, are refused in one sentence (nothing is substituted); LoRA targets are
chosen for the architecture. In process, on tiny models built from configs (tests/helpers.py ARCHITECTURES)."""

from __future__ import annotations

import json
import re

import pytest
from helpers import cli, tiny_model_folder

from hf_diloco.config import ConfigError, RunArguments
from hf_diloco.models import load_model_and_tokenizer
from hf_diloco.train import add_lora


@pytest.mark.parametrize("kind, words", [
    ("bert-masked-lm", "is a BertForMaskedLM, a masked language model (task masked-lm trains it): task causal-lm "
                       "trains a causal language model (AutoModelForCausalLM)"),
    ("t5", "is a T5ForConditionalGeneration, and its architecture (t5) has no class of the kind task causal-lm "
           "trains: a causal language model (AutoModelForCausalLM)"),
])
def test_a_model_with_another_tasks_head_is_refused_in_one_sentence_and_left_as_it_was(tmp_path, kind, words):
    """In process and through `hf-diloco train` (task causal-lm, the default): the sentence names the saved
    architecture, the task that trains it and the one asked, the exit is not zero, there is no traceback, and the
    folder's config still says what it was."""
    folder = tiny_model_folder(kind, tmp_path / kind)
    saved = (folder / "config.json").read_text()
    with pytest.raises(ConfigError, match=re.escape(words)):
        load_model_and_tokenizer(str(folder))
    result = cli("train", "--model_name_or_path", str(folder), "--max_steps", "2", "--inner_steps", "1",
                 "--output_dir", str(tmp_path / "out"))
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("hf-diloco: error: model ") and words in last, last
    assert (folder / "config.json").read_text() == saved
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_a_tokenizer_that_is_missing_broken_or_too_large_is_refused_and_byte_is_chosen_by_name(tmp_path):
    """No tokenizer files (transformers then loads an empty one), a tokenizer file that cannot be read, and a
    tokenizer with more ids than the model embeds: each one sentence. `tokenizer_name_or_path: byte` is the
    explicit way to the built-in byte tokenizer."""
    bare = tiny_model_folder("llama", tmp_path / "bare", tokenizer=False)
    with pytest.raises(ConfigError, match=r"the tokenizer of model '.*bare' (is empty|could not)|could not load "
                                          r"the tokenizer of model"):
        load_model_and_tokenizer(str(bare))
    model, tokenizer = load_model_and_tokenizer(str(bare), tokenizer_name_or_path="byte")
    assert len(tokenizer) == 259 and model.config.vocab_size == 259

    broken = tiny_model_folder("gpt2", tmp_path / "broken")
    (broken / "tokenizer_config.json").write_text("{ not json")
    with pytest.raises(ConfigError, match=r"could not load the tokenizer of model .*nothing is substituted"):
        load_model_and_tokenizer(str(broken))

    from transformers import GPT2Tokenizer  # noqa: F401  (a larger vocabulary, built from two files written here)

    large = tmp_path / "large-tokenizer"
    large.mkdir()
    vocab = {chr(33 + i): i for i in range(300)}
    (large / "vocab.json").write_text(json.dumps(vocab))
    (large / "merges.txt").write_text("#version: 0.2\n")
    (large / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer",
                                                             "unk_token": "!", "eos_token": "!"}))
    with pytest.raises(ConfigError, match=r"the tokenizer has 30[01] ids but model .* embeds 259: they do not belong"):
        load_model_and_tokenizer(str(bare), tokenizer_name_or_path=str(large))


@pytest.mark.parametrize("kind, targets", [("llama", {"q_proj", "v_proj"}), ("gpt2", {"c_attn"}),
                                           ("qwen3-moe", {"q_proj", "v_proj"})])
def test_lora_targets_are_chosen_for_the_architecture(tmp_path, kind, targets):
    """`lora_target_modules: auto` (the default): PEFT's choice where it has one (GPT-2's fused c_attn), else the
    query and value projections the model has (Qwen3-MoE is not in PEFT's table); every chosen module gets an
    adapter and nothing else does."""
    model, _ = load_model_and_tokenizer(str(tiny_model_folder(kind, tmp_path / kind)))
    adapted = add_lora(model, RunArguments(lora_r=4))
    wrapped = {name.rsplit(".", 1)[-1] for name, module in adapted.named_modules() if hasattr(module, "lora_A")}
    assert wrapped == targets
    assert all(("lora_" in name) == parameter.requires_grad for name, parameter in adapted.named_parameters())
