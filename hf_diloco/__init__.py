"""hf-diloco: low-communication distributed training (DiLoCo) for Hugging Face models."""

from .config import DiLoCoConfig, RunArguments
from .trainer import DiLoCoTrainer

__all__ = ["DiLoCoConfig", "DiLoCoTrainer", "RunArguments"]
__version__ = "0.1.0"
