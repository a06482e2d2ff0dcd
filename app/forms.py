"""The launch form: allowed files, form values to command-line flags, validation by the CLI itself.

Design choices:
- Recipes and accelerate configs can only come from the project's recipes/ and accelerate_configs/ folders or from
  the runs directory (edited recipes are saved there); any other path is refused, so the form cannot be used to
  read or run files elsewhere.
- The form is validated by the same code as the command line: `hf-diloco launch ... --dry-run` runs as a
  subprocess (the app never imports torch), and its one-sentence error is shown beside the form.
- Commands are argument lists, never shell strings.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

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
    num_machines: str = ""
    machine_rank: str = ""
    main_process_ip: str = ""
    main_process_port: str = ""


RECIPE_FIELDS = ("inner_steps", "outer_lr", "outer_momentum", "max_steps", "model_name_or_path", "dataset_name")
LAUNCH_FIELDS = {"replicas": "--num_processes", "num_machines": "--num_machines", "machine_rank": "--machine_rank",
                 "main_process_ip": "--main_process_ip", "main_process_port": "--main_process_port"}


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


def flags(knobs: Knobs) -> tuple[list[str], list[str]]:
    """(recipe overrides, accelerate launch flags) from the knobs that were filled in."""
    overrides, launch = [], []
    for name in RECIPE_FIELDS:
        value = str(getattr(knobs, name)).strip()
        if value:
            overrides += [f"--{name}", value]
    for name, flag in LAUNCH_FIELDS.items():
        value = str(getattr(knobs, name)).strip()
        if value:
            if name != "main_process_ip" and not value.isdigit():
                raise FormError(f"{name.replace('_', ' ')} must be a whole number, got {value!r}.")
            launch += [flag, value]
    return overrides, launch


def validate(recipe: Path, config: Path, overrides: list[str]) -> None:
    """Run the CLI's own checks (`hf-diloco launch --dry-run`); raise its one-sentence error."""
    command = [sys.executable, "-m", "hf_diloco.cli", "launch", str(recipe), "--accelerate-config", str(config),
               "--dry-run", "--", *overrides]
    result = subprocess.run(command, capture_output=True, text=True, cwd=PROJECT, timeout=300)
    if result.returncode != 0:
        errors = [line for line in result.stderr.splitlines() if line.startswith("hf-diloco: error:")]
        raise FormError(errors[-1].removeprefix("hf-diloco: error: ") if errors else result.stderr.strip()[-500:])
