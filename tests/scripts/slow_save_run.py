"""`hf-diloco train` in which writing one checkpoint is slow, so a test can kill the run in the middle of it.

Arguments: the marker file to create when the slow save starts, the step whose save is slow, then the CLI's
arguments. Every process's `torch.save` of its optimizer state for that step first creates the marker and sleeps
for a minute: the checkpoint is half written, as it would be when a machine dies mid-save.
"""

import sys
import time
from pathlib import Path

import torch

marker, slow_step, *cli_args = sys.argv[1:]
original_save = torch.save


def slow_save(obj, f, *args, **kwargs):
    if str(f).endswith("optimizer.pt") and f"checkpoint-{slow_step}" in str(f):
        Path(marker).touch()
        time.sleep(60)
    return original_save(obj, f, *args, **kwargs)


torch.save = slow_save
from hf_diloco.cli import main  # noqa: E402

sys.exit(main(cli_args))
