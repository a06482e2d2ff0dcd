"""DiLoCo for TRL's SFTTrainer and DPOTrainer (`pip install hf-diloco[trl]`).

    from hf_diloco.trl import DiLoCoSFTConfig, DiLoCoSFTTrainer

    args = DiLoCoSFTConfig(output_dir="runs/sft", inner_steps=20, max_length=256)
    DiLoCoSFTTrainer(model=model, args=args, train_dataset=chat_data, processing_class=tokenizer).train()

Each class is `DiLoCoMixin` before TRL's trainer, and each config TRL's config before DiLoCoConfig, so TRL's
defaults stand (SFT: learning rate 2e-5; DPO: 1e-6) and DiLoCo's fields and checks join them. TRL prepares the data
(chat template, tokenization, its collator) as it does without DiLoCo; its per-step metric gathers stay on each
replica (compat.replica_local_metric_gathers), so nothing crosses replicas between syncs, and the metrics it logs
are the replica's own.

DPO's reference model: with LoRA, TRL's own (the model with its adapters switched off, the same base on every
replica); without, pass `ref_model` (a copy of the starting model). `sync_ref_model` is refused: each replica would
move its reference towards its own weights between syncs, and the replicas' references would drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from .config import ConfigError, DiLoCoConfig
from .trainer import DiLoCoMixin

try:
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer
except ImportError as error:  # the optional extra is not installed
    raise ImportError(f"hf_diloco.trl needs TRL: pip install 'hf-diloco[trl]' ({error}).") from None


@dataclass
class DiLoCoSFTConfig(SFTConfig, DiLoCoConfig):
    """SFTConfig's fields and defaults, with DiLoCoConfig's fields and checks."""

    trl_trainer = "sft"  # (not a field) the TRL trainer this config is of: the `trainer: ddp` baseline keeps it


@dataclass
class DiLoCoDPOConfig(DPOConfig, DiLoCoConfig):
    """DPOConfig's fields and defaults, with DiLoCoConfig's fields and checks."""

    trl_trainer = "dpo"  # (not a field)

    def __post_init__(self):
        if self.sync_ref_model:
            raise ConfigError("sync_ref_model moves each replica's reference model towards its own weights between "
                              "syncs, so the replicas' references would drift apart; leave it off with DiLoCo.")
        super().__post_init__()


class DiLoCoSFTTrainer(DiLoCoMixin, SFTTrainer):
    """TRL's SFTTrainer, each process a DiLoCo replica (args: DiLoCoSFTConfig)."""

    config_class = DiLoCoSFTConfig


class DiLoCoDPOTrainer(DiLoCoMixin, DPOTrainer):
    """TRL's DPOTrainer, each process a DiLoCo replica (args: DiLoCoDPOConfig)."""

    config_class = DiLoCoDPOConfig


def baseline(config: DiLoCoSFTConfig | DiLoCoDPOConfig) -> tuple[type, SFTConfig | DPOConfig]:
    """The `trainer: ddp` baseline of a TRL recipe: TRL's own trainer class (no DiLoCo: gradients all-reduced every
    step, as a user runs it without hf-diloco) and its own config, holding `config`'s values of that config's
    fields (the DiLoCo fields have no place in it).

    >>> trainer, args = baseline(DiLoCoSFTConfig(output_dir="/tmp/sft", max_length=64, inner_steps=5, use_cpu=True))
    >>> trainer.__name__, type(args).__name__, args.max_length, hasattr(args, "inner_steps")
    ('SFTTrainer', 'SFTConfig', 64, False)
    """
    trainer, arguments = (SFTTrainer, SFTConfig) if isinstance(config, DiLoCoSFTConfig) else (DPOTrainer, DPOConfig)
    names = {f.name for f in fields(arguments) if f.init}
    return trainer, arguments(**{f.name: getattr(config, f.name) for f in fields(config) if f.init and f.name in names})
