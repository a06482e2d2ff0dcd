"""Runs managed from outside (what the app does): start detached, read real status, stop gracefully."""

import json
import os
import sys
import time
from pathlib import Path

import pytest
from helpers import ACCELERATE_CPU_2PROC, REPO, env, free_port, wait_for

from hf_diloco import runs
from hf_diloco.metrics import read_syncs

RECIPE = str(REPO / "recipes" / "tiny-pretrain.yaml")
SHORT = ["--max_steps", "400", "--inner_steps", "5", "--block_size", "64", "--eval_strategy", "no",
         "--eval_on_start", "false", "--disable_tqdm", "true", "--logging_steps", "5"]


def rounds_of(run) -> list[dict]:
    path = run.folder / "output" / "syncs.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.process
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
    checkpoints = sorted((run.folder / "output").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    assert checkpoints, "stopping saves a checkpoint"
    step = int(checkpoints[-1].name.split("-")[1])
    assert step % 5 == 0 and step < 400, "at a round boundary, before the end"
    assert (checkpoints[-1] / "diloco_outer.pt").is_file()
    assert rounds_of(run)[-1]["step"] == step
    assert runs.training_pids(final) == []
    # The supervisor records the end, then exits: within seconds
    wait_for(lambda: not runs._alive(final.supervisor_pid, "hf_diloco.launch"), 30, "the supervisor to exit")
    log = (run.folder / "run.log").read_text()
    assert "stop requested" in log


@pytest.mark.process
def test_a_ddp_baseline_stops_on_request_with_a_checkpoint_and_records_its_progress(tmp_path, monkeypatch):
    """The plain Trainer (`trainer: ddp`) honours the same stop file: both processes stop after the same step
    (they all-reduce every step, so a stop on one alone would hang the other) and the step's checkpoint is saved.
    Its loss and step reach the run folder from Trainer's own logs (no sync rounds exist for DDP)."""
    for key, value in env().items():
        monkeypatch.setenv(key, value)
    recipe = str(REPO / "recipes" / "ddp-baseline.yaml")
    run = runs.start(tmp_path, recipe, str(ACCELERATE_CPU_2PROC), [*SHORT[:2], *SHORT[4:]], port=free_port())
    progress = run.folder / "output" / runs.PROGRESS_FILE
    wait_for(lambda: progress.exists() and json.loads(progress.read_text())["step"] >= 10, 180, "ten steps")
    runs.stop(run.folder, grace_seconds=120)
    final = wait_for(lambda: (r := runs.load(run.folder)).status not in runs.ACTIVE and r, 150, "the run to end")
    assert final.status == "stopped" and final.exit_code == 0, (run.folder / "run.log").read_text()[-3000:]
    stopped = json.loads((run.folder / "output" / runs.STOPPED_FILE).read_text())
    assert 10 <= stopped["step"] < 400 and stopped["checkpoint"] == f"checkpoint-{stopped['step']}"
    assert (run.folder / "output" / stopped["checkpoint"]).is_dir()
    assert not (run.folder / "output" / runs.STOP_FILE).exists(), "the request is consumed"
    assert json.loads(progress.read_text())["step"] == stopped["step"]
    logged = [json.loads(line) for line in (run.folder / "output" / runs.TRAINER_LOG_FILE).read_text().splitlines()]
    assert any("loss" in entry for entry in logged)


@pytest.mark.process
def test_a_stop_requested_while_starting_is_honoured_at_the_first_round(tmp_path, monkeypatch):
    """Stop pressed before the processes have imported torch: the request waits in the output folder and the
    DiLoCo replicas stop together at the end of their first round, with a checkpoint."""
    for key, value in env().items():
        monkeypatch.setenv(key, value)
    run = runs.start(tmp_path, RECIPE, str(ACCELERATE_CPU_2PROC), SHORT, port=free_port())
    runs.stop(run.folder, grace_seconds=150)
    assert runs.load(run.folder).status == "stopping"
    final = wait_for(lambda: (r := runs.load(run.folder)).status not in runs.ACTIVE and r, 180, "the run to end")
    assert final.status == "stopped", (run.folder / "run.log").read_text()[-3000:]
    assert json.loads((run.folder / "output" / runs.STOPPED_FILE).read_text())["step"] == 5
    assert (run.folder / "output" / "checkpoint-5" / "diloco_outer.pt").is_file()


@pytest.mark.process
def test_a_stop_that_did_not_happen_never_reads_as_stopped(tmp_path):
    """Status comes from what the run did: a run that ends normally after Stop was pressed (it never wrote
    stopped.json) is finished, not stopped."""
    folder = tmp_path / "quick"
    plan = runs.Run("quick", RECIPE, "c.yaml", [], [sys.executable, "-c", "import time; time.sleep(3)"],
                    str(folder / "output"))
    runs.start_planned(plan)
    assert runs.stop(folder, grace_seconds=60).status == "stopping"
    final = wait_for(lambda: (r := runs.load(folder)).status not in runs.ACTIVE and r, 60, "the run to end")
    assert final.status == "finished" and final.exit_code == 0


@pytest.mark.process
def test_a_failed_run_keeps_its_one_sentence_reason(tmp_path):
    folder = tmp_path / "bad"
    script = "import sys; print('Traceback ...'); print('hf-diloco: error: model \"m\" does not exist.', " \
             "file=sys.stderr); print('subprocess.CalledProcessError: Command died'); sys.exit(2)"
    runs.start_planned(runs.Run("bad", RECIPE, "c.yaml", [], [sys.executable, "-c", script], str(folder / "output")))
    final = wait_for(lambda: (r := runs.load(folder)).status not in runs.ACTIVE and r, 60, "the run to end")
    assert final.status == "failed" and final.reason == 'model "m" does not exist.'


@pytest.mark.process
def test_a_run_whose_workers_found_bad_input_says_it_once_without_a_traceback(tmp_path):
    """A run started from the app whose two workers end on the same bad input (each hands its sentence over, then
    the launcher fails with torchelastic's traceback): the run's log holds the sentence once as the CLI says it and
    no traceback, and the run failed with that reason and exit status 2."""
    folder = tmp_path / "bad-input"
    sentence = 'dataset file "corpus.jsonl" does not exist.'
    script = ("import sys; from hf_diloco import launch\n"
              f"for _ in range(2): launch.report_input_error({sentence!r})\n"
              "print('Traceback (most recent call last):', file=sys.stderr, flush=True)\n"
              "print('torch.distributed.elastic.multiprocessing.errors.ChildFailedError:', file=sys.stderr)\n"
              "sys.exit(1)")
    runs.start_planned(runs.Run("bad-input", RECIPE, "c.yaml", [], [sys.executable, "-c", script],
                                str(folder / "output")))
    final = wait_for(lambda: (r := runs.load(folder)).status not in runs.ACTIVE and r, 60, "the run to end")
    assert (final.status, final.exit_code, final.reason) == ("failed", 2, sentence)
    log = (folder / runs.LOG_FILE).read_text().split("sys.exit(1)\n", 1)[1]  # after the "$ command" line
    assert log.count(sentence) == 1 and f"hf-diloco: error: {sentence}" in log and "Traceback" not in log, log


def test_a_run_whose_supervisor_died_reads_as_failed(tmp_path):
    folder = tmp_path / "ghost"
    folder.mkdir()
    dead = runs.Run("ghost", RECIPE, "x.yaml", [], ["true"], str(folder / "output"), status="running",
                    supervisor_pid=os.getpid())  # alive, but not a supervisor: must not count
    runs._write(folder, dead)
    assert runs.load(folder).status == "failed"
    assert [r.id for r in runs.list_runs(tmp_path)] == ["ghost"]


def test_a_run_whose_run_json_is_damaged_is_listed_as_failed_with_the_sentence_naming_it(tmp_path):
    """An empty run.json does not take the run list (the app's every page) down with it: the run reads as failed,
    its reason the one sentence that names the file and what to do; the file itself is left as it was."""
    good, bad = tmp_path / "good", tmp_path / "bad"
    for folder in (good, bad):
        folder.mkdir()
    runs._write(good, runs.Run("good", RECIPE, "x.yaml", [], ["true"], str(good / "output"), status="finished"))
    (bad / runs.RUN_FILE).write_text("")
    listed = {run.id: run for run in runs.list_runs(tmp_path)}
    assert set(listed) == {"good", "bad"} and listed["good"].status == "finished"
    assert listed["bad"].status == "failed"
    assert listed["bad"].reason == f"{bad / runs.RUN_FILE} is empty; restore it from a copy, or move it out of the " \
                                   f"way to go on without it."
    assert runs.stop(bad).status == "failed" and (bad / runs.RUN_FILE).read_text() == ""


def test_a_run_json_from_a_newer_version_is_read_and_keeps_its_unknown_keys_when_rewritten(tmp_path):
    """A run.json with a key this version does not know (a newer version wrote it) is read as the run it is, and
    a rewrite (here: a stop request on a finished run) leaves that key as it was."""
    folder = tmp_path / "newer"
    folder.mkdir()
    runs._write(folder, runs.Run("newer", RECIPE, "x.yaml", [], ["true"], str(folder / "output"), status="finished"))
    values = json.loads((folder / runs.RUN_FILE).read_text())
    assert "unknown" not in values
    (folder / runs.RUN_FILE).write_text(json.dumps({**values, "placement": {"site": "b"}}))
    [run] = runs.list_runs(tmp_path)
    assert (run.id, run.status, run.reason) == ("newer", "finished", "")
    with runs._updating(folder) as changing:
        changing.name = "renamed"
    kept = json.loads((folder / runs.RUN_FILE).read_text())
    assert kept["placement"] == {"site": "b"} and kept["name"] == "renamed" and "unknown" not in kept


@pytest.mark.process
def test_the_app_and_the_modules_it_uses_do_not_import_torch():
    """The app lists and starts runs (hf_diloco.runs), checks its form (hf_diloco.checks) and pushes (hf_diloco.hub)
    in its own process; it must stay light. So must the command line until it parses a recipe: `hf-diloco app`,
    `push` and `lighthouse` import no config (hf_diloco.recipes imports it when a recipe is parsed)."""
    import subprocess
    import sys

    code = ("import sys, hf_diloco.runs, hf_diloco.hub, hf_diloco.launch, hf_diloco.cli, app.forms, app.views, "
            "app.server; hf_diloco.cli.build_parser(); "
            "print(sorted({'torch', 'transformers', 'torchft'} & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert result.stdout.strip() == "[]", result.stderr


@pytest.mark.process
def test_a_run_does_not_see_the_servers_tokens_or_password(tmp_path, monkeypatch):
    """Only the push process gets a Hub token: a run started by the app inherits neither HF_TOKEN (nor its older
    names) nor the app's password, and huggingface_hub is told not to pick up a stored login."""
    for name in runs.SECRETS:
        monkeypatch.setenv(name, "secret-value-789")
    folder = tmp_path / "envcheck"
    script = ("import os, json; print(json.dumps({k: os.environ.get(k) for k in "
              f"{list(runs.SECRETS) + ['HF_HUB_DISABLE_IMPLICIT_TOKEN']!r}}}))")
    runs.start_planned(runs.Run("envcheck", RECIPE, "c.yaml", [], [sys.executable, "-c", script],
                                str(folder / "output")))
    wait_for(lambda: runs.load(folder).status == "finished", 60, "the run to end")
    seen = json.loads((folder / runs.LOG_FILE).read_text().strip().splitlines()[-1])
    assert seen == {**{name: None for name in runs.SECRETS}, "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1"}
    assert not any(b"secret-value-789" in p.read_bytes() for p in folder.rglob("*") if p.is_file())


def test_run_json_changes_from_two_writers_are_both_kept(tmp_path):
    """The app's Stop and the supervisor's end each change run.json; a read-modify-write holds the lock, so the
    second writer sees the first one's change instead of overwriting it."""
    import threading

    folder = tmp_path / "both"
    folder.mkdir()
    runs._write(folder, runs.Run("both", RECIPE, "c.yaml", [], ["true"], str(folder / "output"), status="running"))
    first_has_read, second_done = threading.Event(), threading.Event()

    def supervisor_end():
        first_has_read.wait()
        with runs._updating(folder) as run:  # waits for the app's update to be written
            run.exit_code, run.status = 0, "finished"
        second_done.set()

    writer = threading.Thread(target=supervisor_end)
    writer.start()
    with runs._updating(folder) as run:
        first_has_read.set()
        assert not second_done.wait(0.5), "the second writer must wait for the lock"
        run.stop_requested = 123.0
    writer.join(10)
    final = json.loads((folder / runs.RUN_FILE).read_text())
    assert final["stop_requested"] == 123.0 and final["exit_code"] == 0 and final["status"] == "finished"


TORCHFT_RECIPE = str(REPO / "recipes" / "torchft-3.yaml")
TORCHFT_REPLICA = str(REPO / "accelerate_configs" / "torchft-replica.yaml")
ELASTIC_SHORT = ["--max_steps", "4000", "--inner_steps", "10", "--block_size", "32", "--per_device_train_batch_size",
                 "4", "--eval_strategy", "no", "--disable_tqdm", "true", "--sync_timeout", "30"]


@pytest.mark.process
def test_a_stop_seen_by_one_torchft_replica_stops_every_replica_after_the_same_round(tmp_path, monkeypatch):
    """A torchft run (`hf-diloco launch --replicas 2`) is one run folder with a folder per replica; the launcher
    hands the run's stop request on to every replica folder, and each replica reads its own. The copy can land
    between two replicas' last checks of a round, so one of them sees it a round earlier: the request rides along
    with the round, and every replica of that round stops after it. Here only replica 0 is asked. Before, replica
    1 went on alone, waited for a round that never formed and failed."""
    for key, value in env().items():
        monkeypatch.setenv(key, value)
    run = runs.start(tmp_path, TORCHFT_RECIPE, TORCHFT_REPLICA, ELASTIC_SHORT, replicas=2)
    assert run.command[3:5] == ["launch", TORCHFT_RECIPE] and run.command[-2:] == ["--output_dir", run.output_dir]
    output = Path(run.output_dir)
    wait_for(lambda: all(read_syncs(output / f"replica-{r}") for r in (0, 1)), 120, "a round of both replicas")
    (output / "replica-0" / runs.STOP_FILE).write_text(f"{time.time()}\n")
    final = wait_for(lambda: (r := runs.load(run.folder)).status not in runs.ACTIVE and r, 90, "the run to end")
    assert final.status == "stopped", (run.folder / runs.LOG_FILE).read_text()[-3000:]
    stopped = [json.loads((output / f"replica-{r}" / runs.STOPPED_FILE).read_text())["step"] for r in (0, 1)]
    assert stopped[0] == stopped[1] < 4000 and stopped[0] % 10 == 0, stopped
    assert [read_syncs(output / f"replica-{r}")[-1]["step"] for r in (0, 1)] == stopped
    assert (output / runs.STOPPED_FILE).is_file(), "the launcher reports the stop in the run's own folder"
    assert runs.training_pids(final) == []

    # The model card of either replica counts the launch's replicas and rounds, as the app does, and says how the
    # run ended; `hf-diloco push` of the launch folder refuses the stopped run unless told to push it anyway.
    from hf_diloco import hub

    for folder in (output / "replica-0", output / "replica-1"):
        card = hub.model_card(folder, "alice/elastic")
        assert "2 replicas trained independently" in card
        assert f"| outer rounds | {stopped[0] // 10} |" in card, card
        assert f"**This run stopped on request at step {stopped[0]} of 4000" in card
    assert hub.repo_files(output)["model.safetensors"].parent.name.startswith("replica-")
    import subprocess

    refused = subprocess.run([sys.executable, "-m", "hf_diloco.cli", "push", str(output), "--repo-id", "alice/x"],
                             capture_output=True, text=True, cwd=REPO,
                             env={**env(), "HF_HUB_OFFLINE": "1", "HF_TOKEN": "hf_x"})
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert f"this run stopped on request at step {stopped[0]} of 4000" in refused.stderr
    assert "--allow-unfinished" in refused.stderr


@pytest.mark.process
def test_a_torchft_launch_whose_other_replica_finished_succeeds_though_one_replica_died_for_good(tmp_path):
    """Replica 1 fails twice (one restart allowed, then none left) while replica 0 finishes: the launch exits 0,
    since the run's rounds were committed by the replica that finished, and replicas.json tells each replica's
    story as it happened."""
    from hf_diloco.launch import ReplicaSupervisor

    finish = [sys.executable, "-c", SAVES_A_MODEL.format(folder=str(tmp_path / "replica-0"))]
    fail = [sys.executable, "-c", "raise SystemExit(3)"]
    assert ReplicaSupervisor([finish, fail], str(tmp_path), max_restarts=1).run() == 0
    states = json.loads((tmp_path / runs.REPLICAS_FILE).read_text())
    assert [(s["state"], s["restarts"], s["exit_code"]) for s in states] == [("finished", 0, 0), ("exited", 1, 3)]
    assert [o["restarted"] for o in states[1]["outages"]] == [True, False]
    # Every replica ends with the final model: the one that died for good gets the finished one's, and says so.
    assert states[1]["final_model_from"] == 0 and "final_model_from" not in states[0]
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "replica-1" / name).read_bytes() == (tmp_path / "replica-0" / name).read_bytes()
    assert not (tmp_path / "replica-1" / "syncs.jsonl").exists(), "its own records are not the finished one's"
    assert ReplicaSupervisor([fail, fail], str(tmp_path / "all"), max_restarts=0).run() == 3, "no replica finished"
    assert not (tmp_path / "all" / "replica-0").exists()


# A replica's stand-in that saves a model and its records, as a finished replica does.
SAVES_A_MODEL = ("import pathlib, time; f = pathlib.Path({folder!r}); f.mkdir(parents=True, exist_ok=True); "
                 "time.sleep(1); [(f / n).write_text(n + ' of the final model') for n in ('model.safetensors', "
                 "'config.json')]; (f / 'syncs.jsonl').write_text('')")


@pytest.mark.process
def test_a_replica_started_again_too_late_is_ended_and_given_the_final_model(tmp_path, capfd):
    """Replica 1 fails once and is started again; replica 0 finishes the run meanwhile, and the restarted replica,
    which finds no one left to form a round with, is ended once the linger time has passed. It did not save the
    final model: the launch copies replica 0's into its folder, says so, and its closing line says replica 1 ended
    late (not that it exited 0)."""
    from hf_diloco.launch import ReplicaSupervisor

    marker = tmp_path / "failed-once"
    finish = [sys.executable, "-c", SAVES_A_MODEL.format(folder=str(tmp_path / "replica-0"))]
    late = [sys.executable, "-c", f"import pathlib, sys, time; m = pathlib.Path({str(marker)!r}); "
                                  "(m.touch(), sys.exit(3)) if not m.exists() else time.sleep(120)"]
    started = time.monotonic()
    assert ReplicaSupervisor([finish, late], str(tmp_path), max_restarts=1, linger_seconds=1).run() == 0
    assert time.monotonic() - started < 60, "the latecomer was ended, not waited for"
    states = json.loads((tmp_path / runs.REPLICAS_FILE).read_text())
    assert [(s["state"], s["restarts"]) for s in states] == [("finished", 0), ("ended", 1)]
    assert states[1]["final_model_from"] == 0
    assert (tmp_path / "replica-1" / "model.safetensors").read_text() == "model.safetensors of the final model"
    out = capfd.readouterr().out
    assert "[diloco] replica 1 was started again too late to rejoin: the run had finished; ended it" in out
    assert (f"[diloco] replica 1 was started again too late to rejoin: it did not save the final model; copied "
            f"replica 0's into {tmp_path / 'replica-1'}") in out
    assert out.rstrip().endswith("replica 0 exit 0, replica 1 ended late"), out


def test_the_records_of_an_earlier_version_read_under_todays_names_and_a_resume_goes_on_in_syncs_jsonl(tmp_path):
    """A run folder written before the records were renamed holds sync_rounds.jsonl, whose rows per replica are
    `members`: it reads as a run with its `replicas` rows (not as a torchft launch of replica folders), and the
    writer of a run resumed in it carries the records over into syncs.jsonl, leaving one file."""
    from hf_diloco.metrics import SYNCS_FILE, SyncWriter, replica_folders, run_syncs

    rows = [{"replica": 0, "participated": True, "steps": 5}, {"replica": 1, "participated": False}]
    (tmp_path / "sync_rounds.jsonl").write_text("".join(json.dumps({"sync": n, "round": n, "step": 5 * n,
                                                                    "members": rows}) + "\n" for n in (1, 2)))
    (tmp_path / "replica-0").mkdir()  # a folder of that name alone does not make it a torchft launch's
    assert replica_folders(tmp_path) == []
    assert [(r["step"], r["replicas"], "members" in r) for r in run_syncs(tmp_path)] == [(5, rows, False),
                                                                                          (10, rows, False)]
    writer = SyncWriter(str(tmp_path))
    writer.write({"sync": 3, "round": 3, "step": 15, "replicas": rows})
    assert not (tmp_path / "sync_rounds.jsonl").exists()
    assert [json.loads(line)["step"] for line in (tmp_path / SYNCS_FILE).read_text().splitlines()] == [5, 10, 15]
    assert all("members" not in r and r["replicas"] == rows for r in read_syncs(tmp_path))


def test_a_line_torn_by_a_kill_hides_no_later_record_and_appends_start_on_a_line_of_their_own(tmp_path, caplog):
    """A replica killed mid-write leaves a torn line; the one restarted appends after it (SyncWriter, the Trainer
    log's writer). Every whole record before and after reads back, the torn line is reported once in a warning
    naming the file and its line, and a resume's rewrite keeps the whole records only."""
    from hf_diloco.files import append_jsonl
    from hf_diloco.metrics import SyncWriter

    writer = SyncWriter(str(tmp_path))
    for step in (5, 10):
        writer.write({"sync": step // 5, "step": step})
    with writer.path.open("a") as f:
        f.write('{"sync": 3, "st')  # killed here
    for step in (15, 20):  # the restarted replica's records
        writer.write({"sync": step // 5, "step": step})
    with caplog.at_level("WARNING"):
        first = read_syncs(tmp_path)
        again = read_syncs(tmp_path)
    assert [r["step"] for r in first] == [r["step"] for r in again] == [5, 10, 15, 20]
    warnings = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert warnings == [f"{writer.path}: line 3 is damaged (not a JSON object); it is skipped and the lines after "
                        "it are read."]
    assert [r["step"] for r in writer.truncate_after(15)] == [5, 10, 15]
    assert writer.path.read_text().count("\n") == 3 and not writer.path.with_name(writer.path.name + ".tmp").exists()
    log = tmp_path / runs.TRAINER_LOG_FILE
    log.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    append_jsonl(log, {"step": 3, "loss": 1.5})
    assert log.read_text().splitlines()[-1] == '{"step": 3, "loss": 1.5}'


def test_progress_json_is_rewritten_at_most_twice_a_second_and_its_first_step_at_once(tmp_path, monkeypatch):
    """RunRecorder (what the app's status bar reads): steps ending every 0.1 s of a clock the test moves, over 3 s,
    rewrite progress.json at step 1 and then only once 0.5 s have passed since the last write: 6 writes (steps 1,
    6, 11, 16, 21, 26), each holding the step that ended then."""
    from types import SimpleNamespace

    from hf_diloco import run_callbacks as callbacks

    now, written = [1000.0], []
    monkeypatch.setattr(callbacks.time, "time", lambda: now[0])
    monkeypatch.setattr(callbacks, "write_json", lambda path, data, **_: written.append((path.name, data["step"])))
    recorder = callbacks.RunRecorder(str(tmp_path))
    for step in range(1, 31):
        now[0] += 0.1
        recorder.on_step_end(None, SimpleNamespace(is_world_process_zero=True, global_step=step, max_steps=30), None)
    assert written == [(runs.PROGRESS_FILE, step) for step in (1, 6, 11, 16, 21, 26)]
