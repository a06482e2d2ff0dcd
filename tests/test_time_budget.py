"""Time-budget rounds (`round_seconds`) on the fixed group (`outer_backend: torch`), with a real CPU quota.

Replica 1's process runs in a cgroup v1 `cpu` group with a quota of a quarter of a core, so it trains about four
times slower than replica 0 (whose one thread has a core of its own on 2 cores). With rounds of H steps replica 0
would wait for it at every sync; with `round_seconds` each replica syncs when its own budget is spent, after
however many steps it took, and the merge weights each by its tokens.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest
from helpers import ACCELERATE_CPU_2PROC, accelerate_launch

from hf_diloco.metrics import read_sync_rounds

SCRIPT = str(Path(__file__).parent / "scripts" / "replica_run.py")
CPU_CGROUP = Path("/sys/fs/cgroup/cpu")
QUOTA = 0.25  # of one core, for replica 1
ROUND_SECONDS = 0.5
MAX_STEPS = 600
TOKENS_PER_STEP = 2 * 16  # per_device_train_batch_size 2 of tests/helpers.py pattern blocks of 16 tokens


@pytest.fixture
def slow_group():
    """A cgroup v1 `cpu` folder with a quota of QUOTA of a core; removed afterwards."""
    folder = CPU_CGROUP / f"hf-diloco-test-{uuid.uuid4().hex[:8]}"
    try:
        folder.mkdir()
        (folder / "cpu.cfs_period_us").write_text("100000")
        (folder / "cpu.cfs_quota_us").write_text(str(int(QUOTA * 100000)))
    except OSError as error:
        pytest.skip(f"cgroups cannot be written here ({error.strerror}): a CPU quota needs root and cgroup v1 cpu.")
    yield folder
    for pid in (folder / "cgroup.procs").read_text().split():  # none once the launch has ended
        (CPU_CGROUP / "cgroup.procs").write_text(pid)
    os.rmdir(folder)


@pytest.mark.parametrize("sync", [{}, {"num_fragments": 2, "compression": "int4", "error_feedback": True}],
                         ids=["fp32", "2-fragments-int4+ef"])
def test_time_budget_rounds_let_a_slow_replica_take_fewer_steps_and_weight_it_by_its_tokens(tmp_path, slow_group,
                                                                                            sync):
    """Both replicas sync every ROUND_SECONDS of training (every ROUND_SECONDS / 2 with two fragments): replica 0
    takes more steps per round than replica 1, neither spends more than 25% of its training time waiting inside
    syncs, every sync's merge weights are each replica's tokens over the most any replica trained (checked against
    the steps each replica counted itself), and every replica continues at the furthest one's step, so the run
    ends at max_steps on both. With one fragment both replicas hold the same parameters after every sync; with two,
    the fragments sync in turn, the last sync carries both, and the replicas end identical."""
    settings = {"out": str(tmp_path), "inner_steps": 10, "round_seconds": ROUND_SECONDS, "max_steps": MAX_STEPS,
                "cgroup_by_rank": {"1": str(slow_group)}, **sync}
    result = accelerate_launch([SCRIPT, json.dumps(settings)], config=ACCELERATE_CPU_2PROC)
    assert result.returncode == 0, f"run failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    records = read_sync_rounds(tmp_path / "run")

    assert len(records) >= 3, records
    if sync:
        assert [r["fragments"] for r in records] == [[n % 2] for n in range(len(records) - 1)] + [[0, 1]], records
        assert ranks[0]["digests"][-1] == ranks[1]["digests"][-1], "identical parameters at the end"
        assert all(r["compression"] == "int4+ef" for r in records)
    else:
        assert ranks[0]["digests"] == ranks[1]["digests"], "identical parameters after every sync"
    assert [(r["sync"], r["round"]) for r in records] == [(n, -(-n // (1 + bool(sync))))
                                                         for n in range(1, len(records) + 1)]
    assert records[-1]["step"] == MAX_STEPS and ranks[0]["digests"][-1][0] == MAX_STEPS
    fast, slow = ranks[0]["steps_between"], ranks[1]["steps_between"]
    assert len(fast) == len(slow) == len(records)
    # The last sync comes when replica 0 reaches max_steps, before its budget is spent: leave it out.
    assert all(f > 1.5 * s for f, s in zip(fast[:-1], slow[:-1], strict=True)), (fast, slow)
    for record, steps in zip(records, zip(fast, slow, strict=True), strict=True):
        assert record["replica_steps"] == list(steps), record
        expected = [s / max(steps) for s in steps]  # tokens = steps x TOKENS_PER_STEP on both replicas
        assert record["replica_tokens"] == [s * TOKENS_PER_STEP for s in steps], record
        assert record["replica_weights"] == pytest.approx(expected, abs=1e-12), record
    for rank in ranks:
        waited = sum(rank["sync_seconds"])
        assert waited <= 0.25 * rank["train_seconds"], (waited, rank["train_seconds"])
    steps = [r["step"] for r in records]
    assert steps == sorted(steps) and len(set(steps)) == len(steps), "every sync at a later agreed step"
