"""The main job, shortened: `hf-diloco demo` runs two CPU replicas and reports what happened."""

import json

import pytest
from helpers import free_port, hf_diloco

pytestmark = pytest.mark.process  # every test here starts processes


def test_demo_reports_rounds_losses_and_bytes(tmp_path):
    out = tmp_path / "demo"
    result = hf_diloco("demo", "--output-dir", str(out), "--max-steps", "20", "--inner-steps", "10",
                       "--port", str(free_port()))
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads((out / "diloco_summary.json").read_text())
    assert summary["num_replicas"] == 2 and summary["rounds"] == 2 and summary["steps"] == 20
    assert summary["eval_loss_final"] < summary["eval_loss_initial"]
    # Ten inner steps per sync: DDP would all-reduce gradients ten times as often (metric slots aside).
    assert 9.9 < summary["ddp_bytes_per_replica"] / summary["bytes_per_replica"] <= 10
    report = result.stdout[result.stdout.index("hf-diloco demo: what happened"):]
    for row in ("eval loss before -> after", "tokens/s", "sent per replica", "DDP would have sent"):
        assert row in report
    run_metrics = json.loads((out / "run_metrics.json").read_text())
    assert run_metrics["eval_loss"] == summary["eval_loss_final"] and run_metrics["global_step"] == 20
    assert run_metrics["steady_steps"] == 18 and run_metrics["steady_tokens_per_second"] > 0  # steps 2..20
    rounds = [json.loads(line) for line in (out / "syncs.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2] and all(r.get("eval_loss") for r in rounds)
