"""Several `hf-diloco train` runs in one `accelerate launch`, trained in turn by the same processes.

Argument: a JSON list of runs, each `{"name": ..., "recipe": path, "args": [hf-diloco train's flags],
"env": {...}}`. Before a run its `env` is put into the environment (and taken out after it), so the test hooks that
read it at each call (tests/scripts/contribution_hook) apply to that run alone. Each run goes through what
`hf-diloco train` runs (`parse_train_args`, then `hf_diloco.train.train`), in its own output folder; rank 0 prints
`=== run NAME ===` on stdout and stderr before each, after every process has finished the run before (a barrier),
so a test can cut the launch's console into the runs' own. A launch of the tiny model spends most of its time
starting Pythons: this pays for them once. `"copy": [source, destination]` has rank 0 copy a folder a run before
wrote (a checkpoint) before the run starts, leaving out the files named in `"leave_out"`. `"digests": true` has each
rank write the digest of its parameters after every sync (`SyncDigests`). `{"name", "script": path}` runs a Python
script instead, with `SyncDigests` among its globals.
"""

import hashlib
import json
import os
import runpy
import shutil
import sys
from pathlib import Path

import torch.distributed as dist
from transformers import TrainerCallback

from hf_diloco import launch
from hf_diloco import train as training
from hf_diloco.recipes import parse_train_args

RUN_MARK = "=== run {} ==="


class SyncDigests(TrainerCallback):
    """With `"digests": true`: each rank writes `<output_dir>/digests-rank<r>.json`, {step: SHA-256 of its
    parameters} at every sync boundary (read as the next step begins, after the sync landed) and at the end."""

    def __init__(self, config):
        self.every, self.found = config.inner_steps, {}

    def _record(self, state, model) -> None:
        digest = hashlib.sha256()
        for p in model.parameters():  # a sharded parameter (a DTensor): this process's shard
            local = p.to_local() if hasattr(p, "to_local") else p
            # A copy: a tensor lent to numpy can no longer be resized, which FSDP2 does to free a gathered weight.
            digest.update(local.detach().float().cpu().clone().numpy().tobytes())
        self.found[state.global_step] = digest.hexdigest()

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step and state.global_step % self.every == 0:
            self._record(state, model)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self._record(state, model)
        Path(args.output_dir, f"digests-rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(self.found))


def main() -> None:
    for run in json.loads(sys.argv[1]):
        if "copy" in run and os.environ.get("RANK", "0") == "0":
            source, destination = (Path(p) for p in run["copy"])
            shutil.copytree(source, destination, ignore=shutil.ignore_patterns(*run.get("leave_out", [])))
        if dist.is_initialized():
            dist.barrier()
        if os.environ.get("RANK", "0") == "0":
            for stream in (sys.stdout, sys.stderr):
                print(RUN_MARK.format(run["name"]), file=stream, flush=True)
        saved = {key: os.environ.get(key) for key in run.get("env", {})}
        os.environ.update(run.get("env", {}))
        try:
            if "script" in run:  # a user's script (a docs example), run as `accelerate launch script.py` would
                runpy.run_path(run["script"], init_globals={"SyncDigests": SyncDigests}, run_name="__main__")
                continue
            arguments, config = parse_train_args(run["recipe"], run["args"])
            training.train(arguments, config, callbacks=[SyncDigests(config)] if run.get("digests") else ())
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


if __name__ == "__main__":
    main()
    # Leave as `hf-diloco train` does (hf_diloco.cli): gloo's threads torn down at interpreter exit can abort a
    # process that finished every run.
    launch.destroy_process_groups()
    launch.exit_process(0)
