"""Push a finished run to the Hugging Face Hub with a DiLoCo model card.

Design choices:
- The card's settings come from the training arguments themselves (`run_settings`): `DiLoCoTrainer` passes its
  own args, and `hf-diloco train` stores the same dict in run_config.json for `hf-diloco push` and the app, so
  every path writes the same card: a table of the settings, the final metrics (diloco_summary.json,
  run_metrics.json), a training-curve image, base model and datasets in the metadata.
- The card says what ran: a DiLoCo run is tagged `diloco` and described with its replicas and H; a `trainer: ddp`
  baseline is described as ordinary data-parallel training, with no DiLoCo settings.
- Only what a model repo needs is uploaded: weights, config, tokenizer, card, curve and the round log. Checkpoints,
  per-replica optimizer states and TensorBoard files stay local.
- The token comes from the caller, HF_TOKEN, or the huggingface_hub login, in that order. It is only ever passed to
  huggingface_hub: never written to a file, a log or the card.
- The endpoint follows huggingface_hub (HF_ENDPOINT); the tests push to a local server that speaks the Hub's
  repo-creation, preupload and commit endpoints.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

from .errors import ConfigError
from .metrics import read_sync_rounds

CARD_FILE = "README.md"
CURVE_FILE = "training_curve.png"
RUN_CONFIG_FILE = "run_config.json"
UPLOAD_PATTERNS = ("*.safetensors", "*.json", "*.model", "*.txt", "tokenizer*", "sync_rounds.jsonl", CURVE_FILE)
NOT_UPLOADED = ("run_metrics.json",)
REPO_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}$")
PRESET_PREFIXES = ("tiny-llama", "llama-")

DILOCO_ROWS = (
    ("inner_steps", "H, inner steps between syncs", 500),
    ("outer_optimizer", "outer optimizer", "sgd"),
    ("outer_lr", "outer learning rate", 0.7),
    ("outer_momentum", "outer momentum", 0.9),
    ("outer_nesterov", "Nesterov", True),
    ("replica_group_size", "processes per replica", 1),
    ("data_sharding", "data sharding", "iid"),
    ("compression", "pseudo-gradient compression", "none"),
    ("error_feedback", "error feedback", False),
    ("num_fragments", "streaming fragments", 1),
    ("sync_delay", "sync overlapped with inner steps (τ)", 0),
    ("fragment_alpha", "mixing when a sync lands (α)", 0.0),
)


def check_repo_id(repo_id: str) -> str:
    repo_id = (repo_id or "").strip()
    if not REPO_ID.match(repo_id):
        raise ConfigError(
            f"repo id {repo_id!r} is not valid; use 'name' or 'owner/name' with letters, digits, '-', '_' or '.'."
        )
    return repo_id


def resolve_token(token: str | None) -> str:
    """The token to push with: given, HF_TOKEN, or the huggingface_hub login."""
    from huggingface_hub import get_token

    token = token or get_token()
    if not token:
        raise ConfigError("no Hugging Face token: set HF_TOKEN, run `hf auth login`, or enter one in the app.")
    return token


TRAINING_KEYS = ("learning_rate", "weight_decay", "warmup_steps", "max_steps", "per_device_train_batch_size",
                 "gradient_accumulation_steps", "lr_scheduler_type", "seed")


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _plain(value):
    """A JSON-friendly form of an argument value (enums become their value)."""
    value = getattr(value, "value", value)
    return value if isinstance(value, (bool, int, float, str, type(None))) else str(value)


def run_settings(args, run=None, trainer: str | None = None) -> dict:
    """What the model card needs from a run's arguments: `args` (a DiLoCoConfig or TrainingArguments), the
    model/data arguments `run` (a RunArguments, when there are any), and which trainer ran ("diloco" or "ddp";
    default: `run.trainer`, else "diloco"). Holds no token.
    """
    from dataclasses import asdict

    trainer = trainer or getattr(run, "trainer", None) or "diloco"
    return {
        "trainer": trainer,
        "run": {key: _plain(value) for key, value in asdict(run).items()} if run is not None else {},
        "diloco": {key: _plain(getattr(args, key)) for key, _, _ in DILOCO_ROWS if hasattr(args, key)}
        if trainer == "diloco" else {},
        "training": {key: _plain(getattr(args, key)) for key in TRAINING_KEYS if hasattr(args, key)},
        "num_processes": args.world_size,
    }


def write_training_curve(output_dir: Path, target: Path) -> Path | None:
    """Inner loss per round (mean over replicas) and held-out loss, as a PNG; None without rounds."""
    rounds = read_sync_rounds(output_dir)
    if not rounds:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in rounds], [r["loss"] for r in rounds], marker="o", label="train loss (mean of replicas)")
    evals = [r for r in rounds if r.get("eval_loss") is not None]
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], marker="s", label="held-out loss")
    ax.set_xlabel("inner step")
    ax.set_ylabel("loss")
    ax.set_title("DiLoCo training (one point per sync round)")
    ax.legend()
    fig.savefig(target, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return target


def trainer_settings(trainer) -> dict:
    """`run_settings` of a live DiLoCoTrainer from its own args; model and data names from run_config.json when
    `hf-diloco train` wrote one, else the model's own name."""
    settings = run_settings(trainer.args, trainer="diloco")
    stored = _read_json(Path(trainer.args.output_dir) / RUN_CONFIG_FILE).get("run", {})
    model = getattr(getattr(trainer.model, "config", None), "name_or_path", "") or ""
    settings["run"] = stored or ({"model_name_or_path": model} if model else {})
    return settings


def model_card(output_dir: str | Path, repo_id: str | None = None, curve: bool = True,
               settings: dict | None = None) -> str:
    """The model card of a run folder, as markdown with YAML metadata.

    `settings` is `run_settings(...)` of the run; without it, the run_config.json that `hf-diloco train` wrote.
    """
    output_dir = Path(output_dir)
    settings = settings if settings is not None else _read_json(output_dir / RUN_CONFIG_FILE)
    run, diloco, training = settings.get("run", {}), settings.get("diloco", {}), settings.get("training", {})
    trainer = settings.get("trainer") or run.get("trainer") or "diloco"
    summary = _read_json(output_dir / "diloco_summary.json")
    metrics = _read_json(output_dir / "run_metrics.json")
    model = run.get("model_name_or_path", "")
    dataset = run.get("dataset_name", "")
    tags = ["diloco", "hf-diloco", "distributed-training"] if trainer == "diloco" else ["hf-diloco", "ddp-baseline"]
    meta = ["---", "library_name: transformers", "tags:", *(f"- {tag}" for tag in tags)]
    if model and not model.startswith(PRESET_PREFIXES) and not Path(model).exists():
        meta.append(f"base_model: {model}")
    if dataset and dataset != "builtin" and not Path(dataset).exists():
        meta += ["datasets:", f"- {dataset}"]
    meta.append("---")
    processes = settings.get("num_processes")
    group = diloco.get("replica_group_size", 1)
    replicas = summary.get("num_replicas") or (processes // group if processes else "?")
    lines = [*meta, "", f"# {repo_id or output_dir.name}", ""]
    if trainer == "diloco":
        lines += [f"Trained with hf-diloco using DiLoCo (Douillard et al., "
                  f"[arXiv 2311.08105](https://arxiv.org/abs/2311.08105)): {replicas} replicas trained "
                  f"independently and averaged their pseudo-gradients every {diloco.get('inner_steps', '?')} steps.",
                  "", "## DiLoCo settings", "", "| setting | value | paper |", "|---|---|---|"]
        for key, label, paper in DILOCO_ROWS:
            if key in diloco:
                lines.append(f"| {label} (`{key}`) | {diloco[key]} | {paper} |")
        lines.append(f"| replicas | {replicas} | 8 |")
        prefix = "inner "
    else:
        lines += [f"Trained with hf-diloco's data-parallel baseline: the ordinary `transformers` Trainer on "
                  f"{processes or '?'} process(es), gradients all-reduced at every step (not DiLoCo).", "",
                  "## Training settings", "", "| setting | value |", "|---|---|"]
        lines.append(f"| processes | {processes or '?'} |")
        prefix = ""
    for key in ("learning_rate", "weight_decay", "warmup_steps", "max_steps", "per_device_train_batch_size"):
        if key in training:
            lines.append(f"| {prefix}{key} | {training[key]} |" + (" |" if trainer == "diloco" else ""))
    lines += ["", "## Results", "", "| metric | value |", "|---|---|"]
    results = {
        "model": model or "?",
        "data": dataset or "?",
        "steps": summary.get("steps", metrics.get("global_step")),
        "outer rounds": summary.get("rounds"),
        "held-out loss before training": summary.get("eval_loss_initial", metrics.get("eval_loss_initial")),
        "held-out loss after training": summary.get("eval_loss_final", metrics.get("eval_loss")),
        "bytes sent per replica": summary.get("bytes_per_replica"),
        "fewer bytes than fp32 syncs (compression)": _compression_ratio(output_dir),
        "H chosen by inner_steps auto": _auto_inner_steps(output_dir),
        "bytes DDP would have sent": summary.get("ddp_bytes_per_replica"),
        "seconds the inner loop waited for syncs": summary.get("blocked_seconds"),
        "tokens/s (all replicas)": summary.get("tokens_per_second"),
    }
    for key, value in results.items():
        if value is not None:
            shown = f"{value:,.4f}" if isinstance(value, float) and value < 100 else (
                f"{value:,.0f}" if isinstance(value, (int, float)) else value)
            lines.append(f"| {key} | {shown} |")
    if curve and read_sync_rounds(output_dir):
        lines += ["", "## Training curve", "", f"![training curve]({CURVE_FILE})"]
        lines += ["", "Per-round metrics are in `sync_rounds.jsonl`."]
    lines.append("")
    return "\n".join(lines)


def _compression_ratio(output_dir: Path) -> str | None:
    """fp32 bytes the rounds would have sent ÷ bytes they sent, e.g. '7.9x' (None for fp32 or no rounds)."""
    rounds = [r for r in read_sync_rounds(output_dir) if r.get("compression_ratio") and r.get("bytes_per_replica")]
    sent = sum(r["bytes_per_replica"] for r in rounds)
    if not sent or all(str(r.get("compression", "none")) == "none" for r in rounds):
        return None
    return f"{sum(r['compression_ratio'] * r['bytes_per_replica'] for r in rounds) / sent:.1f}x"


def _auto_inner_steps(output_dir: Path) -> str | None:
    chosen = [r["inner_steps_auto"] for r in read_sync_rounds(output_dir) if "inner_steps_auto" in r]
    if not chosen:
        return None
    c = chosen[-1]
    return (f"{c['chosen']} from step {c['from_step']} (a step {c['step_seconds']:.3g} s, waiting for a sync "
            f"{c['sync_seconds']:.3g} s, at most {100 * c['max_sync_overhead']:g}% waiting)")


def stage(output_dir: Path, target: Path, repo_id: str | None, merge_lora: bool) -> list[str]:
    """Copy what the repo should hold into `target`, write the card and the curve; returns the file names."""
    target.mkdir(parents=True, exist_ok=True)
    adapter = (output_dir / "adapter_config.json").exists()
    if merge_lora and adapter:
        merged = output_dir / "merged"
        if not merged.is_dir():
            raise ConfigError(f"{output_dir} has a LoRA adapter but no merged/ model; train with merge_lora: true.")
        source = merged
    else:
        source = output_dir
    for pattern in UPLOAD_PATTERNS:
        for path in source.glob(pattern):
            if path.is_file() and path.name not in NOT_UPLOADED:
                shutil.copy2(path, target / path.name)
    for name in ("sync_rounds.jsonl", "diloco_summary.json", RUN_CONFIG_FILE):
        if (output_dir / name).exists():
            shutil.copy2(output_dir / name, target / name)
    if not any(target.glob("*.safetensors")):
        raise ConfigError(f"{output_dir} holds no saved model (*.safetensors); is the run finished?")
    write_training_curve(output_dir, target / CURVE_FILE)
    (target / CARD_FILE).write_text(model_card(output_dir, repo_id))
    return sorted(p.name for p in target.iterdir())


def push(output_dir: str | Path, repo_id: str, token: str | None = None, private: bool = False,
         merge_lora: bool = False, commit_message: str = "Upload DiLoCo model", endpoint: str | None = None,
         progress=print) -> str:
    """Create (or reuse) the repo and upload the run's model with its card; returns the repo URL."""
    from huggingface_hub import HfApi

    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        raise ConfigError(f"output folder {str(output_dir)!r} does not exist.")
    repo_id = check_repo_id(repo_id)
    api = HfApi(endpoint=endpoint, token=resolve_token(token))
    with tempfile.TemporaryDirectory() as staging:
        files = stage(output_dir, Path(staging), repo_id, merge_lora)
        progress(f"[push] staged {len(files)} files: {', '.join(files)}")
        url = api.create_repo(repo_id, private=private, exist_ok=True)
        progress(f"[push] repository {url}")
        api.upload_folder(folder_path=staging, repo_id=repo_id, commit_message=commit_message)
    progress(f"[push] done: {url}")
    return str(url)
