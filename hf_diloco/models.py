"""Model presets built from configs, a byte-level tokenizer that needs no files, and loading by name or path.

Design choices:
- Presets are Llama decoders; the small ones are so that runs, tests and benchmarks work on a laptop CPU with nothing
  downloaded. `tiny-llama` is the model of the benchmarks' peer task (hidden 128, 4 layers, tied embeddings).
- The default tokenizer is ByT5's byte-level one (256 bytes + 3 specials): it is built in code, so a fresh
  machine with no network can still train and save a complete, reloadable model.
- Anything else goes through the Auto classes, from a local directory or (where the network allows) the Hub.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoTokenizer, ByT5Tokenizer, LlamaConfig, LlamaForCausalLM

from .config import ConfigError, first_line
from .tasks import (
    IMAGE_CLASSIFICATION,
    MASKED_LM,
    TASK_PRESETS,
    TASKS,
    build_task_preset,
    check_fits_task,
    class_settings,
    get_task,
    saved_as,
)

logger = logging.getLogger(__name__)

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


def byte_tokenizer(mask: bool = False) -> ByT5Tokenizer:
    """ByT5's byte-level tokenizer: 259 ids (pad 0, eos 1, unk 2, then the 256 bytes); no files needed. With `mask`
    (masked language models) one more id, 259, is its mask token."""
    if not mask:
        return ByT5Tokenizer(extra_ids=0)
    tokenizer = ByT5Tokenizer(extra_ids=1)
    tokenizer.mask_token = "<extra_id_0>"
    return tokenizer


# The byte tokenizer's chat template: each turn as "<|role|>" on a line of its own, its text, EOS; a prompt that asks
# for a reply ends with "<|assistant|>". TRL and the chat datasets render conversations with it.
BYTE_CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + "
                      "eos_token + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}"
                      "{% endif %}")


def give_chat_template(tokenizer) -> bool:
    """Whether `tokenizer` can render conversations: it has a chat template, or it is the built-in byte tokenizer,
    which is given BYTE_CHAT_TEMPLATE (saved with it, so the trained model renders chats as it was trained).

    Args:
        tokenizer (PreTrainedTokenizerBase): a transformers tokenizer; the byte tokenizer's `chat_template` is set
            in place.

    Returns:
        bool: True when `tokenizer.apply_chat_template` can now render a conversation (TRL's SFT and DPO trainers
            need it), False when it has no template and is not the byte tokenizer.

    Examples:
        >>> tokenizer = byte_tokenizer()
        >>> give_chat_template(tokenizer), tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
        ...                                                               tokenize=False)
        (True, '<|user|>\\nhi</s>\\n')
    """
    if getattr(tokenizer, "chat_template", None):
        return True
    if isinstance(tokenizer, ByT5Tokenizer) and len(tokenizer) == len(byte_tokenizer()):
        tokenizer.chat_template = BYTE_CHAT_TEMPLATE
        return True
    return False


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


def weights_dtype(name: str) -> torch.dtype | str:
    """The dtype RunArguments.torch_dtype names, as `from_pretrained` takes it ("auto" stays a string)."""
    return name if name == "auto" else getattr(torch, name)


def load_model_and_tokenizer(name_or_path: str, max_positions: int = 256, seed: int = 0,
                             tokenizer_name_or_path: str | None = None, dtype: str = "auto", task: str = "causal-lm",
                             labels: list[str] | None = None):
    """Return (model, tokenizer) for a preset name, a local model directory, or a Hub id, its weights in `dtype`
    ("auto": a checkpoint's own, float32 for a preset; a preset in bfloat16 is initialised in float32 and rounded,
    so it starts where the float32 one does), for `task` (hf_diloco.tasks: the model class transformers uses for
    it). The tokenizer is the model's own (a preset's: the byte tokenizer; an image classifier's: none), or the one
    `tokenizer_name_or_path` names ("byte": the built-in byte tokenizer; a preset's vocabulary is then sized to it).
    A classifier has one class per name in `labels` (id order; its config's `id2label`), two by default.
    A checkpoint loads as `from_pretrained` loads it for the task, new weights (a classifier's head on a pretrained
    encoder) said in one logged line (`Loaded.note`); a checkpoint the task cannot train (`check_fits_task`), and a
    tokenizer that cannot be loaded, is empty or has more ids than the model's embeddings, are refused in one
    sentence (ConfigError): nothing is substituted.

    Args:
        name_or_path: a preset (`tiny-llama`, `tiny-bert`, ..., the `model` field's help lists them), a folder that
            `save_pretrained` wrote, or a Hub model id.
        max_positions: a preset's context length (its position embeddings); ignored for a checkpoint.
        seed: a preset's initialisation seed (identical seeds, identical weights on every replica).
        tokenizer_name_or_path: another tokenizer than the model's, or "byte" for the built-in byte tokenizer.
        dtype: "auto", "float32" or "bfloat16": the weights' dtype.
        task: one of hf_diloco.tasks.TASKS ("causal-lm", "masked-lm", "sequence-classification", ...).
        labels: a classifier's class names, in id order.

    Returns:
        tuple[PreTrainedModel, PreTrainedTokenizerBase | None]: (model, tokenizer); the tokenizer is None for an
            image classifier.

    Examples:
        >>> model, tokenizer = load_model_and_tokenizer("tiny-bert", task="sequence-classification",
        ...                                             labels=["negative", "positive"])
        >>> type(model).__name__, model.config.id2label
        ('BertForSequenceClassification', {0: 'negative', 1: 'positive'})
    """
    loaded = load_model(name_or_path, max_positions, seed, tokenizer_name_or_path, dtype, task, labels)
    if loaded.note:
        logger.warning(loaded.note)
    return loaded.model, loaded.tokenizer


@dataclass
class Loaded:
    model: torch.nn.Module
    tokenizer: object | None
    note: str | None = None  # what the checkpoint did not hold and was initialised new (`loading_note`)


def load_model(name_or_path: str, max_positions: int = 256, seed: int = 0, tokenizer_name_or_path: str | None = None,
               dtype: str = "auto", task: str = "causal-lm", labels: list[str] | None = None) -> Loaded:
    """`load_model_and_tokenizer`'s work, with its note returned for the caller to show (a run prints it once)."""
    kind = get_task(task)
    if labels is not None and not kind.new_head:
        raise ValueError(f"labels are a classifier's; task {kind.name} has none")
    shown = f"tokenizer {tokenizer_name_or_path!r}" if tokenizer_name_or_path else \
        f"the tokenizer of model {name_or_path!r}"
    if name_or_path in PRESETS or name_or_path in TASK_PRESETS:
        tokenizer = None if kind.name == IMAGE_CLASSIFICATION else \
            load_tokenizer(tokenizer_name_or_path or BYTE, shown, mask=kind.name == MASKED_LM)
        if name_or_path in TASK_PRESETS:
            model = build_task_preset(name_or_path, kind, tokenizer, max_positions, seed, labels)
        elif kind.name != "causal-lm":
            raise ConfigError(f"preset {name_or_path!r} is a causal language model; task {kind.name} starts from "
                              f"preset {kind.preset!r} (or a model of its own).")
        else:
            model = build_preset(name_or_path, tokenizer, max_positions, seed)
        return Loaded((model if dtype == "auto" else model.to(weights_dtype(dtype))), tokenizer)
    source = _source(name_or_path)
    config = load_model_config(name_or_path)
    check_fits_task(config, kind, name_or_path)
    import transformers

    # A classifier's head of another size is replaced (and said in the note).
    classes = {} if labels is None else {**class_settings(labels), "ignore_mismatched_sizes": True}
    try:
        with _load_report_quiet():  # its table of keys is said in one line below
            model, info = getattr(transformers, kind.auto_class).from_pretrained(
                source, dtype=weights_dtype(dtype), output_loading_info=True, **classes)
    except (OSError, ValueError) as error:
        raise ConfigError(_unloadable(name_or_path, error, source)) from None
    note = loading_note(name_or_path, saved_as(config), model, info, labels)
    if kind.name == IMAGE_CLASSIFICATION:
        return Loaded(model, None, note)
    tokenizer = load_tokenizer(tokenizer_name_or_path or source, shown, mask=kind.name == MASKED_LM)
    check_vocabulary(tokenizer, model, name_or_path)
    return Loaded(model, tokenizer, note)


@contextmanager
def _load_report_quiet():
    """transformers' table of the keys a checkpoint lacked or had over, which `loading_note` says in a line."""
    report = logging.getLogger("transformers.modeling_utils")
    level = report.level
    report.setLevel(logging.ERROR)
    try:
        yield
    finally:
        report.setLevel(level)


def loading_note(shown: str, saved: str, model, info: dict, labels: list[str] | None) -> str | None:
    """One line on what loading a checkpoint (`saved`, as tasks.saved_as says) into `model` left new and left out,
    from `from_pretrained`'s loading info; None when every weight came from the checkpoint.

    >>> loading_note("m", "a BertModel (no task head)", torch.nn.Linear(1, 1),
    ...              {"missing_keys": {"classifier.weight", "classifier.bias"}, "mismatched_keys": set(),
    ...               "unexpected_keys": set()}, ["neg", "pos"])
    "model 'm' is a BertModel (no task head), loaded as a Linear: a new classification head of 2 labels (neg, pos) \
is initialised (classifier.bias, classifier.weight)."
    """
    new = sorted(set(info["missing_keys"]) | {key[0] for key in info["mismatched_keys"]})
    if not new:
        return None
    what = "new weights are" if labels is None else \
        f"a new classification head of {len(labels)} labels ({_few(labels, 6)}) is"
    note = f"model {shown!r} is {saved}, loaded as a {type(model).__name__}: {what} initialised ({_few(new, 4)})"
    left = sorted(info["unexpected_keys"])
    return note + (f"; the checkpoint's {_few(left, 4)} are left out." if left else ".")


def _few(names: list[str], shown: int) -> str:
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


BYTE = "byte"  # tokenizer_name_or_path of the built-in byte tokenizer


def load_tokenizer(name_or_path: str, shown: str, mask: bool = False):
    """The tokenizer at `name_or_path` (a folder or Hub id; "byte": the built-in one), with a pad token (its EOS
    where it has none). ConfigError, naming it as `shown`, when it cannot be loaded or turns text into no tokens,
    or, with `mask` (masked LM), has no mask token."""
    if name_or_path == BYTE:
        return byte_tokenizer(mask)
    try:
        tokenizer = AutoTokenizer.from_pretrained(os.path.expanduser(name_or_path))
    except Exception as error:  # tokenizers raise many types; the user needs the one-line reason
        raise ConfigError(f"could not load {shown} ({first_line(error)}); nothing is substituted: give the folder "
                          f"its tokenizer files, or name one with tokenizer_name_or_path ('{BYTE}': the built-in "
                          f"byte tokenizer).") from None
    probe = tokenizer("hello world", add_special_tokens=False)["input_ids"]
    if len(tokenizer) == 0 or not [i for i in probe if i != tokenizer.unk_token_id]:
        raise ConfigError(f"{shown} is empty: it turns text into no tokens (a folder without tokenizer files loads "
                          f"this way); give the folder its tokenizer files, or name one with tokenizer_name_or_path "
                          f"('{BYTE}': the built-in byte tokenizer).")
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    if mask and tokenizer.mask_token is None:
        raise ConfigError(f"{shown} has no mask token, which masked language modelling replaces tokens with; name "
                          f"one that has (a BERT-like model's own) with tokenizer_name_or_path.")
    return tokenizer


def check_vocabulary(tokenizer, model, shown: str) -> None:
    """A tokenizer whose ids run past the model's embedding rows does not belong to it (ConfigError)."""
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:
        raise ConfigError(f"the tokenizer has {len(tokenizer)} ids but model {shown!r} embeds {rows}: they do not "
                          f"belong together; name the model's own tokenizer with tokenizer_name_or_path.")


def check_causal(config, shown: str) -> None:
    """The task causal-lm's check (hf_diloco.tasks.check_fits_task): a model whose saved head is another task's (a
    masked LM, whose attention would see the tokens it predicts; an encoder-decoder; a classifier) is refused in one
    sentence, before anything is loaded."""
    check_fits_task(config, TASKS["causal-lm"], shown)


def load_model_config(name_or_path: str):
    """The config of a model that is not a preset: a local directory's config.json, or a Hub model's (that file
    alone is downloaded), read as `load_model_and_tokenizer` would read it; ConfigError in its sentence."""
    source = _source(name_or_path)
    try:
        return AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as error:
        raise ConfigError(_unloadable(name_or_path, error, source)) from None


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


def _unloadable(shown: str, error: BaseException, source: str) -> str:
    if os.path.isdir(source):
        return f"could not load model {shown!r} from its folder: {first_line(error)}."
    return (f"could not load model {shown!r}: it is not a preset ({', '.join(PRESETS)}), not a local model "
            f"directory, and the Hub did not provide it ({first_line(error)}).")
