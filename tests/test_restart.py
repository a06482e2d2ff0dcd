"""Nothing lost when a process dies: round checkpoints marked complete only when whole, `resume_from_checkpoint:
auto`, and torchelastic's automatic restart (`--max_restarts`), with real 2-process runs of `hf-diloco train` on
the tiny Llama (gloo).
"""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from helpers import ACCELERATE_CPU_2PROC, REPO, env, free_port, wait_for
from safetensors.torch import load_file

from hf_diloco import checkpoints
from hf_diloco.files import read_json
from hf_diloco.metrics import read_syncs

RECIPE = str(REPO / "recipes" / "tiny-pretrain.yaml")
SLOW_SAVE = str(REPO / "tests" / "scripts" / "slow_save_run.py")


def train_args(output_dir: Path, max_steps: int, inner_steps: int) -> list[str]:
    return ["train", "--config", RECIPE, "--output_dir", str(output_dir), "--max_steps", str(max_steps),
            "--inner_steps", str(inner_steps), "--block_size", "64", "--per_device_train_batch_size", "2",
            "--eval_strategy", "no", "--eval_on_start", "false", "--logging_steps", "1000", "--disable_tqdm", "true"]


def launch(target: list[str], *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE_CPU_2PROC),
               "--main_process_port", str(free_port()), *extra, *target]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(), cwd=REPO,
                            start_new_session=True)


def finish(process: subprocess.Popen, timeout: int = 400) -> str:
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, f"{out[-2000:]}\n{err[-4000:]}"
    return out


def final_weights(output_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(output_dir / "model.safetensors")


def assert_same_model(a: Path, b: Path) -> None:
    first, second = final_weights(a), final_weights(b)
    assert first.keys() == second.keys()
    for name in first:
        assert torch.allclose(first[name], second[name], atol=1e-5), f"{name} differs by more than 1e-5"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """The run the interrupted ones must end as: 60 steps, H = 10, never stopped."""
    clean = tmp_path_factory.mktemp("uninterrupted") / "clean"
    finish(launch(["-m", "hf_diloco.cli", *train_args(clean, 60, 10)]))
    return clean


@pytest.mark.process
def test_a_run_killed_while_saving_resumes_from_the_previous_complete_checkpoint(tmp_path, uninterrupted):
    """SIGKILL to every process while checkpoint-20 is half written: `checkpoint-20` is there without its marker
    (not complete), checkpoint-10 is complete; `auto` removes checkpoint-20 with a notice, resumes from
    checkpoint-10, and ends with the model of a run that was never interrupted (1e-5)."""
    out, saving = tmp_path / "run", tmp_path / "saving"
    run = launch([SLOW_SAVE, str(saving), "20", *train_args(out, 60, 10)])
    wait_for(saving.exists, 300, "the slow save of checkpoint-20 to begin", every=0.2)
    # torchelastic starts each worker in a session of its own: the launcher's group, then every worker.
    workers = subprocess.run(["pgrep", "-f", f"{SLOW_SAVE} .*{out}"], capture_output=True, text=True).stdout.split()
    os.killpg(run.pid, signal.SIGKILL)
    for pid in workers:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    run.communicate()
    names = sorted(p.name for p in out.iterdir() if "checkpoint" in p.name)
    assert names == ["checkpoint-10", "checkpoint-20"]
    assert checkpoints.is_complete(out / "checkpoint-10") and not checkpoints.is_complete(out / "checkpoint-20")
    assert not (out / "checkpoint-20" / checkpoints.MARKER_FILE).exists()

    resumed = finish(launch(["-m", "hf_diloco.cli", *train_args(out, 60, 10), "--resume_from_checkpoint", "auto"]))
    assert "removing checkpoint-20: an incomplete checkpoint" in resumed
    assert f"resuming from {out / 'checkpoint-10'}" in resumed
    rounds = read_syncs(out)
    assert [r["step"] for r in rounds] == list(range(10, 61, 10))
    assert rounds[1]["resumed_from"] == str(out / "checkpoint-10")
    assert 0 <= rounds[1]["steps_lost"] <= 10
    assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) == ["checkpoint-50", "checkpoint-60"]
    assert checkpoints.is_complete(out / "checkpoint-50") and checkpoints.is_complete(out / "checkpoint-60")
    assert_same_model(out, uninterrupted)


def test_removing_a_checkpoint_never_leaves_an_incomplete_one_under_its_name(tmp_path, monkeypatch):
    """`save_total_limit` removes old checkpoints (and a new save of a step replaces an earlier attempt's folder).
    A process killed while the files are being deleted leaves the folder under a temporary name, which `auto`
    clears with a notice, never a `checkpoint-<step>` with files missing."""
    from hf_diloco.train import newest_complete_checkpoint

    for step in (10, 20, 30):
        folder = tmp_path / f"checkpoint-{step}"
        (folder / "process-0").mkdir(parents=True)
        for name in ("model.safetensors", "diloco_outer.pt", "process-0/optimizer.pt"):
            (folder / name).write_text(name)
        checkpoints.mark_complete(folder, step, processes=1)
    complete = sorted(p.relative_to(tmp_path / "checkpoint-10").as_posix()
                      for p in (tmp_path / "checkpoint-10").rglob("*"))

    def killed_midway(path, ignore_errors=False):
        next(p for p in Path(path).rglob("*") if p.is_file()).unlink()  # one file gone, then the process dies
        raise KeyboardInterrupt("killed while deleting")

    monkeypatch.setattr(checkpoints.shutil, "rmtree", killed_midway)
    for attempt in (lambda: checkpoints.rotate(tmp_path, 2),
                    lambda: checkpoints.begin(tmp_path / "checkpoint-30")):
        try:
            attempt()
        except KeyboardInterrupt:
            pass
        else:
            raise AssertionError("the deletion was not attempted")
    monkeypatch.undo()
    for folder in tmp_path.glob("checkpoint-*"):  # whatever still has a checkpoint name is whole
        assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")) == complete, folder
        assert checkpoints.is_complete(folder)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint-20", "tmp-checkpoint-removed-checkpoint-10", "tmp-checkpoint-removed-checkpoint-30"]
    assert newest_complete_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-20")
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-20"]


@pytest.mark.process
def test_a_killed_replica_is_restarted_and_the_run_finishes_by_itself(tmp_path, uninterrupted):
    """`hf-diloco launch --max-restarts 1`: SIGKILL one replica in the middle of a round (the one after a round's
    checkpoint past step 30); the launcher starts both processes again, they find the newest complete checkpoint
    without any flag, lose the steps of the round in flight and no more, and end with an uninterrupted run's
    model."""
    out = tmp_path / "run"
    command = [sys.executable, "-m", "hf_diloco.cli", "launch", RECIPE, "--accelerate-config",
               str(ACCELERATE_CPU_2PROC), "--port", str(free_port()), "--max-restarts", "1",
               *train_args(out, 60, 10)[3:]]
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(), cwd=REPO,
                           start_new_session=True)

    def checkpoint_past_step_30() -> bool:
        if run.poll() is not None:
            raise AssertionError(f"the launch ended before the kill: {finish(run)[-2000:]}")
        newest = checkpoints.newest_complete(out)
        return newest is not None and checkpoints.step_of(newest) > 30

    # Every run passes this point and the checkpoint stays, so no machine, however loaded, can miss it (a round of
    # the tiny model takes a fraction of a second, and progress.json, rewritten at most twice a second, can skip
    # every mid-round step). Asked often and acted on at once, the kill lands in the next round's inner steps.
    wait_for(checkpoint_past_step_30, 400, "a complete checkpoint past step 30", every=0.05)
    workers = subprocess.run(["pgrep", "-f", f"hf_diloco.cli train .*{out}"], capture_output=True, text=True)
    pids = [int(pid) for pid in workers.stdout.split()]
    launcher = subprocess.run(["pgrep", "-f", f"accelerate.commands.launch.*{out}"], capture_output=True, text=True)
    worker = max(set(pids) - {int(pid) for pid in launcher.stdout.split()})
    os.kill(worker, signal.SIGKILL)
    finish(run)
    rounds = read_syncs(out)
    assert [r["step"] for r in rounds] == list(range(10, 61, 10))
    resumed = [r for r in rounds if "resumed_from" in r]
    # At most the round in flight. progress.json, from which steps_lost is counted, is written at most twice a
    # second, so a kill just after a round boundary can record 0.
    assert len(resumed) == 1 and 0 <= resumed[0]["steps_lost"] <= 10, resumed

    assert_same_model(out, uninterrupted)
    assert read_json(out / "diloco_summary.json")["steps"] == 60


@pytest.mark.process
def test_sigterm_to_one_replica_stops_every_replica_at_the_round_end_with_a_checkpoint(tmp_path):
    """What a scheduler sends before a preemption: the replica that got SIGTERM passes the request on with the
    round's sync, every replica stops after the same step, the checkpoint is saved and the run exits 0."""
    out = tmp_path / "run"
    run = launch(["-m", "hf_diloco.cli", *train_args(out, 400, 10)])
    wait_for(lambda: (out / "checkpoint-20").exists(), 300, "checkpoint-20", every=0.2)
    workers = subprocess.run(["pgrep", "-f", f"hf_diloco.cli train .*{out}"], capture_output=True, text=True)
    launcher = subprocess.run(["pgrep", "-f", f"accelerate.commands.launch.*{out}"], capture_output=True, text=True)
    worker = max({int(pid) for pid in workers.stdout.split()} - {int(pid) for pid in launcher.stdout.split()})
    os.kill(worker, signal.SIGTERM)
    stdout = finish(run)
    assert "SIGTERM: stopping at the end of this round" in stdout
    stopped = read_json(out / "stopped.json")
    last = read_syncs(out)[-1]["step"]
    assert stopped["step"] == last < 400 and last % 10 == 0
    assert (out / f"checkpoint-{last}").is_dir()


@pytest.mark.process
def test_sigterm_to_the_launch_stops_the_run_at_the_round_end_and_exits_0(tmp_path):
    """`hf-diloco launch` receives SIGTERM (a scheduler's preemption notice; here twice within a second, as when
    both the job's processes and their launcher are signalled): it passes the request on once to the launch, every
    replica finishes its round and saves a checkpoint, and the command exits 0, not restarted."""
    out = tmp_path / "run"
    command = [sys.executable, "-m", "hf_diloco.cli", "launch", RECIPE, "--accelerate-config",
               str(ACCELERATE_CPU_2PROC), "--port", str(free_port()), "--max-restarts", "1",
               *train_args(out, 400, 10)[3:]]
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(), cwd=REPO)
    wait_for(lambda: (out / "checkpoint-20").exists(), 300, "checkpoint-20", every=0.2)
    run.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    run.send_signal(signal.SIGTERM)
    stdout = finish(run)
    assert stdout.count("SIGTERM: stopping at the end of this round") == 2, stdout[-3000:]  # one per replica
    assert "restart" not in stdout
    stopped = read_json(out / "stopped.json")
    last = read_syncs(out)[-1]["step"]
    assert stopped["step"] == last < 400 and last % 10 == 0
    assert stopped["checkpoint"] == f"checkpoint-{last}" and (out / stopped["checkpoint"]).is_dir()


@pytest.mark.process
def test_the_same_signal_again_after_5_seconds_stops_at_once(tmp_path):
    """SIGTERM asks for a stop at the round end; SIGTERM again within 5 s is the same request (the process keeps
    training); again from 5 s on ends the process at once, by the signal, without stopped.json."""
    out = tmp_path / "run"
    command = [sys.executable, "-m", "hf_diloco.cli", *train_args(out, 100_000, 100_000)]
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(), cwd=REPO)
    wait_for(lambda: read_json(out / "progress.json", {}).get("step", 0) > 2, 300, "step 3", every=0.2)
    run.send_signal(signal.SIGTERM)
    time.sleep(1.0)
    run.send_signal(signal.SIGTERM)  # within 5 s: the same request
    time.sleep(1.0)
    assert run.poll() is None, "a repeat within 5 s does not end the process"
    time.sleep(4.0)
    run.send_signal(signal.SIGTERM)
    stdout, _ = run.communicate(timeout=60)
    assert run.returncode == -signal.SIGTERM and not (out / "stopped.json").exists()
    assert stdout.count("SIGTERM: stopping at the end of this round") == 1


@pytest.mark.process
def test_a_launcher_killed_outright_leaves_no_training_process_beside_the_restarted_one(tmp_path):
    """The launch's own process dies (SIGKILL, say the OOM killer) while its training process trains on: before
    starting the launch again, `run_with_restarts` ends what is left of the failed launch's session, so the restart
    does not make a second copy of the same replica."""
    from hf_diloco.launch import run_with_restarts

    marker, orphan = tmp_path / "restarted", tmp_path / "orphan.pid"
    trainer = "import time; time.sleep(120)"
    launcher = (f"import os, pathlib, subprocess, sys\n"
                f"marker = pathlib.Path({str(marker)!r})\n"
                f"if marker.exists():\n    sys.exit(0)\n"
                f"marker.touch()\n"
                f"child = subprocess.Popen([sys.executable, '-c', {trainer!r}])\n"
                f"pathlib.Path({str(orphan)!r}).write_text(str(child.pid))\n"
                f"os.kill(os.getpid(), 9)\n")
    assert run_with_restarts([sys.executable, "-c", launcher], max_restarts=1, resume=False) == 0
    pid = int(orphan.read_text())
    try:
        wait_for(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, 10,
                 "the first launch's training process to be ended")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.process
def test_a_second_run_into_a_live_runs_folder_is_refused_and_touches_nothing(tmp_path):
    """A run trains into a folder (two replicas); meanwhile the folder holds a checkpoint folder without its marker,
    as one being saved does. A second `hf-diloco launch` into it with `resume_from_checkpoint auto`, and a single
    `hf-diloco train` process, are each refused in one sentence naming the live run's process, exit 2, and leave
    that folder where it was (resume's clean-up of incomplete checkpoints never runs against a live run). Once the
    first run has ended, the same launch is no longer refused for the lock."""
    from helpers import cli

    out = tmp_path / "run"
    first = launch(["-m", "hf_diloco.cli", *train_args(out, max_steps=100_000, inner_steps=10)])
    try:
        wait_for(lambda: read_json(out / "progress.json", {}).get("phase") == "training", 180, "the first run to train")
        saving = out / "checkpoint-999999"
        saving.mkdir()
        (saving / checkpoints.SAVING_FILE).touch()
        second = cli("launch", RECIPE, "--accelerate-config", str(ACCELERATE_CPU_2PROC), "--",
                     "--output_dir", str(out), "--resume_from_checkpoint", "auto", "--max_steps", "20",
                     "--inner_steps", "10")
        alone = cli(*train_args(out, max_steps=20, inner_steps=10), "--resume_from_checkpoint", "auto")
        for refused in (second, alone):
            assert refused.returncode == 2, refused.stdout + refused.stderr
            lines = [line for line in refused.stderr.splitlines() if line.strip()]
            assert len(lines) == 1 and "is in use by another run (process " in lines[0], refused.stderr
            assert "Traceback" not in refused.stderr
        assert saving.is_dir() and first.poll() is None, "the live run and its save in progress are untouched"
    finally:
        (out / "stop.request").touch()
        first.communicate(timeout=300)
    assert first.returncode == 0
    again = cli("launch", RECIPE, "--accelerate-config", str(ACCELERATE_CPU_2PROC), "--dry-run", "--",
                "--output_dir", str(out), "--resume_from_checkpoint", "auto")
    assert "in use by another run" not in again.stderr, again.stderr


@pytest.mark.process
def test_resume_passes_over_a_newest_checkpoint_damaged_at_the_same_size(tmp_path, uninterrupted):
    """The never-interrupted run's folder, its newest checkpoint (checkpoint-60) with one byte of its weights
    flipped: the file keeps its size, so the folder still reads as complete. `auto` says in one line that it does
    not resume from it and why, resumes from checkpoint-50, and ends with the uninterrupted run's model (1e-5)."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(uninterrupted, out)
    weights = out / "checkpoint-60" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert checkpoints.is_complete(out / "checkpoint-60")
    printed = finish(launch(["-m", "hf_diloco.cli", *train_args(out, 60, 10), "--resume_from_checkpoint", "auto"]))
    assert ("[diloco] not resuming from checkpoint-60: model.safetensors does not hold the bytes that were saved"
            in printed), printed[-3000:]
    assert f"[diloco] resuming from {out / 'checkpoint-50'}" in printed
    assert_same_model(out, uninterrupted)
