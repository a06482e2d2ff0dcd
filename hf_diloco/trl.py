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

from dataclasses import dataclass

from .config import ConfigError, DiLoCoConfig
from .trainer import DiLoCoMixin

try:
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer
except ImportError as error:  # the optional extra is not installed
    raise ImportError(f"hf_diloco.trl needs TRL: pip install 'hf-diloco[trl]' ({error}).") from None


@dataclass
class DiLoCoSFTConfig(SFTConfig, DiLoCoConfig):
    """SFTConfig's fields and defaults, with DiLoCoConfig's fields and checks."""


@dataclass
class DiLoCoDPOConfig(DPOConfig, DiLoCoConfig):
    """DPOConfig's fields and defaults, with DiLoCoConfig's fields and checks."""

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
