"""The launch form: allowed files, form values to command-line flags, validation by the CLI itself.

Design choices:
- Recipes and accelerate configs can only come from the project's recipes/ and accelerate_configs/ folders or from
  the runs directory (edited recipes are saved there); any other path is refused, so the form cannot be used to
  read or run files elsewhere.
- Every knob is checked as it is typed (`check_knobs`: whole numbers, ranges, machine rank below the number of
  machines); the knobs that are DiLoCoConfig fields (H, outer learning rate and momentum) by hf_diloco.checks, the
  rules DiLoCoConfig itself applies, so the form and the config refuse the same values in the same sentence. Model
  and dataset paths are checked to exist before Preview says anything is valid, and then the
  form is validated by the same code as the command line: `hf-diloco launch ... --dry-run` runs in the checker,
  a process kept for the form's checks (`Checker`; the app never imports torch), in the environment the run will
  get (`runs.training_env`: no Hub token, no app password), and its one-sentence error is shown beside the form.
- A recipe with `outer_backend: torchft` runs as `hf-diloco launch ... --replicas N` (a Lighthouse and N replicas on
  this machine): the replicas knob is N (blank: the recipe's num_replicas, else 3), the launcher sets each
  replica's Lighthouse, address and id, and the multi-node settings do not apply.
- Commands are argument lists, never shell strings.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import ipaddress
import json
import math
import os
import queue
import re
import subprocess
import sys
import threading
from dataclasses import dataclass, fields
from pathlib import Path

import yaml

from hf_diloco import checker, checks, runs
from hf_diloco.errors import ConfigError
from hf_diloco.files import read_yaml
from hf_diloco.tasks import TASK_PRESETS, TASKS

PROJECT = Path(__file__).resolve().parents[1]
RECIPES = PROJECT / "recipes"
CONFIGS = PROJECT / "accelerate_configs"


class FormError(ValueError):
    """Shown beside the form; nothing is started."""


@dataclass
class Knobs:
    """The main settings the form exposes; empty means "as in the recipe"."""

    replicas: str = ""
    inner_steps: str = ""
    outer_lr: str = ""
    outer_momentum: str = ""
    max_steps: str = ""
    model_name_or_path: str = ""
    dataset_name: str = ""
    task: str = ""
    trainer: str = ""
    num_machines: str = ""
    machine_rank: str = ""
    main_process_ip: str = ""
    main_process_port: str = ""
    restarts: str = ""


RECIPE_FIELDS = ("inner_steps", "outer_lr", "outer_momentum", "max_steps", "model_name_or_path", "dataset_name",
                 "task", "trainer")
# The replicas knob becomes --num_processes = replicas × replica_group_size (see flags).
LAUNCH_FIELDS = {"replicas": "--num_processes", "num_machines": "--num_machines", "machine_rank": "--machine_rank",
                 "main_process_ip": "--main_process_ip", "main_process_port": "--main_process_port"}


# Knobs that are DiLoCoConfig fields: checked by hf_diloco.checks, as DiLoCoConfig checks them ("auto" H included).
CONFIG_KNOBS = ("inner_steps", "outer_lr", "outer_momentum")
# The other knobs, launch settings. name: (label in messages, type, lowest allowed, highest allowed or None)
NUMBERS = {
    "replicas": ("replicas", int, 1, None),
    "max_steps": ("max steps", int, 1, None),
    "num_machines": ("machines", int, 1, None),
    "machine_rank": ("this machine's rank", int, 0, None),
    "main_process_port": ("main machine port", int, 1, 65535),
    "restarts": ("restarts", int, 0, None),
}
SHORT_NAMES = {"replicas": "x", "inner_steps": "H", "outer_lr": "olr", "outer_momentum": "mom", "max_steps": "steps",
               "model_name_or_path": "", "dataset_name": "", "task": "", "trainer": "", "num_machines": "nodes",
               "restarts": "restarts"}
# The model presets, read from hf_diloco/models.py's PRESETS keys without importing it (it imports torch), and the
# task presets (hf_diloco.tasks imports nothing heavy).
PRESETS = tuple(re.findall(r'^    "([\w.-]+)": dict\(', (PROJECT / "hf_diloco" / "models.py").read_text(),
                           re.M)) + TASK_PRESETS
DATA_FILES = (".txt", ".json", ".jsonl", ".csv", ".parquet", ".arrow")  # a name ending so is a file, not a Hub id
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


# --- what a run started from the app may set -------------------------------------------------------------------
# Every DiLoCoConfig / RunArguments field of hf-diloco itself (read from hf_diloco/config.py without importing it),
# plus the TrainingArguments that shape the training. Anything else (push_to_hub, hub_token, report_to, deepspeed,
# logging or output paths, ...) is refused: pushing has its own tab, and the app decides where a run writes.
TRAINING_KEYS = frozenset({
    "learning_rate", "weight_decay", "warmup_steps", "warmup_ratio", "lr_scheduler_type", "max_grad_norm", "optim",
    "adam_beta1", "adam_beta2", "adam_epsilon", "per_device_train_batch_size", "per_device_eval_batch_size",
    "gradient_accumulation_steps", "gradient_checkpointing", "max_steps", "num_train_epochs", "seed", "data_seed",
    "eval_strategy", "eval_steps", "eval_on_start", "save_strategy", "save_steps", "save_total_limit",
    "logging_steps", "logging_first_step", "log_level", "disable_tqdm", "bf16", "fp16", "tf32", "use_cpu",
    "dataloader_num_workers", "dataloader_drop_last", "train_sampling_strategy", "resume_from_checkpoint",
    "output_dir", "report_to", "fsdp", "fsdp_config",  # FSDP2 inside each replica (Models bigger than one device)
})
# Keys that may appear with some values only: the app sets the output folder, resumes only inside it, and reports
# only to files on this machine (TensorBoard), never to an online tracker.
RESUME_VALUES = ("auto", "latest", "", None)
REPORT_VALUES = ("none", "tensorboard", None)
# torchft fields that `hf-diloco launch --replicas N` sets for each replica it starts.
LAUNCHER_KEYS = ("lighthouse", "replica_address", "replica_id")
TORCHFT_CONFIG = "torchft-replica.yaml"  # one process per replica
DEFAULT_TORCHFT_REPLICAS = 3
DEFAULT_RESTARTS = 3  # a torchft replica that fails is started again this many times (it heals from the others)


def library_fields() -> frozenset[str]:
    """The field names of DiLoCoConfig and RunArguments, read from the source (the app does not import torch)."""
    import ast

    tree = ast.parse((PROJECT / "hf_diloco" / "config.py").read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in ("DiLoCoConfig", "RunArguments"):
            names |= {item.target.id for item in node.body
                      if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)}
    return frozenset(names)


@functools.cache
def training_argument_fields() -> frozenset[str]:
    """The field names of transformers' TrainingArguments, read from its source (importing it imports torch)."""
    import ast
    import importlib.util

    source = Path(importlib.util.find_spec("transformers").origin).parent / "training_args.py"
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == "TrainingArguments":
            return frozenset(item.target.id for item in node.body
                             if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name))
    return frozenset()


TRL_CONFIGS = {"sft": ("sft_config.py", "SFTConfig"), "dpo": ("dpo_config.py", "DPOConfig")}


@functools.cache
def trl_fields(trainer: str) -> frozenset[str]:
    """The fields TRL's SFTConfig or DPOConfig (`trainer: sft` / `dpo`) and their TRL base add to
    TrainingArguments (`max_length`, `beta`, ...), read from TRL's source (importing TRL imports torch); the
    TrainingArguments fields they give other defaults stay under the app's rules for those. FormError when TRL is
    not installed."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("trl")
    if spec is None or spec.origin is None:
        raise FormError(f"trainer {trainer} is TRL's {TRL_CONFIGS[trainer][1].replace('Config', 'Trainer')}, and TRL "
                        f"is not installed here: pip install 'hf-diloco[trl]'.")
    folder = Path(spec.origin).parent / "trainer"
    names = set()
    for file, name in ((TRL_CONFIGS[trainer][0], TRL_CONFIGS[trainer][1]), ("base_config.py", "_BaseConfig")):
        for node in ast.parse((folder / file).read_text()).body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                names |= {item.target.id for item in node.body
                          if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)}
    return frozenset(names) - training_argument_fields()


def check_recipe_keys(recipe: Path, readable: tuple[Path, ...]) -> dict:
    """The recipe's values, if a run started from the app may take them (check_recipe_values); a FormError
    otherwise."""
    try:
        values = read_yaml(recipe, "recipe")
    except ConfigError as error:
        raise FormError(str(error)) from None
    return check_recipe_values(values, readable)


def check_recipe_values(values: dict, readable: tuple[Path, ...]) -> dict:
    """`values` (a recipe's), if every key is one a run started from the app may set and the model and dataset it
    names, where they are local paths, lie in the folders the app reads data from (`readable`); a FormError
    otherwise."""
    trainer = str(values.get("trainer", "diloco"))
    own = library_fields() | (trl_fields(trainer) if trainer in TRL_CONFIGS else frozenset())
    known = own | training_argument_fields()
    unknown = sorted(set(values) - known)
    if unknown:
        import difflib

        hints = []
        for key in unknown:
            guess = difflib.get_close_matches(str(key), known, n=1)
            hints.append(f"{key!r} (did you mean {guess[0]!r}?)" if guess else repr(key))
        raise FormError(f"the recipe has unknown key{'s' if len(unknown) > 1 else ''} {', '.join(hints)}: neither a "
                        f"DiLoCoConfig, RunArguments nor TrainingArguments field"
                        + (f" (nor {TRL_CONFIGS[trainer][1]}'s)." if trainer in TRL_CONFIGS else "."))
    refused = sorted(set(values) - own - TRAINING_KEYS)
    if refused:
        raise FormError(
            f"the app does not start runs that set {', '.join(map(repr, refused))}: a run started here may set "
            f"hf-diloco's own fields and the training settings (learning rate, batch, schedule, evaluation, saving); "
            f"push from the Push to Hub tab, and run anything else with `hf-diloco launch`."
        )
    launcher = sorted(set(values) & set(LAUNCHER_KEYS))
    if launcher:
        raise FormError(f"the recipe may not set {', '.join(map(repr, launcher))}: the app starts a torchft run's "
                        f"Lighthouse and replicas itself (for replicas on other machines, use `hf-diloco lighthouse` "
                        f"and `hf-diloco launch`).")
    if values.get("resume_from_checkpoint") not in RESUME_VALUES:
        raise FormError("resume_from_checkpoint may only be 'auto' or 'latest' here (the run's own checkpoints).")
    report = values.get("report_to")
    if not set(report if isinstance(report, list) else [report]) <= set(REPORT_VALUES):
        raise FormError(f"report_to may only be 'none' or 'tensorboard' here (files on this machine), got {report!r}.")
    for key, what in (("model_name_or_path", "model"), ("dataset_name", "dataset")):
        if isinstance(values.get(key), str):
            check_local_source(values[key], what, readable)
    return values


def rounds_note(knobs: Knobs, recipe_values: dict) -> str | None:
    """The warning for an H above max steps (knob, else recipe), the run's own words (hf_diloco.checks): such a run
    syncs once, at its last step. None otherwise."""
    inner = str(knobs.inner_steps).strip() or str(recipe_values.get("inner_steps", ""))
    steps = str(knobs.max_steps).strip() or str(recipe_values.get("max_steps", ""))
    if not (inner.isdigit() and steps.lstrip("-").isdigit()):
        return None
    return checks.rounds_note(int(inner), int(steps), str(recipe_values.get("trainer", "diloco")),
                              float(recipe_values.get("round_seconds") or 0))


def torchft_replicas(knobs: Knobs, recipe_values: dict) -> int | None:
    """For an `outer_backend: torchft` recipe, the N of `hf-diloco launch --replicas N`: the replicas knob, else the
    recipe's num_replicas, else 3. None for any other recipe."""
    if recipe_values.get("outer_backend") != "torchft":
        return None
    distributed = [NUMBERS[name][0] if name in NUMBERS else "main machine address"
                   for name in LAUNCH_FIELDS if name != "replicas" and str(getattr(knobs, name)).strip()]
    if distributed:
        raise FormError(f"the distributed settings ({', '.join(distributed)}) do not apply to a torchft run, whose "
                        f"replicas meet through the Lighthouse it starts on this machine; leave them blank.")
    text, recipe_count = str(knobs.replicas).strip(), recipe_values.get("num_replicas")
    if text:
        replicas = int(text)
    elif isinstance(recipe_count, int) and recipe_count > 0:
        replicas = recipe_count
    else:
        replicas = DEFAULT_TORCHFT_REPLICAS
    least = recipe_values.get("min_replicas", 1)
    if isinstance(least, int) and replicas < least:
        raise FormError(f"replicas = {replicas} is below the recipe's min_replicas = {least}, so no round could "
                        f"form; start at least {least} replicas or lower min_replicas.")
    return replicas


def restarts(knobs: Knobs, torchft: bool) -> int:
    """How many times a failed replica of a torchft run is started again: the restarts knob, else 3. The torch
    backend has no replica to start alone (all processes are one collective group), so the knob is refused there."""
    text = str(knobs.restarts).strip()
    if not torchft:
        if text:
            raise FormError("restarts apply to torchft runs, whose replicas are started again one by one; a torch-"
                            "backend run is one group of processes (resume it from its round checkpoint with "
                            "`hf-diloco launch --max-restarts N`); leave restarts blank.")
        return 0
    return int(text) if text else DEFAULT_RESTARTS


def is_torchft(recipe: Path) -> bool:
    """Whether the recipe file sets `outer_backend: torchft` (False for anything unreadable)."""
    try:
        return read_yaml(recipe, "recipe").get("outer_backend") == "torchft"
    except ConfigError:
        return False


def check_knobs(knobs: Knobs) -> None:
    """Refuse a knob that cannot be right, with one sentence, before anything runs."""
    for name in (f.name for f in fields(Knobs)):
        text = str(getattr(knobs, name)).strip()
        if not text:
            continue
        if name in CONFIG_KNOBS:
            try:
                checks.from_text(name, text)
            except ConfigError as error:
                raise FormError(str(error)) from None
        elif name in NUMBERS:
            check_number(text, *NUMBERS[name])
        elif name == "task" and text not in TASKS:
            raise FormError(f"task must be one of {', '.join(TASKS)}, got {text!r}.")
        elif name == "trainer" and text not in checks.TRAINERS:
            raise FormError(f"trainer must be one of {', '.join(checks.TRAINERS)}, got {text!r}.")
    machines, rank = str(knobs.num_machines).strip(), str(knobs.machine_rank).strip()
    if machines and rank and int(rank) >= int(machines):
        raise FormError(f"this machine's rank must be below the number of machines ({machines}), got {rank}; "
                        f"ranks count from 0.")
    check_main_address(str(knobs.main_process_ip).strip(), int(machines) if machines else 1)


def check_main_address(address: str, machines: int) -> None:
    """The rendezvous address the form passes on: one machine's name or address, and on one machine loopback (the
    rendezvous store listens where this says: anything else opens it to the network for nothing)."""
    if not address:
        return
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9.:\-]*", address) or address in ("0.0.0.0", "::"):
        raise FormError(f"the main machine address must be one machine's name or IP address, got {address!r}.")
    loopback = address == "localhost"
    with contextlib.suppress(ValueError):
        loopback = ipaddress.ip_address(address).is_loopback
    if machines == 1 and not loopback:
        raise FormError(f"a run on one machine meets on loopback: leave the main machine address blank (127.0.0.1) "
                        f"or set Machines above 1, got {address!r}.")


def check_number(text: str, label: str, kind: type, low: float, high: float | None) -> None:
    """A launch knob's `text` is a `kind` from `low` to `high` (None: no upper bound); FormError otherwise."""
    try:
        value = kind(text)
    except ValueError:
        wanted = "a whole number" if kind is int else "a number"
        raise FormError(f"{label} must be {wanted}, got {text!r}.") from None
    if not math.isfinite(value) or value < low or (high is not None and value > high):
        raise FormError(f"{label} must be at least {low:g}" + (f" and at most {high:g}" if high is not None else "")
                        + f", got {text!r}.")


def check_local_source(value: str, what: str, readable: tuple[Path, ...]) -> None:
    """A local model or dataset path the app may hand a run: inside one of the folders the app reads data from
    (`readable`: --data-dir, the folder it started in by default), so that whoever drives the app cannot train on,
    and push, any file its user can read; and a model folder, a dataset folder or a data file. Does nothing for a
    value that is not an existing path."""
    path = Path(value.strip()).expanduser()
    if not value.strip() or not path.exists():
        return
    if not any(path.resolve().is_relative_to(root.resolve()) for root in readable):
        raise FormError(f"{what} path {value.strip()!r} lies outside the folders the app reads data from "
                        f"({', '.join(map(str, readable))}); start the app with --data-dir <folder> to add one.")
    if what == "model" and not (path / "config.json").is_file() and not (path / "adapter_config.json").is_file():
        raise FormError(f"model path {value!r} is not a model folder (expected a folder with config.json).")
    if what == "dataset" and not path.is_dir() and path.suffix not in DATA_FILES:
        raise FormError(f"dataset path {value!r} is not a dataset (a folder, or a {', '.join(DATA_FILES)} file).")
    if what == "dataset" and path.is_dir() and not any(
            p.suffix in DATA_FILES or p.name == "dataset_info.json" for p in path.rglob("*") if p.is_file()):
        raise FormError(f"dataset folder {value!r} holds no data file ({', '.join(DATA_FILES)}) and is not a "
                        f"dataset saved with save_to_disk.")


def check_source(value: str, what: str, builtin: tuple[str, ...], readable: tuple[Path, ...]) -> None:
    """A model or dataset is a preset/builtin name, an existing local path the app may read (check_local_source),
    or a Hub id: in the local cache when HF_HUB_OFFLINE is set, else existing on the Hub (when the Hub cannot be
    reached, the run itself finds out). A path that does not exist is refused now, not minutes into a run."""
    value = value.strip()
    if not value or value in builtin:
        return
    path = Path(value).expanduser()
    looks_local = value.startswith((".", "/", "~")) or value.count("/") > 1 or not HUB_ID.match(value) \
        or (path.parts and Path(path.parts[0]).is_dir()) or path.suffix in DATA_FILES
    if path.exists():
        check_local_source(value, what, readable)
        return
    if looks_local:
        raise FormError(f"{what} path {value!r} does not exist.")
    if os.environ.get("HF_HUB_OFFLINE", "").lower() not in ("1", "true", "yes"):
        from huggingface_hub import HfApi

        try:
            found = HfApi().repo_exists(value, repo_type=what)
        except Exception:  # noqa: BLE001 (the Hub cannot be reached: the run will say what it finds)
            return
        if not found:
            raise FormError(f"{what} {value!r} is neither a local path nor a public repository on the Hugging Face "
                            f"Hub; give an existing path or a Hub id.")
    else:
        from huggingface_hub import snapshot_download

        try:
            snapshot_download(value, repo_type=what if what == "dataset" else "model", local_files_only=True)
        except Exception:  # noqa: BLE001 (any failure means: not usable offline)
            raise FormError(f"{what} {value!r} is neither a local path nor in the Hugging Face cache (HF_HUB_OFFLINE "
                            f"is set); give an existing path or download it first.") from None


def auto_name(recipe: str, knobs: Knobs) -> str:
    """Default run name: the recipe plus the knobs that were changed, e.g. `tiny-pretrain-H5-steps400`."""
    parts = [Path(recipe).stem.split("-edited-")[0] if recipe else "run"]
    for name, short in SHORT_NAMES.items():
        value = str(getattr(knobs, name)).strip()
        if value:
            parts.append(f"{short}{Path(value).name if not short else value}")
    return "-".join(parts)


def choices(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.yaml"))


def allowed(path: str | Path, roots: list[Path], what: str) -> Path:
    """`path` resolved, if it lies inside one of `roots`; otherwise a FormError."""
    if not str(path).strip():
        raise FormError(f"choose a {what}.")
    resolved = Path(path).resolve()
    for root in roots:
        if resolved.is_relative_to(root.resolve()) and resolved.is_file():
            return resolved
    raise FormError(f"{what} {str(path)!r} is not a file in {' or '.join(str(r) for r in roots)}.")


def check_as_typed(knobs: Knobs, recipe_name: str, edited_yaml: str, runs_dir: Path,
                   readable: tuple[Path, ...]) -> str | None:
    """The instant check, run as the form is typed in: every refusal of Preview that the form's own values decide
    (the knobs, a local model or dataset path, the recipe's keys as typed), without writing a draft or asking the
    Hub. It refuses what Preview refuses for these, so whichever of the two answers last, the sentence shown is the
    same. Returns the form's warning, if it has one (H above max steps: rounds_note), as Preview shows it."""
    check_knobs(knobs)
    for value, what in ((knobs.model_name_or_path, "model"), (knobs.dataset_name, "dataset")):
        check_local_source(str(value), what, readable)
    try:
        chosen = allowed(RECIPES / recipe_name if recipe_name and "/" not in recipe_name else recipe_name,
                         [RECIPES, runs_dir], "recipe")
        values = yaml.safe_load(edited_yaml if edited_yaml.strip() else chosen.read_text())
    except (FormError, OSError, yaml.YAMLError):
        return None  # the recipe itself: Preview names what is wrong with it
    if not isinstance(values, dict):
        return None
    check_recipe_values(values, readable)
    return rounds_note(knobs, values)


def recipe_path(name: str, edited_yaml: str, runs_dir: Path) -> Path:
    """The recipe to run: the chosen file, or the edited text saved under the runs directory."""
    chosen = allowed(RECIPES / name if name and "/" not in name else name, [RECIPES, runs_dir], "recipe")
    if edited_yaml.strip() and edited_yaml.strip() != chosen.read_text().strip():
        drafts = runs_dir / "drafts"
        drafts.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256(edited_yaml.encode()).hexdigest()[:10]
        draft = drafts / f"{chosen.stem}-edited-{digest}.yaml"
        draft.write_text(edited_yaml)
        return draft
    return chosen


def config_path(name: str) -> Path:
    return allowed(CONFIGS / name if name and "/" not in name else name, [CONFIGS], "accelerate config")


def flags(knobs: Knobs, readable: tuple[Path, ...], group_size: int = 1) -> tuple[list[str], list[str]]:
    """(recipe overrides, accelerate launch flags) from the knobs that were filled in, a local model or dataset
    only from the folders the app reads data from (`readable`). The replicas knob counts replicas: a launch of the
    `torch` backend starts replicas × the recipe's replica_group_size processes."""
    check_knobs(knobs)
    check_source(knobs.model_name_or_path, "model", PRESETS, readable)
    check_source(knobs.dataset_name, "dataset", ("builtin",), readable)
    overrides, launch = [], []
    for name in RECIPE_FIELDS:
        value = str(getattr(knobs, name)).strip()
        if value:
            overrides += [f"--{name}", value]
    for name, flag in LAUNCH_FIELDS.items():
        value = str(getattr(knobs, name)).strip()
        if value:
            launch += [flag, str(int(value) * group_size) if name == "replicas" else value]
    return overrides, launch


def group_size(recipe_values: dict) -> int:
    """The recipe's replica_group_size (processes per replica), 1 where it sets none or nothing sensible."""
    group = recipe_values.get("replica_group_size", 1)
    return group if isinstance(group, int) and group >= 1 else 1


def validate(recipe: Path, config: Path, overrides: list[str], replicas: int | None = None,
             launch: list[str] = (), port: int | None = None, command: list[str] | None = None) -> None:
    """Run the CLI's own checks on exactly what Start runs: `hf-diloco launch --dry-run` with the same recipe,
    config, accelerate launch flags, port and fields (`--replicas N` for a torchft run); raise its one-sentence
    error. With `command` (the plan's), the command the CLI would run must be that one, word for word."""
    result = CHECKER.run(["launch", str(recipe), "--accelerate-config", str(config), "--dry-run",
                          *(["--replicas", str(replicas)] if replicas is not None else []),
                          *(["--port", str(port)] if port is not None else []), *launch, "--", *overrides])
    if result.returncode != 0:
        raise cli_error(result, "the check")
    printed = [line for line in result.stdout.splitlines() if line.startswith(sys.executable + " ")]
    if command is not None and replicas is None and printed[-1:] != [" ".join(command)]:
        raise FormError("the command line checks would run differs from the one Start runs; this is a bug, please "
                        "report it with the recipe.")


def plan_replicas(knobs: Knobs, recipe_values: dict, config: Path) -> int:
    """M for the plan across sites: the replicas knob, else a torchft recipe's num_replicas (3 if none), else the
    accelerate config's processes over the recipe's replica_group_size."""
    if str(knobs.replicas).strip():
        return int(str(knobs.replicas).strip())
    torchft = torchft_replicas(knobs, recipe_values)
    if torchft is not None:
        return torchft
    processes = read_yaml(config, "accelerate config").get("num_processes", 1) if config.is_file() else 1
    return max(1, int(processes or 1) // group_size(recipe_values))


def predict(recipe: Path, config: Path, knobs: Knobs, recipe_values: dict, link: str, latency_ms: str = "",
            speed: str = "") -> dict:
    """`hf-diloco plan RECIPE --json` for the form's recipe, replicas, H and model over `link` (a rate such as
    100mbit; `latency_ms` one way per hop, blank: the planner's default; `speed` a GPU kind or tokens per second,
    blank: the planner's default), run by the checker (the app never imports torch). Its one-sentence refusal is
    a FormError."""
    check_knobs(knobs)
    command = ["plan", str(recipe), "--replicas", str(plan_replicas(knobs, recipe_values, config)), "--link",
               link.strip(), "--json"]
    if latency_ms.strip():
        command += ["--latency-ms", latency_ms.strip()]
    if speed.strip():
        number = speed.strip().replace("_", "").replace(",", "")
        command += ["--tokens-per-second", number] if number.replace(".", "", 1).isdigit() else ["--gpu", speed.strip()]
    if str(knobs.inner_steps).strip():
        command += ["--inner-steps", str(knobs.inner_steps).strip()]
    if str(knobs.model_name_or_path).strip():
        command += ["--model", str(knobs.model_name_or_path).strip()]
    result = CHECKER.run(command)
    if result.returncode != 0:
        raise cli_error(result, "the plan")
    return json.loads(result.stdout)


class Checker:
    """The process that runs the form's checks (`python -m hf_diloco.checker`), started at the first check and kept
    for the next ones, so that only the first Preview waits for torch and transformers to load. It gets the run's
    environment (`runs.training_env`: no Hub token, no app password), so a check sees what the run will see. One
    check at a time; a checker that ended or did not answer within `timeout` seconds is started again for the
    next check."""

    def __init__(self, timeout: float = 300):
        self.timeout = timeout
        self._process: subprocess.Popen | None = None
        self._answers: queue.Queue[str | None] = queue.Queue()
        self._lock = threading.Lock()

    def run(self, args: list[str]) -> subprocess.CompletedProcess:
        """`hf-diloco ARGS` (a launch's dry run or a plan), as its own process would have ended."""
        with self._lock:
            for attempt in (1, 2):
                try:
                    process = self._started()
                    process.stdin.write(json.dumps(args) + "\n")
                    process.stdin.flush()
                    answer = self._answer()
                    return subprocess.CompletedProcess(args, answer["returncode"], answer["stdout"], answer["stderr"])
                except (OSError, EOFError, queue.Empty):
                    self.close()
                    if attempt == 2:
                        raise FormError("the form's check could not run (its process ended or did not answer); "
                                        "try again.") from None
        raise AssertionError("unreachable")

    def close(self) -> None:
        """End the checker (it also ends by itself when the app does: its input closes)."""
        if self._process is not None:
            with contextlib.suppress(OSError):
                self._process.kill()
                self._process.wait(timeout=10)
            self._process = None

    def _started(self) -> subprocess.Popen:
        if self._process is None or self._process.poll() is not None:
            self._answers = queue.Queue()
            self._process = subprocess.Popen([sys.executable, "-m", "hf_diloco.checker"], stdin=subprocess.PIPE,
                                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                             cwd=PROJECT, env=runs.training_env())
            threading.Thread(target=self._read, args=(self._process.stdout, self._answers), daemon=True).start()
        return self._process

    @staticmethod
    def _read(stream, answers: queue.Queue) -> None:
        for line in stream:
            if line.startswith(checker.MARK):
                answers.put(line[len(checker.MARK):])
        answers.put(None)  # the process ended

    def _answer(self) -> dict:
        line = self._answers.get(timeout=self.timeout)
        if line is None:
            raise EOFError
        return json.loads(line)


CHECKER = Checker()


def cli_error(result: subprocess.CompletedProcess, what: str) -> FormError:
    """A failed CLI call as the form shows it: the CLI's own sentence ("hf-diloco: error: ..."), else the last
    error line (e.g. argparse's), never a dump."""
    errors = [line.split("error:", 1)[1].strip() for line in result.stderr.splitlines() if "error:" in line]
    lines = result.stderr.strip().splitlines()
    return FormError(errors[-1] if errors else lines[-1] if lines else f"{what} failed ({result.returncode}).")
