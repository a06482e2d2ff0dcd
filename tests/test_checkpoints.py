"""Which `checkpoint-<step>` folders are complete, which one a resume takes, which ones rotation keeps; and the
best checkpoint of a run that got worse late survives `save_total_limit` and is the model loaded at the end.

Folders here are built by hand (a few small files), so each rule is checked on exactly the case it is for; the
last test is a real 2-process run of `hf-diloco train`.
"""

import json
from pathlib import Path

import pytest
import torch
from helpers import REPO, accelerate_launch, pattern_dataset, tiny_llama
from safetensors.torch import load_file
from transformers import default_data_collator

from hf_diloco import DiLoCoConfig, DiLoCoTrainer, checkpoints
from hf_diloco.metrics import read_syncs

RECIPE = str(REPO / "recipes" / "tiny-pretrain.yaml")


def written(run_dir: Path, step: int, replicas: int = 2) -> Path:
    """A checkpoint as this version leaves it before the marker: the note, Trainer's files, each replica's part."""
    folder = run_dir / f"checkpoint-{step}"
    checkpoints.begin(folder)
    for name in ("model.safetensors", "trainer_state.json", "diloco_outer.pt"):
        (folder / name).write_text(f"{name} of step {step}")
    for rank in range(replicas):
        part = folder / f"process-{rank}"
        part.mkdir()
        (part / "optimizer.pt").write_text(f"optimizer of replica {rank}")
        checkpoints.finish_part(part)
    return folder


def complete(run_dir: Path, step: int) -> Path:
    folder = written(run_dir, step)
    checkpoints.mark_complete(folder, step, processes=2)
    return folder


def earlier_version(run_dir: Path, step: int) -> Path:
    """A checkpoint written before the marker existed: no note and no marker, every part marked."""
    folder = complete(run_dir, step)
    (folder / checkpoints.MARKER_FILE).unlink()
    for part in folder.glob("process-*"):  # earlier versions named a process's part replica-<rank>
        part.rename(folder / part.name.replace("process-", "replica-"))
    return folder


def test_a_checkpoint_is_complete_only_with_its_marker_and_every_file_it_lists(tmp_path):
    """The marker is written last; a folder whose save was cut short has none, and a folder that lost a file after
    it was marked (a deletion that is not ours, stopped midway, in any order) no longer matches its list."""
    unfinished = written(tmp_path, 10)
    assert not checkpoints.is_complete(unfinished), "all parts written but no marker yet: not complete"
    marked = complete(tmp_path, 20)
    assert checkpoints.is_complete(marked)
    assert not (marked / checkpoints.SAVING_FILE).exists(), "the note goes once the marker is there"
    listed = json.loads((marked / checkpoints.MARKER_FILE).read_text())
    assert listed["step"] == 20 and listed["processes"] == 2
    assert set(listed["files"]) == {"model.safetensors", "trainer_state.json", "diloco_outer.pt",
                                    "process-0/optimizer.pt", "process-0/complete", "process-1/optimizer.pt",
                                    "process-1/complete"}

    (marked / "process-1" / "optimizer.pt").unlink()
    assert not checkpoints.is_complete(marked), "a listed file is missing"
    truncated = complete(tmp_path, 30)
    (truncated / "model.safetensors").write_text("cut")
    assert not checkpoints.is_complete(truncated), "a listed file has another size"
    cut_marker = complete(tmp_path, 40)
    text = (cut_marker / checkpoints.MARKER_FILE).read_text()
    (cut_marker / checkpoints.MARKER_FILE).write_text(text[: len(text) // 2])
    assert not checkpoints.is_complete(cut_marker), "a marker cut short by a kill does not parse"


def test_every_file_and_folder_is_on_disk_before_the_marker_is_written(tmp_path, monkeypatch):
    """After a power loss a file the kernel had not written yet can come back zero-filled at its full size: the
    marker's size check would take it for whole. So every file the marker lists, and every folder, is fsynced
    before the marker exists, and the marker and the folder after."""
    import os

    folder = written(tmp_path, 10)
    synced: list[tuple[str, bool]] = []  # (path fsynced, whether the marker existed then)
    real_fsync, opened = os.fsync, {}
    real_open = os.open

    def recording_open(path, flags, *args, **kwargs):
        descriptor = real_open(path, flags, *args, **kwargs)
        opened[descriptor] = Path(path)
        return descriptor

    def recording_fsync(descriptor):
        synced.append((opened[descriptor].relative_to(folder).as_posix(),
                       (folder / checkpoints.MARKER_FILE).exists()))
        return real_fsync(descriptor)

    monkeypatch.setattr(os, "open", recording_open)
    monkeypatch.setattr(os, "fsync", recording_fsync)
    checkpoints.mark_complete(folder, 10, processes=2)
    listed = json.loads((folder / checkpoints.MARKER_FILE).read_text())["files"]
    before = {path for path, marker in synced if not marker}
    assert set(listed) | {"process-0", "process-1", "."} <= before, (listed, synced)
    assert (checkpoints.MARKER_FILE, True) in synced and synced[-1] == (".", True), synced


def test_the_marker_is_written_in_the_background_once_every_part_is_there_one_checkpoint_at_a_time(tmp_path, capsys):
    """checkpoints.Marking: `start` returns while the other processes' parts are still missing, and the marker
    (then the rotation) follows once they are there; the next checkpoint's start first waits for the one before,
    so markers and rotations keep their order; parts that never come leave the folder incomplete, said in a line."""
    import threading

    arrived = threading.Event()
    marking = checkpoints.Marking()
    first = written(tmp_path, 5)
    rotated = []
    marking.start(first, 5, 2, lambda: arrived.wait(10), lambda: rotated.append(checkpoints.is_complete(first)))
    assert not checkpoints.is_complete(first) and not rotated  # the saver trains on meanwhile
    arrived.set()
    second = written(tmp_path, 10)
    marking.start(second, 10, 2, lambda: True, lambda: rotated.append(10))
    assert checkpoints.is_complete(first) and rotated[0] is True  # the first was marked before the second began
    marking.join()
    assert checkpoints.is_complete(second) and rotated == [True, 10]
    never = written(tmp_path, 15)
    marking.start(never, 15, 2, lambda: False, lambda: rotated.append(15))
    marking.join()
    assert not checkpoints.is_complete(never) and rotated == [True, 10]
    assert "checkpoint-15 stays incomplete: not every process wrote its part in time" in capsys.readouterr().out


def test_each_training_of_a_launch_keeps_its_own_keys_in_the_rendezvous_store():
    """The store outlives a training: a second Trainer in the same processes, or a second `train()`, must not find
    the parts of a checkpoint of the same step already marked written by the training before. Each Rendezvous (one
    per Trainer) and each `train()` after its first puts its keys under a number of its own, counted alike by every
    process. (tests/scripts/replica_run.py trains several runs in one launch, checkpoints of equal steps included.)"""
    from hf_diloco.comm import Rendezvous, Topology

    first, second = Rendezvous(Topology()), Rendezvous(Topology())
    assert first.key("checkpoint-5/0") != second.key("checkpoint-5/0")
    before = second.key("checkpoint-5/0")
    second.begin_training()
    assert second.key("checkpoint-5/0") == before, "the first train() keeps the keys set up before it"
    second.begin_training()
    again = second.key("checkpoint-5/0")
    assert again != before and again != first.key("checkpoint-5/0")
    assert again.endswith("/checkpoint-5/0") and again.startswith("hf_diloco/")


def test_an_earlier_versions_part_folder_is_read_where_it_is(tmp_path):
    """Checkpoints of earlier versions keep each process's part in replica-<rank>/; a resume finds it there."""
    old = earlier_version(tmp_path, 10)
    assert checkpoints.part_dir(old, 1) == old / "replica-1"
    assert checkpoints.part_dir(complete(tmp_path, 20), 1) == tmp_path / "checkpoint-20" / "process-1"


def test_folders_of_earlier_versions_and_of_plain_trainer_count_as_complete(tmp_path):
    """Existing run folders still resume: without a marker, trainer_state.json plus every replica's `complete` part
    marker is complete (earlier versions renamed a checkpoint into place only when whole), and so is plain
    Trainer's checkpoint (no replica parts; trainer_state.json is the last file it writes). A folder this version
    began (its note is there) never passes that test, even with trainer_state.json and every part it holds marked:
    another replica's part may still be on its way."""
    old = earlier_version(tmp_path, 10)
    assert checkpoints.is_complete(old)
    plain = tmp_path / "checkpoint-20"
    plain.mkdir()
    (plain / "trainer_state.json").write_text("{}")
    assert checkpoints.is_complete(plain)

    (old / "replica-1" / "complete").unlink()
    assert not checkpoints.is_complete(old), "an earlier version's folder with a part unmarked"
    (plain / "trainer_state.json").unlink()
    (plain / "model.safetensors").write_text("weights")
    assert not checkpoints.is_complete(plain), "plain Trainer's folder without trainer_state.json"
    begun = written(tmp_path, 30, replicas=1)
    assert (begun / "trainer_state.json").is_file() and not checkpoints.is_complete(begun)


def test_resume_takes_the_newest_complete_checkpoint_and_clears_the_rest(tmp_path):
    complete(tmp_path, 10)
    earlier_version(tmp_path, 20)
    written(tmp_path, 30)
    (tmp_path / "tmp-checkpoint-40").mkdir()  # an earlier version's save that did not finish
    (tmp_path / "checkpoint-notes").mkdir()  # not a checkpoint name: left alone
    assert checkpoints.newest_complete(tmp_path) == tmp_path / "checkpoint-20"
    assert [p.name for p in checkpoints.leftovers(tmp_path)] == ["checkpoint-30", "tmp-checkpoint-40"]
    for leftover in checkpoints.leftovers(tmp_path):
        checkpoints.remove(leftover)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-10", "checkpoint-20", "checkpoint-notes"]
    assert checkpoints.newest_complete(tmp_path / "nothing-here") is None


def test_rotation_keeps_the_newest_complete_checkpoints_and_the_best(tmp_path):
    """save_total_limit 2: the newest two complete checkpoints and the best stay; a newer folder without its marker
    neither counts among the two nor is removed by rotation (resume removes it)."""
    for step in (10, 20, 30, 40):
        complete(tmp_path, step)
    written(tmp_path, 50)
    removed = checkpoints.rotate(tmp_path, 2, best=str(tmp_path / "checkpoint-10"))
    assert [p.name for p in removed] == ["checkpoint-20"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint-10", "checkpoint-30", "checkpoint-40", "checkpoint-50"]
    assert checkpoints.rotate(tmp_path, 0) == [] and checkpoints.rotate(tmp_path, 5) == []
    assert [p.name for p in checkpoints.rotate(tmp_path, 1)] == ["checkpoint-10", "checkpoint-30"]


def test_a_new_save_of_a_step_first_removes_the_folder_an_earlier_attempt_left(tmp_path):
    """A run resumed from an older checkpoint saves a step again: the old folder leaves its name (and its marker
    with it) before anything is written, so no instant shows the old marker over a mix of two saves."""
    old = complete(tmp_path, 10)
    checkpoints.begin(old)
    assert sorted(p.name for p in old.iterdir()) == [checkpoints.SAVING_FILE]
    assert not checkpoints.is_complete(old)


def trainer_run(trainer_cls, args_cls, run_dir: Path, **settings):
    args = args_cls(output_dir=str(run_dir), max_steps=5, save_strategy="steps", save_steps=5, save_total_limit=2,
                    per_device_train_batch_size=4, report_to="none", disable_tqdm=True, use_cpu=True, **settings)
    trainer_cls(model=tiny_llama(), args=args, train_dataset=pattern_dataset(),
                data_collator=default_data_collator).train()


def test_trainer_rotates_by_complete_checkpoints_only(tmp_path):
    """Trainer would rotate inside `_save_checkpoint`, before the marker, counting unfinished folders (tests/
    test_compat.py checks that it still does); DiLoCoTrainer keeps it from rotating there and rotates by complete
    checkpoints once the new one is whole: the unfinished checkpoint-2 neither counts nor costs the complete
    checkpoint-1 its place. Checkpoint folders keep Trainer's names."""
    from transformers.trainer import TRAINER_STATE_NAME
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    assert checkpoints.CHECKPOINT_PREFIX == f"{PREFIX_CHECKPOINT_DIR}-"
    assert checkpoints.TRAINER_STATE_FILE == TRAINER_STATE_NAME

    complete(tmp_path, 1)
    written(tmp_path, 2)
    args = DiLoCoConfig(output_dir=str(tmp_path), max_steps=5, inner_steps=5, save_strategy="steps", save_steps=5,
                        save_total_limit=2, per_device_train_batch_size=4, report_to="none", disable_tqdm=True,
                        use_cpu=True)
    DiLoCoTrainer(model=tiny_llama(), args=args, train_dataset=pattern_dataset(),
                  data_collator=default_data_collator).train()
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2", "checkpoint-5"]
    assert checkpoints.is_complete(tmp_path / "checkpoint-5")
    assert [p.name for p in checkpoints.complete_checkpoints(tmp_path)] == ["checkpoint-1", "checkpoint-5"]


@pytest.fixture
def worse_late_run(tmp_path):
    """2 replicas, 6 rounds of 10 steps, evaluated and saved every round, save_total_limit 2, load the best model at
    the end. The inner learning rate ramps up to 1.0 over the whole run (warmup of 60 steps): the first rounds
    learn, the later ones diverge, so the best round is an early one."""
    out = tmp_path / "run"
    result = accelerate_launch(["-m", "hf_diloco.cli", "train", "--config", RECIPE, "--output_dir", str(out),
                                "--max_steps", "60", "--inner_steps", "10", "--block_size", "64",
                                "--per_device_train_batch_size", "2", "--eval_fraction", "0.01",
                                "--eval_strategy", "steps", "--eval_steps", "10", "--eval_on_start", "false",
                                "--save_strategy", "steps", "--save_steps", "10", "--save_every_rounds", "1",
                                "--save_total_limit", "2", "--load_best_model_at_end", "true",
                                "--metric_for_best_model", "eval_loss", "--learning_rate", "1.0",
                                "--lr_scheduler_type", "constant_with_warmup", "--warmup_steps", "60",
                                "--logging_steps", "1000", "--disable_tqdm", "true"])
    assert result.returncode == 0, f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return out


@pytest.mark.process
def test_the_best_checkpoint_survives_rotation_and_is_the_model_loaded_at_the_end(worse_late_run):
    out = worse_late_run
    eval_loss = {r["step"]: r["eval_loss"] for r in read_syncs(out)}
    assert sorted(eval_loss) == [10, 20, 30, 40, 50, 60]
    best = min(eval_loss, key=eval_loss.get)
    assert best < 50, f"the run must be best before its newest two checkpoints for this test to mean anything: " \
                      f"{eval_loss}"

    names = sorted(p.name for p in out.glob("checkpoint-*"))
    assert names == sorted([f"checkpoint-{best}", "checkpoint-50", "checkpoint-60"])
    assert all(checkpoints.is_complete(out / name) for name in names)
    assert not list(out.glob("tmp-checkpoint-*"))
    state = json.loads((out / "checkpoint-60" / "trainer_state.json").read_text())
    assert Path(state["best_model_checkpoint"]) == out / f"checkpoint-{best}"
    assert state["best_metric"] == pytest.approx(eval_loss[best])

    final = load_file(out / "model.safetensors")
    saved_best, last = load_file(out / f"checkpoint-{best}" / "model.safetensors"), load_file(
        out / "checkpoint-60" / "model.safetensors")
    assert final.keys() == saved_best.keys()
    assert all(torch.equal(final[name], saved_best[name]) for name in final), "the final model is the best one"
    assert not all(torch.equal(final[name], last[name]) for name in final), "and not simply the last one"

