"""The values DiLoCoConfig's fields may take, in one place: `DiLoCoConfig.__post_init__`, `RunArguments` and the
app's form all ask here, so a value is refused by each of them or by none, in the same sentence.

    refusal(name, value)    the sentence refusing `value` for field `name`, or None when it is allowed
    check(config, names)    raise ConfigError with the first refusal among `names`, read from `config`
    from_text(name, text)   a value typed into a form, as the field's type (refused in the field's own sentence)
    check_torchft(config)   the torchft fields (ranges, replica_id below num_replicas)
    rounds_note(...)        H against max_steps: the warning for a run that syncs only at its end
    require_torchft()       torchft is installed (asked of importlib, without importing it)

Design choices:
- A field's rule is data (`Allowed`: the words of the sentence, a test, whether it takes whole numbers only), so
  the sentence is built one way: "<field> must be <words>, got <value>." Rules that relate several fields
  (sparse_k against sparse_chunk, sync_delay against inner_steps) stay beside the config that holds them.
- A whole-number field refuses floats and booleans, a number field refuses text: a wrong type reads as the same
  sentence as a wrong value instead of a TypeError.
- Pure Python: no torch, no transformers, no backend (the app imports this to check its form as it is typed).
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

OUTER_OPTIMIZERS = ("sgd", "adamw")
INNER_OPTIMIZERS = ("adamw", "muon")  # Trainer's own (`optim`), or Muon + AdamW (hf_diloco.inner)
FINAL_SYNCS = ("auto", "staggered", "blocking")
OVERLAP_LANDINGS = ("mix", "eager")
DATA_SHARDINGS = ("iid", "non_iid")
FRAGMENT_PATTERNS = ("strided", "sequential")
OUTER_BACKENDS = ("torch", "torchft")
TRAINERS = ("diloco", "sft", "dpo", "ddp")
TRL_TRAINERS = ("sft", "dpo")  # TRL's SFTTrainer and DPOTrainer with DiLoCo (hf_diloco.trl)
CHECK_MODES = ("exclude", "warn", "off")  # contribution_checks (hf_diloco.contributions)
AUTO = "auto"  # inner_steps and sync_delay may be chosen from measurements (see DiLoCoConfig)

INSTALL_HINT = "outer_backend torchft needs torchft: pip install -e '.[ft]' (or pip install torchft==0.2.0)."
NO_LIGHTHOUSE = ("outer_backend torchft needs a Lighthouse: pass --lighthouse http://HOST:PORT (start one with "
                 "`hf-diloco lighthouse`) or set TORCHFT_LIGHTHOUSE.")


@dataclass(frozen=True)
class Allowed:
    """What one field may hold: `words` complete "<field> must be ...", `test` takes a number of the right type."""

    words: str
    test: Callable[[float], bool]
    whole: bool = False  # whole numbers only (int, never bool)
    label: str = ""  # how the sentence names the field, when not by its name alone

    def refusal(self, name: str, value: Any) -> str | None:
        kinds = (int,) if self.whole else (int, float)
        if isinstance(value, kinds) and not isinstance(value, bool) and self.test(value):
            return None
        return f"{self.label or name} must be {self.words}, got {value!r}."


def _at_least(low: int, words: str | None = None) -> Allowed:
    return Allowed(words or f"a whole number of at least {low}", lambda v: v >= low, whole=True)


def _positive(words: str = "a positive number") -> Allowed:
    return Allowed(words, lambda v: 0 < v < math.inf)


def _not_negative(words: str = "0 or more") -> Allowed:
    return Allowed(words, lambda v: 0 <= v < math.inf)


FIELDS: dict[str, Allowed] = {
    # DiLoCoConfig: the outer loop
    "inner_steps": Allowed("a whole number of at least 1", lambda v: v >= 1, whole=True, label="inner_steps (H)"),
    "max_sync_overhead": Allowed("a fraction in (0, 1)", lambda v: 0 < v < 1),
    "outer_lr": _positive(),
    "outer_momentum": Allowed("in [0, 1)", lambda v: 0 <= v < 1),
    "learning_rate": _not_negative(),
    # the replica and its sync
    "replica_group_size": _at_least(1),
    "tp_size": _at_least(1, "1 or more"),
    "sync_bucket_mb": _positive("positive"),
    "save_every_rounds": _at_least(0, "a whole number, 0 (off) or more"),
    "sync_timeout": _positive("a positive number of seconds"),
    "max_bad_rounds": _at_least(1),
    # compression
    "compression_chunk": _at_least(1),
    "sparse_chunk": _at_least(2),
    "sparse_bits": Allowed("between 1 and 8", lambda v: 1 <= v <= 8, whole=True),
    "error_feedback_decay": Allowed("in (0, 1]", lambda v: 0 < v <= 1),
    "outer_momentum_delay": _at_least(1, "a whole number of syncs, 1 (plain Nesterov) or more"),
    "outer_delayed_scale": Allowed("in (0, 1]", lambda v: 0 < v <= 1),
    "outer_momentum_restart": _at_least(0, "a whole number of syncs, 0 (never) or more"),
    # streaming
    "num_fragments": _at_least(1),
    "sync_delay": _at_least(0, "a whole number of steps, 0 or more"),
    "fragment_alpha": Allowed("in [0, 1)", lambda v: 0 <= v < 1),
    # contribution checks
    "contribution_adam_ratio": _positive(),
    "contribution_norm_ratio": Allowed("above 1", lambda v: 1 < v < math.inf),
    "contribution_min_agreement": Allowed("in [-1, 1]", lambda v: -1 <= v <= 1),
    "contribution_agreement_gap": Allowed("in (0, 2]", lambda v: 0 < v <= 2),
    "contribution_faulty_after": _at_least(1),
    "contribution_loss_batch": _at_least(1),
    "contribution_loss_margin": _not_negative(),
    # torchft
    "min_replicas": _at_least(1, "at least 1"),
    "sync_grace_seconds": _not_negative(),
    "group_timeout": _positive("a positive number of seconds"),
    "end_linger_seconds": _not_negative(),
    "round_seconds": _not_negative("0 (off) or a positive number"),
    # RunArguments
    "block_size": _at_least(2, "at least 2 tokens"),
    "eval_fraction": Allowed("in [0, 1)", lambda v: 0 <= v < 1),
    "lora_r": _at_least(0, "0 (no LoRA) or a positive rank"),
}
# Fields whose value may be "auto" (chosen from measurements; DiLoCoConfig turns it into the measuring value).
AUTO_FIELDS = ("inner_steps", "sync_delay")
TORCHFT_FIELDS = ("min_replicas", "sync_grace_seconds", "group_timeout", "end_linger_seconds", "round_seconds")


def refusal(name: str, value: Any) -> str | None:
    """The sentence refusing `value` for field `name`; None when it is allowed.

    >>> refusal("outer_momentum", 1.0)
    'outer_momentum must be in [0, 1), got 1.0.'
    >>> refusal("inner_steps", 0), refusal("inner_steps", "auto"), refusal("outer_lr", 0.7)
    ('inner_steps (H) must be a whole number of at least 1, got 0.', None, None)
    """
    if value == AUTO and name in AUTO_FIELDS:
        return None
    return FIELDS[name].refusal(name, value)


def check(config: Any, names: Iterable[str]) -> None:
    """Raise ConfigError with the refusal of the first of `names` whose value on `config` is not allowed."""
    for name in names:
        sentence = refusal(name, getattr(config, name))
        if sentence:
            raise ConfigError(sentence)


def from_text(name: str, text: str) -> Any:
    """`text` (typed into a form) as a value of field `name`; ConfigError, in the field's own sentence, when it is
    not a number of the field's kind or not allowed.

    >>> from_text("outer_lr", " 0.5 "), from_text("inner_steps", "auto")
    (0.5, 'auto')
    >>> from_text("inner_steps", "five")
    Traceback (most recent call last):
    ...
    hf_diloco.errors.ConfigError: inner_steps (H) must be a whole number of at least 1, got 'five'.
    """
    text = str(text).strip()
    value: Any = text
    if not (text == AUTO and name in AUTO_FIELDS):
        try:
            value = int(text) if FIELDS[name].whole else float(text)
        except ValueError:
            pass  # refused below, in the field's own sentence
    sentence = refusal(name, value)
    if sentence:
        raise ConfigError(sentence)
    return value


def check_torchft(config: Any) -> None:
    """What outer_backend torchft needs of its own fields, in one sentence each (nothing for other backends)."""
    if config.outer_backend != "torchft":
        return
    check(config, TORCHFT_FIELDS[:1])
    if not 0 <= config.replica_id < max(config.num_replicas, 1):
        raise ConfigError(f"replica_id must be in [0, num_replicas={config.num_replicas}), got {config.replica_id}.")
    check(config, TORCHFT_FIELDS[1:])


def rounds_note(inner_steps: int | str, max_steps: int, trainer: str = "diloco", round_seconds: float = 0.0
                ) -> str | None:
    """The warning for an H (`inner_steps`) above `max_steps`, or None: such a run is allowed, and syncs once, at
    its last step (the end always syncs), which is DiLoCo with one round. Nothing to say for the `ddp` baseline (it
    has no rounds), rounds of `round_seconds` (they end by the clock), H `auto` (chosen as the run goes) or a run
    sized in epochs (`max_steps` 0 or less: Trainer's count is known once training begins).

    >>> rounds_note(50, 400), rounds_note(500, 400, trainer="ddp"), rounds_note("auto", 10)
    (None, None, None)
    >>> for part in rounds_note(500, 400).split(": "):
    ...     print(part)
    H = 500 inner steps is above max steps = 400
    the replicas sync once, at the last step; choose H at most 400 to sync along the way.
    """
    if trainer == "ddp" or round_seconds > 0 or inner_steps == AUTO or max_steps <= 0 or inner_steps <= max_steps:
        return None
    return (f"H = {inner_steps} inner steps is above max steps = {max_steps}: the replicas sync once, at the last "
            f"step; choose H at most {max_steps} to sync along the way.")


def torchft_installed() -> bool:
    """Whether torchft can be imported here (found without importing it: it loads torch)."""
    try:
        return importlib.util.find_spec("torchft") is not None
    except (ImportError, ValueError):  # a broken or half-removed install
        return False


def require_torchft() -> None:
    """One sentence telling how to install torchft, when it is not installed."""
    if not torchft_installed():
        raise ConfigError(INSTALL_HINT)


def require_lighthouse(config: Any) -> None:
    """A torchft replica about to train needs a Lighthouse address (`hf-diloco launch --replicas` passes its own)."""
    if config.outer_backend == "torchft" and not (config.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")):
        raise ConfigError(NO_LIGHTHOUSE)
