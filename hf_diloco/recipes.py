"""Recipes: a YAML file whose keys are fields, and flags that override them, parsed into the run's arguments.

    parse_train_args(recipe, overrides)   (RunArguments, the config) of `hf-diloco train`, `launch`, `slurm`, `plan`
    config_class(trainer, task)           the config class: DiLoCoConfig, or Seq2Seq's or TRL's joined to it

Every key and flag must be a field (HfArgumentParser turns each field's help into its `--help`); `inner_steps: auto`
and `sync_delay: auto` stand for their auto fields; a bad key, flag or value is one sentence (CLIError, exit
status 2), never a usage dump or a traceback. Imported by hf_diloco.cli and hf_diloco.plan alike, so
neither imports the other; the config (transformers, torch) is imported only when a recipe is parsed, so that the
commands that parse none (app, push, lighthouse) start in a fraction of a second.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from .checks import TRL_TRAINERS
from .errors import ConfigError, first_line
from .files import read_yaml

# The Hub token a launch hands its workers (hf_diloco.launch.Launch), in their environment: a command line is
# readable by every user of the machine (`ps`), a process's environment by its owner only.
HUB_TOKEN_ENV = "HF_DILOCO_HUB_TOKEN"


class CLIError(ConfigError):
    """A bad recipe key, flag or value: the command ends with its message and exit status 2."""


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag or value in one sentence (CLIError, exit 2) instead of printing its usage."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)  # a misspelt or shortened flag is an error, not a guess
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        raise CLIError(f"{message.rstrip('.')}; see `{self.prog} --help`.")


def field_parser(arguments: type | None = None):
    """HfArgumentParser over RunArguments and DiLoCoConfig (or `arguments`, the config class of a TRL trainer) that
    reports errors like `Parser`."""
    from transformers import HfArgumentParser

    from .config import DiLoCoConfig, RunArguments

    class FieldParser(HfArgumentParser):
        def error(self, message: str):
            raise CLIError(f"{message.rstrip('.')}; see `hf-diloco train --help`.")

    parser = FieldParser((RunArguments, arguments or DiLoCoConfig), prog="hf-diloco train", allow_abbrev=False)
    for action in parser._actions:
        if action.help:  # field help is prose ("inner_steps % F == 0"), not an argparse format string
            action.help = re.sub(r"%(?!\()", "%%", action.help)
    return parser


def parse_train_args(recipe: str | None, overrides: list[str], checking_only: bool = False):
    """(RunArguments, DiLoCoConfig) from a recipe plus flag overrides; every key and flag must be a field.

    Device settings (bf16, tf32, ...) are not checked in a dry run or when `checking_only` (`launch --dry-run`).
    """
    from dataclasses import fields

    from .config import RunArguments

    values = read_yaml(recipe, "recipe") if recipe else {}
    # A recipe that names no output folder writes under runs/, where `hf-diloco app` looks by default.
    values.setdefault("output_dir", f"runs/{Path(recipe).stem if recipe else 'run'}")
    trainer = _named(values, overrides, "trainer", "diloco")
    if trainer == "ddp" and values.get("trainer") in TRL_TRAINERS:
        # The baseline of a TRL recipe keeps TRL's trainer and its fields (max_length, beta, ...), without DiLoCo.
        trainer = values["trainer"]
    try:
        arguments = config_class(trainer, _named(values, overrides, "task", "causal-lm"))
    except ConfigError as error:
        raise CLIError(str(error)) from None
    parser = field_parser(arguments)
    known = {f.name for dtype in (RunArguments, arguments) for f in fields(dtype) if f.init}
    unknown = sorted(set(values) - known)
    if unknown:
        raise CLIError(
            f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} in recipe {recipe!r}; "
            f"keys must be DiLoCoConfig or RunArguments fields (see `hf-diloco train --help`)."
        )
    if os.environ.get(HUB_TOKEN_ENV) and "hub_token" not in values:
        values["hub_token"] = os.environ[HUB_TOKEN_ENV]  # (a flag still wins)
    values, overrides = _auto_fields(values, overrides)
    # Floats go back to text so that argparse converts them with the field's own type, like a flag.
    parser.set_defaults(**{k: str(v) if isinstance(v, float) else v for k, v in values.items()})
    namespace, rest = parser.parse_known_args(overrides)
    if rest:
        raise CLIError(f"unknown option(s) {' '.join(rest)}; see `hf-diloco train --help`.")
    if namespace.dry_run or checking_only:
        # Whatever its spelling (--dry_run, --dry-run, --dry_run=true, dry_run: true in the recipe, launch's
        # --dry-run), a dry run checks a recipe on any machine: device settings only matter once training starts.
        _drop_device_requirements(namespace)
    try:
        return (RunArguments(**_fields_of(RunArguments, namespace)),
                arguments(**_fields_of(arguments, namespace)))
    except ValueError as error:
        raise CLIError(first_line(error) + ".") from None


def _named(values: dict, overrides: list[str], key: str, default: str) -> str:
    """The `key` (trainer, task) a recipe and its flags ask for (the last flag wins), before they are parsed: the
    trainer and task decide the arguments class, and so which fields the recipe may have."""
    chosen = str(values.get(key, default))
    for i, item in enumerate(overrides):
        if item == f"--{key}" and i + 1 < len(overrides):
            chosen = overrides[i + 1]
        elif item.startswith(f"--{key}="):
            chosen = item.split("=", 1)[1]
    return chosen


def _auto_fields(values: dict, overrides: list[str]) -> tuple[dict, list[str]]:
    """`inner_steps: auto` / `sync_delay: auto` (recipe) and `--inner_steps auto` / `--sync_delay auto` (flag, any
    spelling) as the fields they stand for: auto_inner_steps or auto_sync_delay true, and the measuring rounds'
    value."""
    from .config import AUTO_DELAY_START, AUTO_START

    autos = {"inner_steps": (AUTO_START, "auto_inner_steps"), "sync_delay": (AUTO_DELAY_START, "auto_sync_delay")}
    for name, (start, switch) in autos.items():
        if values.get(name) == "auto":
            values = {**values, name: start, switch: True}
    flags, rest = [], list(overrides)
    while rest:
        item = rest.pop(0)
        for name, (start, switch) in autos.items():
            spellings = (f"--{name}", f"--{name.replace('_', '-')}")
            if item in tuple(f"{s}=auto" for s in spellings) or (item in spellings and rest[:1] == ["auto"]):
                if "=" not in item:
                    rest.pop(0)
                flags += [f"--{name}", str(start), f"--{switch}", "true"]
                break
        else:
            flags.append(item)
    return values, flags


def _fields_of(dtype, namespace: argparse.Namespace) -> dict:
    from dataclasses import fields

    return {f.name: getattr(namespace, f.name) for f in fields(dtype) if f.init and hasattr(namespace, f.name)}


def _drop_device_requirements(namespace: argparse.Namespace) -> None:
    """Switch off the settings TrainingArguments refuses on a machine without the device they need."""
    import torch

    if not torch.cuda.is_available():
        for name in ("bf16", "fp16", "bf16_full_eval", "fp16_full_eval"):
            setattr(namespace, name, False)
        namespace.tf32 = None


def config_class(trainer: str, task: str = "causal-lm") -> type:
    """The arguments class of `trainer` and `task`: DiLoCoConfig; for seq2seq, Seq2SeqTrainingArguments joined to it;
    with TRL's trainers the config that joins theirs to it (ConfigError in one sentence when TRL is not
    installed)."""
    if task == "seq2seq":
        from .trainer import DiLoCoSeq2SeqConfig

        return DiLoCoSeq2SeqConfig
    if trainer not in TRL_TRAINERS:
        from .config import DiLoCoConfig

        return DiLoCoConfig
    try:
        from . import trl
    except ImportError:
        raise ConfigError(f"trainer {trainer} is TRL's {'SFT' if trainer == 'sft' else 'DPO'}Trainer, and TRL is not "
                          f"installed: pip install 'hf-diloco[trl]'.") from None
    return trl.DiLoCoSFTConfig if trainer == "sft" else trl.DiLoCoDPOConfig
