"""Runs managed from outside (what the app does): start detached, read real status, stop gracefully."""

import json
import os
import time

from helpers import ACCELERATE_CPU_2PROC, REPO, env, free_port

from hf_diloco import runs

RECIPE = str(REPO / "recipes" / "tiny-pretrain.yaml")
SHORT = ["--max_steps", "400", "--inner_steps", "5", "--block_size", "64", "--eval_strategy", "no",
         "--eval_on_start", "false", "--disable_tqdm", "true", "--logging_steps", "5"]


def wait_for(predicate, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def rounds_of(run) -> list[dict]:
    path = run.folder / "output" / "sync_rounds.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_stop_finishes_the_round_saves_a_checkpoint_and_leaves_no_process(tmp_path, monkeypatch):
    for key, value in env().items():
        monkeypatch.setenv(key, value)
    run = runs.start(tmp_path, RECIPE, str(ACCELERATE_CPU_2PROC), SHORT, port=free_port())
    assert runs.load(run.folder).status == "running"
    wait_for(lambda: rounds_of(run), 180, "the first round")
    assert len(runs.training_pids(runs.load(run.folder))) == 2, "one training process per replica"

    runs.stop(run.folder, grace_seconds=120)
    final = wait_for(lambda: (r := runs.load(run.folder)).status not in runs.ACTIVE and r, 150, "the run to end")
    assert final.status == "stopped" and final.exit_code == 0
    checkpoints = sorted((run.folder / "output").glob("checkpoint-*"))
    assert checkpoints, "stopping saves a checkpoint"
    step = int(checkpoints[-1].name.split("-")[1])
    assert step % 5 == 0 and step < 400, "at a round boundary, before the end"
    assert (checkpoints[-1] / "diloco_outer.pt").is_file()
    assert rounds_of(run)[-1]["step"] == step
    assert runs.training_pids(final) == []
    assert not runs._alive(final.supervisor_pid, "hf_diloco.runs")
    log = (run.folder / "run.log").read_text()
    assert "stop requested" in log


def test_a_run_whose_supervisor_died_reads_as_failed(tmp_path):
    folder = tmp_path / "ghost"
    folder.mkdir()
    dead = runs.Run("ghost", RECIPE, "x.yaml", [], ["true"], str(folder / "output"), status="running",
                    supervisor_pid=os.getpid())  # alive, but not a supervisor: must not count
    runs._write(folder, dead)
    assert runs.load(folder).status == "failed"
    assert [r.id for r in runs.list_runs(tmp_path)] == ["ghost"]


def test_runs_module_does_not_import_torch():
    """The app lists and starts runs through this module; it must stay light."""
    import subprocess
    import sys

    code = "import sys, hf_diloco.runs; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert result.stdout.strip() == "False", result.stderr
