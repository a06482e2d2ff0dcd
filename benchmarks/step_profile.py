"""Where an inner step's time goes in DiLoCoTrainer: the work that is not inner training, per step.

One replica (one process, one CPU thread) trains the peer task under cProfile; the profile is read back and the
loop's time is split into what Trainer spends training (forward, backward, clipping, AdamW: Trainer.training_step
and the optimizer step), what hf-diloco adds on every step outside a sync (its callbacks, the per-micro-batch
loss bookkeeping, the run's progress and heartbeat files, the stop check), what the syncs take, and the rest of
Trainer's loop (data loading, its own callbacks and logging). Each share is given in milliseconds per step and as
a fraction of the loop; the profiler's own cost inflates Python-heavy parts, so the fractions are upper bounds.

    python benchmarks/step_profile.py [--quick] [--steps N]
"""

from __future__ import annotations

import argparse
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, markdown_table, run_env, save, train_command

# Functions by (file suffix, name): the cumulative time of the outermost call of each is what it costs.
INNER_TRAINING = [("transformers/trainer.py", "training_step"), ("torch/optim/optimizer.py", "wrapper")]
DILOCO_PER_STEP = [("hf_diloco/diloco_callback.py", "on_step_begin"),
                   ("hf_diloco/diloco_callback.py", "on_step_end"),
                   ("hf_diloco/diloco_callback.py", "observe_micro_batch"),
                   ("hf_diloco/run_callbacks.py", "on_step_end"), ("hf_diloco/run_callbacks.py", "on_step_begin"),
                   ("hf_diloco/trainer.py", "_maybe_log_save_evaluate")]
SYNC = [("hf_diloco/engine.py", "sync")]
LOOP = [("transformers/trainer.py", "_inner_training_loop")]


def cumulative(stats: pstats.Stats, functions: list[tuple[str, str]]) -> float:
    """Sum of the cumulative seconds of `functions`. They do not call each other, except on_step_end calling
    the engine's sync (subtracted in main) and the outer optimizer's step inside a sync, which counts as training
    too (0.2 ms every 50 steps)."""
    total = 0.0
    for (path, _, name), (_, _, _, cumtime, _) in stats.stats.items():
        if any(path.endswith(suffix) and name == wanted for suffix, wanted in functions):
            total += cumtime
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="100 steps instead of 400")
    parser.add_argument("--steps", type=int, help="inner steps to profile")
    args = parser.parse_args()
    steps = args.steps or (100 if args.quick else 400)
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        profile = Path(tmp) / "profile.out"
        command = train_command(1, ["--output_dir", str(Path(tmp) / "run"), "--max_steps", str(steps),
                                    "--inner_steps", "50", "--eval_strategy", "no", "--eval_on_start", "false",
                                    "--save_strategy", "no", "--save_every_rounds", "0", "--report_to", "none",
                                    "--logging_steps", "10"])
        command = [command[0], "-m", "cProfile", "-o", str(profile), *command[1:]]
        print("profiling:", " ".join(command), flush=True)
        subprocess.run(command, cwd=REPO, env=run_env(), check=True, stdout=subprocess.DEVNULL)
        stats = pstats.Stats(str(profile))
    loop = cumulative(stats, LOOP)
    training = cumulative(stats, INNER_TRAINING)
    sync = cumulative(stats, SYNC)
    diloco = cumulative(stats, DILOCO_PER_STEP) - sync  # the engine's sync runs inside on_step_end
    rest = loop - training - sync - diloco
    rows = [[name, f"{1000 * seconds / steps:.2f}", f"{seconds / loop:.2%}"] for name, seconds in (
        ("inner training (forward, backward, clipping, AdamW)", training),
        ("hf-diloco's per-step work outside syncs (callbacks, loss bookkeeping, progress files, stop check)", diloco),
        ("syncs (one every 50 steps)", sync),
        ("the rest of Trainer's loop (data loading, its callbacks and logging)", rest),
        ("the whole loop", loop))]
    table = markdown_table(["part of the loop (1 replica, peer task, under cProfile)", "ms per step",
                            "share of the loop"], rows)
    table += f"\n\n{steps} steps, H = 50, logging every 10 steps; cProfile's overhead falls mostly on Python code."
    save("step-profile", table, {"steps": steps, "loop_s": loop, "training_s": training, "sync_s": sync,
                                 "diloco_per_step_s": diloco, "rest_s": rest}, quick=args.quick,
         seconds=time.time() - started)


if __name__ == "__main__":
    sys.exit(main())
