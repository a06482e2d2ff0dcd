"""`hf-diloco` with one replica made slower: `python benchmarks/paced.py ARGS...` runs `hf-diloco ARGS...`.

With BENCH_SLOW_REPLICA=r and BENCH_SLOWDOWN=k in the environment, replica r (its `--replica_id`, or its rank under
accelerate launch) spends k times as long on every inner step: after each step it keeps its core busy for k − 1
times the step's own duration. It spins rather than sleeps, so the cores it shares with the other replicas are as
loaded as when it trains, and their speed does not change: it stands for slower hardware.
"""

from __future__ import annotations

import os
import sys
import time

from transformers import TrainerCallback

from hf_diloco import cli
from hf_diloco import train as training


class Slower(TrainerCallback):
    def __init__(self, factor: float):
        self.factor = factor
        self.started = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        until = time.perf_counter() + (self.factor - 1) * (time.perf_counter() - self.started)
        while time.perf_counter() < until:
            pass


def this_replica(argv: list[str]) -> int:
    if "--replica_id" in argv:
        return int(argv[len(argv) - 1 - argv[::-1].index("--replica_id") + 1])
    return int(os.environ.get("RANK", "0"))


def main() -> int:
    argv = sys.argv[1:]
    slow = os.environ.get("BENCH_SLOW_REPLICA")
    if slow is not None and int(slow) == this_replica(argv):
        factor = float(os.environ.get("BENCH_SLOWDOWN", "3"))
        original = training.train

        def paced(run, config, callbacks=(), stop_signals=True):
            return original(run, config, callbacks=[*callbacks, Slower(factor)], stop_signals=stop_signals)

        training.train = paced
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
