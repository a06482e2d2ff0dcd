"""Push a finished run to the Hugging Face Hub with a DiLoCo model card.

Design choices:
- One upload for every caller (`commit_run`): `hf-diloco push`, the app and `DiLoCoTrainer.push_to_hub` (and its
  pushes during training) push the same files with the same card. The card's settings come from the training
  arguments themselves (`run_settings`): `DiLoCoTrainer` passes its own args, and `hf-diloco train` stores the same
  dict in run_config.json for `hf-diloco push` and the app, so every path writes the same card: a table of the
  settings, the final metrics (diloco_summary.json, run_metrics.json), a training-curve image, base model and
  datasets in the metadata.
- The card says what ran: a DiLoCo run is tagged `diloco` and described with its replicas and H; a `trainer: ddp`
  baseline is described as ordinary data-parallel training, with no DiLoCo settings.
- Only what a model repo needs is uploaded, named one by one (`repo_files`): weights, model and generation config,
  tokenizer files, the card (huggingface_hub's `ModelCard`/`ModelCardData`), the training curve, the sync log and
  the run config, in one commit. Checkpoints, optimizer states, TensorBoard files, `training_args.bin` (a pickle)
  and the app's own files (progress, stop markers, Trainer log) stay local.
- A run that did not finish (stopped on request, failed, or still short of max_steps) is pushed only when the
  caller says so (`allow_unfinished`, `--allow-unfinished`, a tick in the app), and its card says how it ended.
- A torchft launch (`hf-diloco launch --replicas N`) keeps each replica in `replica-r/`: the card counts the
  launch's replicas and the rounds committed by any of them, as the app does (`metrics.run_syncs`).
- Nothing private leaves: a local model or dataset is named by its base name only, in the card and in every pushed
  file (`public_name`): run_config.json's settings, and the `*name_or_path` of a model, tokenizer or adapter config
  (peft records its base model's path). A local path is never listed in the card's `datasets`/`base_model`
  metadata, which only Hub ids belong in. The run folder keeps its files as they are.
- The folder is checked before anything else is asked for: it holds a finished run, and every JSON and safetensors
  file to upload loads (a damaged one is named in one sentence); then the repo id, then the token.
- The token comes from the caller, HF_TOKEN, or the huggingface_hub login, in that order. It is only ever passed to
  huggingface_hub: never written to a file, a log or the card.
- The endpoint follows huggingface_hub (HF_ENDPOINT); the tests push to a local server that speaks the Hub's
  repo-creation, preupload and commit endpoints.
- No torch import: the app calls `push` in its own process.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from .errors import ConfigError, DamagedFile, first_line
from .files import read_json
from .metrics import (
    EARLIER_SYNCS_FILE,
    SYNCS_FILE,
    launch_folder,
    outer_rounds,
    read_summary,
    replica_folders,
    run_syncs,
)
from .runs import PROGRESS_FILE, run_outcome
from .tasks import TASKS

CARD_FILE = "README.md"
CURVE_FILE = "training_curve.png"
RUN_CONFIG_FILE = "run_config.json"
# What a model repository holds, besides the card and the curve written at push time: the files transformers and
# peft save for a model and its tokenizer, the sync log and the run config.
MODEL_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json",
                  "adapter_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                  "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "*.model", "chat_template.jinja")
RUN_FILES = (SYNCS_FILE, EARLIER_SYNCS_FILE, RUN_CONFIG_FILE)  # a run of an earlier version: its records, as named
PRESET_PREFIXES = ("tiny-llama", "llama-", "tiny-t5", "tiny-bert", "tiny-vit")
TRL_NAMES = {"sft": "SFTTrainer", "dpo": "DPOTrainer"}  # trainer: what the card says ran the inner loop

DILOCO_ROWS = (
    ("inner_steps", "H, inner steps between syncs", 500),
    ("outer_optimizer", "outer optimizer", "sgd"),
    ("inner_optimizer", "inner optimizer (adamw: Trainer's `optim`; muon: Muon for weight matrices)", "adamw"),
    ("outer_lr", "outer learning rate", 0.7),
    ("outer_momentum", "outer momentum", 0.9),
    ("outer_nesterov", "Nesterov", True),
    ("outer_momentum_delay", "syncs between outer momentum updates (delayed Nesterov)", 1),
    ("outer_momentum_restart", "syncs between outer momentum restarts (0: never)", 0),
    ("round_seconds", "seconds of inner steps per round (time budget; 0: H steps)", 0.0),
    ("replica_group_size", "processes per replica", 1),
    ("sharded_replica", "each replica sharded over its processes by FSDP2", False),
    ("tp_size", "processes each layer is split over by tensor parallel", 1),
    ("data_sharding", "data sharding", "iid"),
    ("compression", "pseudo-gradient compression", "none"),
    ("error_feedback", "error feedback", False),
    ("num_fragments", "streaming fragments", 1),
    ("sync_delay", "sync overlapped with inner steps (τ)", 0),
    ("auto_sync_delay", "τ chosen per fragment from its measured exchanges", False),
    ("staggered_end", "last syncs staggered, so the end waits for no exchange", False),
    ("fragment_alpha", "mixing when a sync lands (α)", 0.0),
    ("overlap_landing", "how an overlapped sync lands (eager: the steps taken in flight kept)", "mix"),
    ("contribution_checks", "contributions checked before each merge", "off"),
    ("contribution_loss_check", "contributions also scored by held-out loss", False),
)


class UnfinishedRun(ConfigError):
    """A push of a run that did not finish, without the caller's consent; `outcome` is its `run_outcome`."""

    def __init__(self, outcome: dict):
        self.outcome = outcome
        super().__init__(f"this run {describe_outcome(outcome)}; push it anyway with --allow-unfinished, and its card "
                         f"will say so.")


def check_repo_id(repo_id: str) -> str:
    """`repo_id` stripped, if huggingface_hub's own check accepts it; one sentence otherwise."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    repo_id = (repo_id or "").strip()
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise ConfigError(f"repo id {repo_id!r} is not valid; use 'name' or 'owner/name' with letters, digits, "
                          f"'-', '_' or '.' (at most 96 each, not starting or ending with '-' or '.').") from None
    return repo_id


def resolve_token(token: str | None) -> str:
    """The token to push with: given, HF_TOKEN, or the huggingface_hub login."""
    from huggingface_hub import get_token

    token = token or get_token()
    if not token:
        raise ConfigError("no Hugging Face token: set HF_TOKEN, run `hf auth login`, or enter one in the app.")
    return token


def local_path(value: str) -> bool:
    """Whether `value`, a model or dataset as a run was given it, names a place on a machine rather than a Hub id or
    a preset: it looks like a path (absolute, from the home or the current folder, with a backslash, or deeper than
    a Hub id's `owner/name`), or it is one here (a relative `corpus.jsonl`). A URL is not a path.

    >>> [local_path(v) for v in ("/home/alice/corpus.jsonl", "~/models/base", "../data", "data/shards/a.parquet")]
    [True, True, True, True]
    >>> [local_path(v) for v in ("roneneldan/TinyStories", "tiny-llama", "builtin", "http://10.0.0.9:29510")]
    [False, False, False, False]
    """
    if not isinstance(value, str) or not value or "://" in value:
        return False
    if value.startswith(("/", "~", "./", "../")) or value in (".", "..") or "\\" in value or value.count("/") > 1:
        return True
    try:
        return Path(value).exists()
    except (OSError, ValueError):  # too long, or not a name at all
        return False


def public_name(value):
    """What a pushed card or file says of a model, a dataset or any other setting: a local path by its base name
    only (the folders above it say whose machine it was and how it is laid out, which is nobody else's business),
    anything else as it is.

    >>> public_name("/home/alice/private/corpus.jsonl"), public_name("~/models/tiny-base/")
    ('corpus.jsonl', 'tiny-base')
    >>> public_name("roneneldan/TinyStories"), public_name("tiny-llama"), public_name(0.7)
    ('roneneldan/TinyStories', 'tiny-llama', 0.7)
    """
    return Path(value).name if local_path(value) else value


def _public(value, every: bool, key: str = ""):
    """`value` with `public_name` applied to every string in it (`every`), or to those under a `*name_or_path` key."""
    if isinstance(value, dict):
        return {k: _public(v, every, str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [_public(v, every, key) for v in value]
    return public_name(value) if every or key.endswith("name_or_path") else value


def upload_source(name: str, path: Path) -> str | bytes:
    """What is uploaded as the repo file `name` from `path`, once it loads: the file itself, or for a JSON file that
    names a local path a copy with its base name instead (every string of run_config.json, the `*name_or_path`
    values of a model, tokenizer or adapter config). A file that does not load is a DamagedFile naming it. Weights
    are passed by path; every other file is small and read now, so that a commit in the background sends what was
    there when it was asked for (a live run appends to its sync log)."""
    if name.endswith(".safetensors"):
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), "np"):  # reads and checks the header against the file's length
                pass
        except (SafetensorError, OSError) as error:
            raise DamagedFile(f"{path} is not a whole safetensors file ({first_line(error)}); save the model again, "
                              f"or push a run whose model is whole.") from None
        return str(path)
    if not name.endswith(".json"):
        return path.read_bytes()
    values = read_json(path)
    public = _public(values, every=name == RUN_CONFIG_FILE)
    return path.read_bytes() if public == values else (json.dumps(public, indent=2, ensure_ascii=False) + "\n").encode()


TRAINING_KEYS = ("learning_rate", "weight_decay", "warmup_steps", "max_steps", "per_device_train_batch_size",
                 "gradient_accumulation_steps", "lr_scheduler_type", "seed")


def _plain(value):
    """A JSON-friendly form of an argument value (enums become their value)."""
    value = getattr(value, "value", value)
    return value if isinstance(value, (bool, int, float, str, type(None))) else str(value)


def run_settings(args, run=None, trainer: str | None = None) -> dict:
    """What the model card needs from a run's arguments: `args` (a DiLoCoConfig or TrainingArguments), the
    model/data arguments `run` (a RunArguments, when there are any), and which trainer ran ("diloco", "sft",
    "dpo" or "ddp";
    default: `run.trainer`, else "diloco"). Holds no token.
    """
    from dataclasses import asdict

    trainer = trainer or getattr(run, "trainer", None) or "diloco"
    return {
        "trainer": trainer,
        "run": {key: _plain(value) for key, value in asdict(run).items()} if run is not None else {},
        "diloco": {key: _plain(getattr(args, key)) for key, _, _ in DILOCO_ROWS if hasattr(args, key)}
        if trainer != "ddp" else {},
        "training": {key: _plain(getattr(args, key)) for key in TRAINING_KEYS if hasattr(args, key)},
        "num_processes": args.world_size,
    }


def write_training_curve(output_dir: Path, target: Path) -> Path | None:
    """Inner loss of each replica per sync and the held-out loss of the global model, as a PNG (None without
    syncs), in the colours the app draws them with: replica i PALETTE[i], held-out loss black."""
    from .metrics import PALETTE, SERIES_COLORS, replica_losses

    rounds = run_syncs(launch_folder(output_dir))
    if not rounds:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    per_replica: dict[int, list[tuple[int, float]]] = {}
    for record in rounds:
        for replica, loss in replica_losses(record):
            per_replica.setdefault(replica, []).append((record["step"], loss))
    for replica, points in sorted(per_replica.items()):
        ax.plot(*zip(*points, strict=True), marker="o", markersize=3, label=f"replica {replica}",
                color=PALETTE[replica % len(PALETTE)])
    evals = [r for r in rounds if r.get("eval_loss") is not None]
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], marker="s", label="held-out loss",
                color=SERIES_COLORS["held-out loss"])
    ax.set_xlabel("inner step")
    ax.set_ylabel("loss")
    ax.set_title("Inner loss per replica, held-out loss of the global model")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(target, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return target


def describe_outcome(outcome: dict) -> str:
    """One sentence on how a run ended, for the card and for a refused push.

    >>> describe_outcome({"ended": "stopped", "step": 40, "max_steps": 200, "checkpoint": "checkpoint-40"})
    'stopped on request at step 40 of 200; its checkpoint-40 was kept'
    >>> describe_outcome({"ended": "failed", "step": None, "max_steps": None, "checkpoint": None})
    'failed'
    >>> describe_outcome({"ended": "training", "step": 40, "max_steps": 200, "checkpoint": None})
    'was still training at step 40 of 200'
    """
    at = ""
    if outcome.get("step") is not None:
        at = f" at step {outcome['step']}" + (f" of {outcome['max_steps']}" if outcome.get("max_steps") else "")
    words = {"finished": "finished", "stopped": "stopped on request", "failed": "failed",
             "unfinished": "did not finish", "training": "was still training"}[outcome["ended"]]
    kept = f"; its {outcome['checkpoint']} was kept" if outcome.get("checkpoint") else ""
    return words + at + kept


def trainer_settings(trainer) -> dict:
    """`run_settings` of a live DiLoCoTrainer from its own args; model and data names from run_config.json when
    `hf-diloco train` wrote one, else the model's own name."""
    settings = run_settings(trainer.args, trainer="diloco")
    stored = read_json(Path(trainer.args.output_dir) / RUN_CONFIG_FILE, {}).get("run", {})
    model = getattr(getattr(trainer.model, "config", None), "name_or_path", "") or ""
    settings["run"] = stored or ({"model_name_or_path": model} if model else {})
    return settings


def model_card(output_dir: str | Path, repo_id: str | None = None, curve: bool = True,
               settings: dict | None = None, outcome: dict | None = None) -> str:
    """The model card of a run folder, as markdown with YAML metadata (huggingface_hub's `ModelCard`).

    `settings` is `run_settings(...)` of the run; without it, the run_config.json that `hf-diloco train` wrote.
    `outcome` is how the run ended (`run_outcome`, read from the folder unless given: a live trainer knows it is
    still training). For a replica folder of a torchft launch, replicas and rounds are the launch's (every replica
    folder beside it).
    """
    from huggingface_hub import ModelCard, ModelCardData

    output_dir = Path(output_dir)
    settings = settings if settings is not None else read_json(output_dir / RUN_CONFIG_FILE, {})
    run, diloco, training = settings.get("run", {}), settings.get("diloco", {}), settings.get("training", {})
    trainer = settings.get("trainer") or run.get("trainer") or "diloco"
    summary = read_summary(output_dir)
    metrics = read_json(output_dir / "run_metrics.json", {})
    model = run.get("model_name_or_path", "")
    dataset = run.get("dataset_name", "")
    task = TASKS.get(run.get("task", "causal-lm"), TASKS["causal-lm"])
    data = ModelCardData(  # Hub ids only: a preset, the builtin corpus or a local path is no repository
        library_name="transformers",
        pipeline_tag=task.pipeline_tag,
        tags=(["diloco", "hf-diloco", "distributed-training"] + (["trl", trainer] if trainer in TRL_NAMES else []))
        if trainer != "ddp" else ["hf-diloco", "ddp-baseline"],
        base_model=model if model and not model.startswith(PRESET_PREFIXES) and not local_path(model) else None,
        datasets=[dataset] if dataset and dataset != "builtin" and not local_path(dataset) else None,
    )
    processes = settings.get("num_processes")
    group = diloco.get("replica_group_size", 1)
    root = launch_folder(output_dir)
    rounds = run_syncs(root)
    if root != output_dir:  # one replica of a torchft launch: count the launch's replicas
        replicas = len(replica_folders(root))
    else:
        replicas = summary.get("num_replicas") or (processes // group if processes else "?")
    outcome = outcome or run_outcome(output_dir)
    lines = [f"# {repo_id or output_dir.name}", ""]
    if outcome["ended"] != "finished":
        lines += [f"> **This run {describe_outcome(outcome)}.** The weights are those it had then.", ""]
    if trainer != "ddp":
        inner = f" The inner loop was TRL's {TRL_NAMES[trainer]}." if trainer in TRL_NAMES else ""
        lines += [f"Trained with hf-diloco using DiLoCo (Douillard et al., "
                  f"[arXiv 2311.08105](https://arxiv.org/abs/2311.08105)): {replicas} replicas trained "
                  f"independently and averaged their pseudo-gradients every {diloco.get('inner_steps', '?')} steps."
                  + inner, "", "## DiLoCo settings", "", "| setting | value | paper |", "|---|---|---|"]
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
            lines.append(f"| {prefix}{key} | {training[key]} |" + (" |" if trainer != "ddp" else ""))
    committed = [r for r in rounds if r.get("committed", True) is not False]
    lines += ["", "## Results", "", "| metric | value |", "|---|---|"]
    results = {
        "model": public_name(model) or "?",
        "data": public_name(dataset) or "?",
        "how the run ended": describe_outcome(outcome),
        "steps": max([summary.get("steps") or 0, *(r["step"] for r in committed)]) or metrics.get("global_step"),
        "outer rounds": outer_rounds(committed) if committed else summary.get("rounds"),
        "syncs": len(committed) if committed and outer_rounds(committed) != len(committed) else None,
        "held-out loss before training": summary.get("eval_loss_initial", metrics.get("eval_loss_initial")),
        "held-out loss after training": summary.get("eval_loss_final", metrics.get("eval_loss")),
        "bytes sent per replica": summary.get("bytes_per_replica"),
        "fewer bytes than fp32 syncs (compression)": _compression_ratio(rounds),
        "H chosen by inner_steps auto": _auto_inner_steps(rounds),
        "bytes DDP would have sent": summary.get("ddp_bytes_per_replica"),
        "seconds the inner loop waited for syncs": summary.get("blocked_seconds"),
        "tokens/s (all replicas)": summary.get("tokens_per_second"),
        "contributions left out by the checks": sum(len(r.get("excluded") or []) for r in committed)
        if any("excluded" in r for r in committed) else None,
    }
    for key, value in results.items():
        if value is not None:
            shown = f"{value:,.4f}" if isinstance(value, float) and value < 100 else (
                f"{value:,.0f}" if isinstance(value, (int, float)) else value)
            lines.append(f"| {key} | {shown} |")
    if curve and rounds:
        lines += ["", "## Training curve", "", f"![training curve]({CURVE_FILE})"]
        lines += ["", "Per-sync metrics are in `syncs.jsonl`."]
    lines.append("")
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines)))


def _compression_ratio(rounds: list[dict]) -> str | None:
    """fp32 bytes the rounds would have sent ÷ bytes they sent, e.g. '7.9x' (None for fp32 or no rounds)."""
    rounds = [r for r in rounds if r.get("compression_ratio") and r.get("bytes_per_replica")]
    sent = sum(r["bytes_per_replica"] for r in rounds)
    if not sent or all(str(r.get("compression", "none")) == "none" for r in rounds):
        return None
    return f"{sum(r['compression_ratio'] * r['bytes_per_replica'] for r in rounds) / sent:.1f}x"


def _auto_inner_steps(rounds: list[dict]) -> str | None:
    chosen = [r["inner_steps_auto"] for r in rounds if "inner_steps_auto" in r]
    if not chosen:
        return None
    c = chosen[-1]
    return (f"{c['chosen']} from step {c['from_step']} (a step {c['step_seconds']:.3g} s, waiting for a sync "
            f"{c['sync_seconds']:.3g} s, at most {100 * c['max_sync_overhead']:g}% waiting)")


def model_folder(output_dir: Path, merge_lora: bool = False) -> Path:
    """Where the model to push lies: the run folder, the lead replica's folder of a torchft launch (all replicas
    end with the same model), or a LoRA run's merged/ model when `merge_lora`."""
    if not output_dir.is_dir():
        raise ConfigError(f"output folder {str(output_dir)!r} does not exist.")
    replicas = [f for f in replica_folders(output_dir) if any(f.glob("*.safetensors"))]
    if replicas and not any(output_dir.glob("*.safetensors")):
        output_dir = max(replicas, key=lambda f: read_json(f / PROGRESS_FILE, {}).get("step") or 0)
    if merge_lora and (output_dir / "adapter_config.json").exists():
        if not (output_dir / "merged").is_dir():
            raise ConfigError(f"{output_dir} has a LoRA adapter but no merged/ model; train with merge_lora: true.")
        return output_dir / "merged"
    return output_dir


def repo_files(output_dir: Path, merge_lora: bool = False) -> dict[str, Path]:
    """The run's files a model repository holds (name in the repo → file), the card and curve aside: the model and
    tokenizer files of `model_folder`, and the run's sync log and run config."""
    source = model_folder(output_dir, merge_lora)
    run_folder = source.parent if source.name == "merged" else source
    files = {path.name: path for pattern in MODEL_PATTERNS for path in source.glob(pattern) if path.is_file()}
    if not any(name.endswith(".safetensors") for name in files):
        raise ConfigError(f"{output_dir} holds no saved model (*.safetensors); is the run finished?")
    files |= {name: run_folder / name for name in RUN_FILES if (run_folder / name).is_file()}
    return dict(sorted(files.items()))


def push(output_dir: str | Path, repo_id: str, token: str | None = None, private: bool = False,
         merge_lora: bool = False, commit_message: str = "Upload DiLoCo model", endpoint: str | None = None,
         allow_unfinished: bool = False, progress=print) -> str:
    """Create (or reuse) the repo and upload the run's model with its card in one commit; returns the repo URL.

    The folder is checked first (a finished run whose files all load; a run that did not finish is refused unless
    `allow_unfinished`), then the repo id and the token; `progress` gets one line per stage.
    """
    commit = commit_run(output_dir, repo_id, token=token, private=private, merge_lora=merge_lora,
                        commit_message=commit_message, endpoint=endpoint, allow_unfinished=allow_unfinished,
                        progress=progress)
    return str(commit.repo_url)


def commit_run(output_dir: str | Path, repo_id: str, *, token: str | None = None, private: bool | None = False,
               merge_lora: bool = False, commit_message: str = "Upload DiLoCo model", endpoint: str | None = None,
               allow_unfinished: bool = False, progress=print, settings: dict | None = None,
               revision: str | None = None, blocking: bool = True, outcome: dict | None = None):
    """What `push` does, for every caller (`hf-diloco push`, the app, `DiLoCoTrainer.push_to_hub` and its pushes
    during training): the files of `repo_files`, named by `public_name` (`upload_source`), and the card of
    `model_card` (from `settings`, else the folder's run_config.json; `outcome`, else `run_outcome`), in one commit
    on `revision` (default: main). Returns huggingface_hub's CommitInfo, or a Future of it when not `blocking` (the
    repo is created and every file but the weights read before this returns; the commit runs in a thread).
    """
    from huggingface_hub import CommitOperationAdd, HfApi

    output_dir = Path(output_dir)
    files = repo_files(output_dir, merge_lora)
    run_folder = files[next(n for n in files if n.endswith(".safetensors"))].parent
    run_folder = run_folder.parent if run_folder.name == "merged" else run_folder
    outcome = outcome or run_outcome(run_folder)
    if outcome["ended"] != "finished" and not allow_unfinished:
        raise UnfinishedRun(outcome)
    sources = {name: upload_source(name, path) for name, path in files.items()}
    repo_id = check_repo_id(repo_id)
    card = model_card(run_folder, repo_id, settings=settings, outcome=outcome)
    token = resolve_token(token)
    api = HfApi(endpoint=endpoint, token=token)
    operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=source) for name, source in sources.items()]
    operations.append(CommitOperationAdd(path_in_repo=CARD_FILE, path_or_fileobj=card.encode()))
    with tempfile.TemporaryDirectory() as staging:  # read now: a commit in the background outlives the folder
        curve = write_training_curve(run_folder, Path(staging) / CURVE_FILE)
        if curve is not None:
            operations.append(CommitOperationAdd(path_in_repo=CURVE_FILE, path_or_fileobj=curve.read_bytes()))
    names = sorted(op.path_in_repo for op in operations)
    progress(f"[push] {len(names)} files: {', '.join(names)}")
    url = api.create_repo(repo_id, private=private, exist_ok=True)
    progress(f"[push] repository {url}")
    commit = api.create_commit(url.repo_id, operations, commit_message=commit_message, revision=revision,
                               run_as_future=not blocking)
    progress(f"[push] done: {url}" if blocking else f"[push] committing to {url} in the background")
    return commit
