"""Runs that tests of several files read: each is launched once per session, the first time a test asks for it."""

import json

import pytest
from helpers import ACCELERATE_CPU_2PROC, REPO, accelerate_launch

REPLICA_RUN = str(REPO / "tests" / "scripts" / "replica_run.py")


@pytest.fixture(scope="session")
def paper_run(tmp_path_factory):
    """Two replicas of one process (tests/scripts/replica_run.py) with the paper's outer settings (SGD lr 0.7,
    momentum 0.9, Nesterov), H = 5, 12 steps: rounds end at 5, 10, 12; Trainer reports to TensorBoard. Every other
    field at its default, so a run of the same settings spelled otherwise must end with its bits. Returns (folder,
    every rank's record)."""
    tmp = tmp_path_factory.mktemp("paper")
    settings = {"out": str(tmp), "inner_steps": 5, "max_steps": 12, "outer_lr": 0.7, "outer_momentum": 0.9,
                "outer_nesterov": True, "report_to": "tensorboard"}
    result = accelerate_launch([REPLICA_RUN, json.dumps(settings)], config=ACCELERATE_CPU_2PROC)
    assert result.returncode == 0, f"replica run failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return tmp, [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]
