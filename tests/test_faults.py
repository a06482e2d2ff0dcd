"""A replica that goes bad must not poison the run: real 2-process runs (accelerate launch, gloo)."""

import json

import pytest
import torch
from helpers import REPO, accelerate_launch

from hf_diloco.metrics import read_syncs

pytestmark = pytest.mark.process  # every test here starts processes

FAULT_RUN = str(REPO / "tests" / "scripts" / "fault_run.py")


@pytest.fixture(scope="module")
def bad_replicas(tmp_path_factory):
    """One launch of two processes: a run where replica 1 goes NaN once, then one where both do until the run
    stops (last: it ends the processes with its error). Returns (the launch, the two runs' folders)."""
    folder = tmp_path_factory.mktemp("faults")
    runs = [{"out": str(folder / "nan"), "poison": {"1": [4]}},
            {"out": str(folder / "all-bad"), "poison": {"0": [4, 8], "1": [4, 8]}, "max_bad_rounds": 2}]
    return accelerate_launch([FAULT_RUN, json.dumps(runs)]), folder / "nan", folder / "all-bad"


def test_a_replica_with_nan_sits_the_round_out_and_training_goes_on(bad_replicas):
    """Replica 1's parameters turn NaN just before the sync at step 4. That round averages replica 0 alone: with
    FedAvg (outer lr 1, no momentum) θ_global becomes replica 0's parameters, and both replicas take it; the next
    rounds have both replicas again and finite losses. The round record names the replica."""
    _, tmp_path, _ = bad_replicas
    rounds = read_syncs(tmp_path / "run")
    assert [r["step"] for r in rounds] == [4, 8, 12]
    assert rounds[0]["non_finite_replicas"] == [1] and rounds[0]["participants"] == 1
    assert "non_finite_replicas" not in rounds[1] and "non_finite_replicas" not in rounds[2]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rounds[1:])
    replica0_before = torch.load(tmp_path / "params0-before.pt")
    for rank in (0, 1):
        after = torch.load(tmp_path / f"params{rank}-after.pt")
        for expected, got in zip(replica0_before, after, strict=True):
            assert torch.allclose(got, expected, atol=1e-6), "θ_global = replica 0's parameters (1e-6)"
        assert all(json.loads((tmp_path / f"rank{rank}.json").read_text())["finite_after_sync"])


def test_a_run_where_every_replica_goes_bad_stops_with_one_sentence(bad_replicas):
    """Both replicas NaN before the syncs at 4 and 8: the outer step is skipped twice, then the run stops."""
    result, _, tmp_path = bad_replicas
    assert result.returncode != 0
    assert "no replica had a finite pseudo-gradient for 2 consecutive rounds (last at step 8)" in result.stderr
    rounds = read_syncs(tmp_path / "run")
    assert rounds and rounds[0]["outer_step_skipped"] and rounds[0]["participants"] == 0


def test_a_replica_that_never_reaches_the_sync_is_named_when_the_timeout_expires(tmp_path):
    """Replica 1 stalls for two minutes before the sync at step 8; with sync_timeout 5 s replica 0 stops with a
    sentence naming replica 1 and the last sync it reached (step 4), and the launcher ends the stalled one."""
    settings = {"out": str(tmp_path), "sleep": {"1": [8, 120]}, "sync_timeout": 5}
    result = accelerate_launch([FAULT_RUN, json.dumps(settings)], timeout=100)
    assert result.returncode != 0
    assert ("the sync at step 8 gave up after waiting for replica 1 (last seen at the sync of step 4) "
            "(sync_timeout=5 s") in result.stderr
    assert [r["step"] for r in read_syncs(tmp_path / "run")] == [4]
