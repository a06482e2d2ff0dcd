"""Model presets built from configs, a byte-level tokenizer that needs no files, and loading by name or path.

Design choices:
- Presets are Llama decoders; the small ones are so that runs, tests and benchmarks work on a laptop CPU with nothing
  downloaded. `tiny-llama` is the model of the benchmarks' peer task (hidden 128, 4 layers, tied embeddings).
- The default tokenizer is ByT5's byte-level one (256 bytes + 3 specials): it is built in code, so a fresh
  machine with no network can still train and save a complete, reloadable model.
- Anything else goes through the Auto classes, from a local directory or (where the network allows) the Hub.
"""

from __future__ import annotations

import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, ByT5Tokenizer, LlamaConfig, LlamaForCausalLM

from .config import ConfigError, first_line

PRESETS: dict[str, dict] = {
    # ≈ 1.1M parameters; trains at ~12k tokens/s on one CPU core.
    "tiny-llama": dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4),
    # ≈ 19M parameters.
    "llama-20m": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=6, num_attention_heads=8),
    # ≈ 155M parameters with the byte tokenizer: the size of the DiLoCo paper's smallest model, for GPU clusters.
    "llama-150m": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16),
    # ≈ 6.5B parameters: Llama-2-7B's layers with the byte vocabulary; for replicas sharded over a node's GPUs.
    "llama-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32),
}


def byte_tokenizer() -> ByT5Tokenizer:
    """ByT5's byte-level tokenizer: 259 ids (pad 0, eos 1, unk 2, then the 256 bytes); no files needed."""
    return ByT5Tokenizer(extra_ids=0)


def build_preset(name: str, tokenizer, max_positions: int = 256, seed: int = 0) -> LlamaForCausalLM:
    """A freshly initialised preset model, identical for identical seeds."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **PRESETS[name],
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)


def load_model_and_tokenizer(name_or_path: str, max_positions: int = 256, seed: int = 0):
    """Return (model, tokenizer) for a preset name, a local model directory, or a Hub id."""
    if name_or_path in PRESETS:
        tokenizer = byte_tokenizer()
        return build_preset(name_or_path, tokenizer, max_positions, seed), tokenizer
    return _from_pretrained(_source(name_or_path), name_or_path)


def load_model_config(name_or_path: str):
    """The config of a model that is not a preset: a local directory's config.json, or a Hub model's (that file
    alone is downloaded), read as `load_model_and_tokenizer` would read it; ConfigError in its sentence."""
    source = _source(name_or_path)
    try:
        return AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as error:
        raise ConfigError(_unloadable(name_or_path, error)) from None


def _source(name_or_path: str) -> str:
    """Where a model that is not a preset comes from: a local directory, else a Hub id. A Hub id is "name" or
    "owner/name"; anything else is meant as a path on this machine, which must exist."""
    looks_local = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1
    path = os.path.expanduser(name_or_path)
    if os.path.isdir(path):
        return path
    if looks_local or os.path.exists(path):
        raise ConfigError(f"model path {name_or_path!r} does not exist or is not a directory.")
    return name_or_path


def _unloadable(shown: str, error: BaseException) -> str:
    return (f"could not load model {shown!r}: it is not a preset ({', '.join(PRESETS)}), not a local model "
            f"directory, and the Hub did not provide it ({first_line(error)}).")


def _from_pretrained(source: str, shown: str):
    try:
        model = AutoModelForCausalLM.from_pretrained(source)
    except (OSError, ValueError) as error:
        raise ConfigError(_unloadable(shown, error)) from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError, TypeError):
        tokenizer = byte_tokenizer()
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
