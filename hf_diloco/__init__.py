"""hf-diloco: low-communication distributed training (DiLoCo) for Hugging Face models.

`DiLoCoTrainer`, `DiLoCoConfig` and `RunArguments` are imported on first use, so light modules (`hf_diloco.runs`,
used by the app) do not pull in torch and transformers.
"""

__all__ = ["DiLoCoConfig", "DiLoCoTrainer", "RunArguments"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in ("DiLoCoConfig", "RunArguments"):
        from . import config

        return getattr(config, name)
    if name == "DiLoCoTrainer":
        from .trainer import DiLoCoTrainer

        return DiLoCoTrainer
    raise AttributeError(f"module 'hf_diloco' has no attribute {name!r}")
