"""benchmarks/gpu.py, the one command a CUDA machine runs, on its code path here: `--smoke` runs every part (plain
Trainer against DiLoCo, two torchft replicas sharing the device, one outer sync with the outer state on the host and
on the device, the codecs, the dry run's memory) on the tiny preset, so the GPU call cannot fail on a typo."""

import json
import subprocess
import sys

import pytest
from helpers import REPO, env

pytestmark = pytest.mark.process  # it starts training processes


def test_the_gpu_benchmark_runs_every_part_on_its_smoke_settings(tmp_path):
    """Its report names the device, holds a throughput spread for plain Trainer and DiLoCo (outer state on the host
    and on the device) whose ratios are theirs,
    two replicas that ended bit-identical with every sync committed by both, a sync time for the outer state on the
    host and on the device, each codec's time, and the dry run's memory (tiny-llama: 4.33 MB of fp32 parameters);
    the GPU-only figures (peak memory, activations) say they were not measured; the plot is written and the
    partial record kept while it runs is gone. Without
    --smoke on a machine without CUDA it says so and exits 0 with no results."""
    result = subprocess.run([sys.executable, "benchmarks/gpu.py", "--smoke", "--out", str(tmp_path)], cwd=REPO,
                            env=env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    raw = json.loads((tmp_path / "gpu.json").read_text())
    assert raw["device"] == "cpu" and raw["preset"] == "tiny-llama" and raw["quick"] is True
    th = raw["throughput"]
    assert len(th["plain"]["values"]) == len(th["diloco"]["values"]) == len(th["diloco_device"]["values"]) == 1
    assert th["ratio"]["median"] == pytest.approx(th["diloco"]["median"] / th["plain"]["median"], rel=1e-9)
    assert th["ratio_device"]["median"] == pytest.approx(th["diloco_device"]["median"] / th["plain"]["median"],
                                                         rel=1e-9)
    assert th["sync_seconds"]["median"] > 0 and th["sync_seconds_device"]["median"] > 0
    assert th["seconds_per_step"] > 0
    assert raw["replicas"] == {"identical": True, "syncs": 2, "committed_by_both": 2,
                               "backend": "torchft (ProcessGroupGloo across replicas)"}
    assert set(raw["sync"]["sync_seconds"]) == {"host", "device"}, "no pinned memory without CUDA"
    assert set(raw["sync"]["codec_seconds"]) == {"int8", "int4+EF", "sparse+EF"}
    assert all(s > 0 for s in [*raw["sync"]["sync_seconds"].values(), *raw["sync"]["codec_seconds"].values()])
    assert raw["sync"]["parameters"] == 1_082_880
    memory = raw["memory"]
    assert memory["planned_on_device"] == pytest.approx(4.33e6 * 4, rel=0.01), "parameters, gradients, AdamW"
    assert memory["peak"] is None and memory["activations"] is None
    assert raw["checks"]["peak memory within 10% of the dry run + activations"] is None
    assert raw["checks"]["two replicas on one device bit-identical"] is True
    table = (tmp_path / "gpu.md").read_text()
    assert "| two replicas on one device | 2 of 2 syncs by both | bit-identical |" in table
    assert (tmp_path / "gpu.png").stat().st_size > 10_000
    assert not (tmp_path / "gpu-partial.json").exists(), "the partial record goes once the report is written"
    plain = subprocess.run([sys.executable, "benchmarks/gpu.py", "--out", str(tmp_path / "none")], cwd=REPO, env=env(),
                           capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0 and plain.stdout.strip() == ("gpu: skipped: no CUDA device here (python "
                                                              "benchmarks/gpu.py --smoke runs its code path on any "
                                                              "machine)")
    assert not (tmp_path / "none").exists()
