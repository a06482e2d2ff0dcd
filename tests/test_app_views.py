"""What the app draws from a run folder: log tail, status bar, plot frames (pure functions, no server)."""

import json
import re
import sys

import pytest
from helpers import REPO

sys.path.insert(0, str(REPO))
from app import views  # noqa: E402
from hf_diloco.runs import Run  # noqa: E402


def make_run(tmp_path, status="running", rounds=()):
    (tmp_path / "output").mkdir()
    (tmp_path / "output" / "syncs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    return Run("r1", str(REPO / "recipes" / "tiny-pretrain.yaml"), "c.yaml", ["--max_steps", "100"], ["x"],
               str(tmp_path / "output"), status=status)


def sync_record(n, agreement=None, fragments=1):
    """The record of sync `n` as a run writes it now: its round is ceil(n / fragments)."""
    record = {"sync": n, "round": -(-n // fragments), "step": 10 * n, "loss": 3.0 / n,
              "replica_losses": [3.1 / n, 2.9 / n], "pseudo_grad_norm": 0.5, "replica_pseudo_grad_norms": [0.6, 0.7],
              "bytes_per_replica": 2_000_000, "ddp_bytes_per_replica": 20_000_000, "sync_seconds": 0.1,
              "compute_seconds": 2.0, "tokens_per_second": 1000.0, "num_replicas": 2}
    if agreement:
        record.update(agreement_sync=n - 1, replica_agreement=agreement)
    return record


def written_before_syncs_were_named(record):
    """The same record as runs wrote it when `round` counted syncs and there was no `sync` key."""
    old = {k: v for k, v in record.items() if k not in ("sync", "agreement_sync")}
    old["round"] = record["sync"]
    if "agreement_sync" in record:
        old["agreement_round"] = record["agreement_sync"]
    return old


def test_log_tail_keeps_complete_lines_and_the_last_state_of_progress_bars(tmp_path):
    run = make_run(tmp_path)
    (tmp_path / "run.log").write_text("start\n 50%|##   \x1b[A\r100%|####\x1b[A\nlast line\nhalf-writ")
    assert views.log_tail(run) == "start\n100%|####\nlast line"
    assert views.log_tail(run, lines=1) == "last line"


def test_status_bar_shows_state_progress_and_bytes(tmp_path):
    run = make_run(tmp_path, rounds=[sync_record(1), sync_record(2)])
    bar = views.status_html(run)
    assert "data-status='running'" in bar and "<progress value='20' max='100'>" in bar
    assert "sent 4.0 MB/replica" in bar and "2 replicas" in bar


def test_plot_frames_are_long_format_per_replica(tmp_path):
    rounds = [sync_record(1), sync_record(2, agreement=[0.9, 0.8])]
    losses = views.loss_frame(rounds, [])
    assert set(losses["replica"]) == {"replica 0", "replica 1"} and len(losses) == 4
    traffic = views.bytes_rows(rounds)
    cumulative = traffic[traffic["traffic"] == "DiLoCo (cumulative)"]["MB"].tolist()
    ddp = traffic[traffic["traffic"] == "DDP for the same steps"]["MB"].tolist()
    assert cumulative == [2.0, 4.0] and ddp == [20.0, 40.0]
    agreement = views.agreement_frame(rounds)
    assert agreement["step"].tolist() == [10, 10] and agreement["cosine"].tolist() == [0.9, 0.8], "at round 1's step"
    assert views.round_rows(rounds)["round"].tolist() == [2, 1], "newest first"


def test_half_written_round_is_ignored(tmp_path):
    run = make_run(tmp_path, rounds=[sync_record(1)])
    with open(tmp_path / "output" / "syncs.jsonl", "a") as f:
        f.write('{"round": 2, "st')
    assert [r["round"] for r in views.read_rounds(run)] == [1]


def test_empty_plot_frames_are_typed_as_numbers():
    """The page types a plot once, from its first frame, which is empty for a fresh run: x and y must already
    be numbers there, or the page draws one tick per raw value and no line."""
    import pandas as pd

    for frame in (views.loss_frame([], []), views.norm_frame([]), views.agreement_frame([]), views.time_frame([])):
        x, y, series = frame.columns
        assert pd.api.types.is_numeric_dtype(frame[x]) and pd.api.types.is_numeric_dtype(frame[y])
        assert pd.api.types.is_string_dtype(frame[series])


def test_series_keep_their_colour_and_a_one_round_run_still_draws_a_line():
    one = views.loss_frame([sync_record(1)], [{"step": 0, "eval_loss": 5.0}, {"step": 10, "eval_loss": 3.0}])
    for replica in ("replica 0", "replica 1"):
        assert len(one[one["replica"] == replica]) == 2, "one round: a flat segment over its steps, not a dot"
    assert one[one["replica"] == "held-out (global model)"]["step"].tolist() == [0, 10]
    colors = views.colors(views.series_names(one, "replica"))
    assert colors["replica 1"] == views.PALETTE[1] and colors["held-out (global model)"] == "#111827"


def test_a_ddp_baseline_is_drawn_from_trainer_logs(tmp_path):
    run = make_run(tmp_path)
    run.recipe = str(REPO / "recipes" / "ddp-baseline.yaml")
    log = [{"step": 10, "loss": 4.0}, {"step": 20, "loss": 3.5}, {"step": 20, "eval_loss": 3.6}]
    (tmp_path / "output" / "trainer_log.jsonl").write_text("".join(json.dumps(e) + "\n" for e in log))
    (tmp_path / "output" / "progress.json").write_text(json.dumps({"phase": "training", "step": 23}))
    frame = views.loss_frame([], views.read_trainer_log(run))
    assert frame["loss"].tolist() == [4.0, 3.5, 3.6]
    bar = views.status_html(run)
    assert "step 23/100" in bar and "loss 3.5000" in bar and "no syncs" in bar
    figures = views.live_figures(run, [], views.read_trainer_log(run), {})
    assert any("no syncs" in a.text for a in figures["bytes"].layout.annotations)
    assert [trace.name for trace in figures["loss"].data] == ["held-out loss", "train loss (all processes)"]


def test_live_figures_are_plotly_with_fixed_colours_log_bytes_markers_and_blocked_time(tmp_path):
    """Every Live figure is a Plotly figure: bytes on a log axis, every series with markers (a one-point series
    shows), replica i in PALETTE[i] wherever it is drawn, the time bars compute and blocked time, and the loss the
    Trainer logs between rounds beside the per-round losses."""
    rounds = [sync_record(1), {**sync_record(2, agreement=[0.9, 0.8]), "blocked_seconds": 0.03}]
    run = make_run(tmp_path, rounds=rounds)
    log = [{"step": 5, "loss": 3.3}, {"step": 10, "loss": 3.0}, {"step": 15, "loss": 2.0}]
    figures = views.live_figures(run, views.read_rounds(run), log, {})
    assert figures["bytes"].layout.yaxis.type == "log"
    for name, figure in figures.items():
        assert figure.data, name
        assert all("markers" in trace.mode for trace in figure.data if trace.type == "scatter"), name
        for trace in figure.data:
            match = re.search(r"replica (\d+)$", trace.name)
            if match:
                assert (trace.line.color if trace.type == "scatter" else trace.marker.color) == \
                    views.PALETTE[int(match.group(1))], (name, trace.name)
    logged = next(t for t in figures["loss"].data if t.name == "logged loss (process 0)")
    assert list(logged.x) == [5, 10, 15] and list(logged.y) == [3.3, 3.0, 2.0]
    bars = {trace.name: list(trace.y) for trace in figures["time"].data}
    assert bars == {"compute": [2.0, 2.0], "blocked": [0.1, 0.03]}, "a round without blocked_seconds blocked all"
    one = views.series_figure(views.norm_frame([sync_record(1)]), "of", kind="points", title="", x_title="",
                              y_title="")
    assert all(len(trace.x) == 1 and trace.marker.size >= 5 for trace in one.data)


def test_status_bar_shows_phase_while_starting_and_a_failed_runs_reason(tmp_path):
    """Before the run has written anything it is "starting"; then the phase it records (hf_diloco.train writes
    "loading model and data" before building them)."""
    run = make_run(tmp_path)
    assert "<i class='hfd-phase'>starting</i>" in views.status_html(run)
    (tmp_path / "output" / "progress.json").write_text(json.dumps({"phase": "loading model and data", "step": 0}))
    assert "<i class='hfd-phase'>loading model and data</i>" in views.status_html(run)
    run.status, run.reason = "failed", "model path 'x' does not exist."
    bar = views.status_html(run)
    assert "data-status='failed'" in bar and "model path &#x27;x&#x27; does not exist." in bar


def test_card_preview_drops_front_matter_and_images():
    metadata, body = views.card_preview("---\ntags:\n- diloco\n---\n# Model\n\n![curve](training_curve.png)\ntext")
    assert metadata == "tags:\n- diloco" and body == "# Model\n\ntext"


def test_compressed_streamed_rounds_show_codec_ratio_fragments_and_waiting(tmp_path):
    """What Live shows for a slow-link run: the codec, how many times fewer bytes than fp32, the fragment each
    round synced and how long the inner loop waited for it."""
    rounds = []
    for n, fragment in ((1, 1), (2, 2)):
        record = sync_record(n)
        record.update(compression="int4+ef", compression_ratio=7.93, fragments=[fragment], sync_seconds=0.4,
                      blocked_seconds=0.02)
        rounds.append(record)
    table = views.round_rows(rounds)
    newest = table.iloc[0]
    assert (newest["fragments"], newest["compression"], newest["× fewer"]) == ("2", "int4+ef", 7.9)
    assert (newest["sync s"], newest["blocked s"]) == (0.4, 0.02)
    bar = views.status_html(make_run(tmp_path, rounds=rounds))
    assert "int4+ef (7.9× fewer bytes)" in bar and "waited for syncs 0.0 s" in bar


def test_the_agreement_plot_includes_the_last_round_from_the_summary(tmp_path):
    rounds = [sync_record(1), sync_record(2, agreement=[0.9, 0.8])]
    summary = {"last_sync_agreement": {"sync": 2, "replica_agreement": [0.7, 0.6]}}
    frame = views.agreement_frame(rounds, summary)
    assert frame["step"].tolist() == [10, 10, 20, 20] and frame["cosine"].tolist() == [0.9, 0.8, 0.7, 0.6]
    # A run written before syncs had their own name: the same points.
    old = views.agreement_frame([written_before_syncs_were_named(r) for r in rounds],
                                {"last_round_agreement": {"round": 2, "replica_agreement": [0.7, 0.6]}})
    assert old.equals(frame)
    run = make_run(tmp_path, rounds=rounds)
    (tmp_path / "output" / "diloco_summary.json").write_text(json.dumps(summary))
    assert views.read_summary(run) == summary


def member(replica, steps=10, healed=False, staleness=0, loss=3.0):
    return {"replica": replica, "participated": True, "steps": steps, "tokens": 128 * steps, "healed": healed,
            "staleness": staleness, "loss_sum": loss * steps}


def torchft_round(n, replicas, committed=True, writer=0):
    present = [m for m in replicas if m["participated"]]
    record = {**sync_record(n), "replicas": replicas, "participants": len(present), "committed": committed,
              "outer_backend": "torchft", "replica": writer, "num_replicas": len(present)}
    record["replica_losses"] = [m["loss_sum"] / m["steps"] for m in present if m["steps"]]
    return record


def write_replica(output, replica, rounds, step):
    folder = output / f"replica-{replica}"
    folder.mkdir(parents=True)
    (folder / "syncs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    (folder / "progress.json").write_text(json.dumps({"phase": "training", "step": step}))
    (folder / "trainer_log.jsonl").write_text(json.dumps({"step": step, "loss": 1.0 + replica}) + "\n")


def test_a_torchft_run_is_read_from_its_replica_folders(tmp_path):
    """`hf-diloco launch --replicas 3` leaves no syncs.jsonl in the run's output folder, only replica-r/
    folders, each with the rounds that replica took part in. Here replica 2 was started again (it lacks rounds 1
    and 2) and replica 0 recorded a round that did not commit after round 2 (the round number stays at the last
    committed round) and is behind. The app reads one record per round, from the lowest replica id that has it, a
    committed one first, and progress and the Trainer log from the replica furthest along (lowest id among
    equals)."""
    everyone = [member(0), member(1), member(2)]
    without_2 = [member(0), member(1), {"replica": 2, "participated": False}]
    output = tmp_path / "output"
    write_replica(output, 0, [torchft_round(1, everyone), torchft_round(2, without_2),
                              torchft_round(2, without_2, committed=False), torchft_round(3, everyone)], step=30)
    write_replica(output, 1, [torchft_round(n, m, writer=1) for n, m in
                              ((1, everyone), (2, without_2), (3, everyone), (4, everyone))], step=45)
    write_replica(output, 2, [torchft_round(3, everyone, writer=2), torchft_round(4, everyone, writer=2)], step=45)
    run = Run("ft", str(REPO / "recipes" / "torchft-3.yaml"), "c.yaml", ["--max_steps", "100"],
              ["python", "-m", "hf_diloco.cli", "launch", "torchft-3.yaml", "--replicas", "3"], str(output))
    rounds = views.read_rounds(run)
    assert [(r["round"], r["committed"], r["replica"]) for r in rounds] == [(1, True, 0), (2, True, 0),
                                                                            (3, True, 0), (4, True, 1)]
    assert views.read_progress(run)["step"] == 45 and views.lead_folder(run) == output / "replica-1"
    assert views.read_trainer_log(run) == [{"step": 45, "loss": 2.0}]
    assert views.replicas(run) == "3" and "step 45/100" in views.status_html(run)
    assert "3 of 3 replicas" in views.status_html(run)
    assert views.round_rows(rounds)["round"].tolist() == [4, 3, 2, 1]


def test_membership_rows_say_who_took_part_in_each_torchft_round():
    """One row per round, newest first; a cell per replica: its steps, healed (it took θ_global from a live peer),
    syncs late (its base was behind), or absent. A replica in no round yet still gets its column; a run of the
    torch backend has no membership rows."""
    rounds = [torchft_round(1, [member(0), member(1, steps=9)]),
              torchft_round(2, [member(0), {"replica": 1, "participated": False}], committed=False),
              torchft_round(3, [member(0), member(1, steps=0, healed=True)]),
              torchft_round(4, [member(0), member(1, steps=7, healed=True, staleness=1)])]
    table = views.membership_rows(rounds, replicas=3)
    assert list(table.columns) == ["round", "step", "participants", "committed", "replica 0", "replica 1",
                                   "replica 2"]
    assert table.values.tolist() == [
        [4, 40, 2, "yes", "✓ 10 steps", "✓ 7 steps, healed, 1 sync late", "absent"],
        [3, 30, 2, "yes", "✓ 10 steps", "healed", "absent"],
        [2, 20, 1, "no", "✓ 10 steps", "absent", "absent"],
        [1, 10, 2, "yes", "✓ 10 steps", "✓ 9 steps", "absent"],
    ]
    assert views.membership_rows([sync_record(1)]).empty


def test_a_replica_that_was_down_is_shown_down_from_the_sync_after_it_went_down_until_it_is_back():
    """replicas.json says replica 1 went down after sync 1 and was started again; it took part again in sync 4.
    Syncs 2 and 3 show it "down, restarting" (not merely absent); an older launch's replicas.json, which named
    the same number after_round, reads alike."""
    absent = {"replica": 1, "participated": False}
    rounds = [torchft_round(1, [member(0), member(1)]), torchft_round(2, [member(0), absent]),
              torchft_round(3, [member(0), absent]), torchft_round(4, [member(0), member(1, healed=True)])]
    for key in ("after_sync", "after_round"):
        states = [{"replica": 0, "outages": []}, {"replica": 1, "outages": [{key: 1, "restarted": True}]}]
        table = views.membership_rows(rounds, replicas=2, states=states)
        assert table["replica 1"].tolist() == ["✓ 10 steps, healed", "down, restarting", "down, restarting",
                                               "✓ 10 steps"], key


@pytest.mark.parametrize("committed", [False, True])
def test_a_replica_killed_inside_a_sync_is_shown_down_after_it_until_it_heals_back(committed):
    """Replica 1 took part in sync 1 and was killed inside sync 2, after its row reached replica 0: sync 2 lists it
    (and rolled back, or committed before replica 1 wrote it down). Its launcher saw sync 1 as its newest; syncs 3
    and 4, which replica 0 made alone, show it down, not absent, until it heals back in sync 5."""
    absent = {"replica": 1, "participated": False}
    rounds = [torchft_round(1, [member(0), member(1)]),
              torchft_round(2, [member(0), member(1)], committed=committed),
              torchft_round(3, [member(0), absent]), torchft_round(4, [member(0), absent]),
              torchft_round(5, [member(0), member(1, steps=0, healed=True)])]
    states = [{"replica": 0, "outages": []}, {"replica": 1, "outages": [{"after_sync": 1, "restarted": True}]}]
    table = views.membership_rows(rounds, replicas=2, states=states)
    assert table["replica 1"].tolist() == ["healed", "down, restarting", "down, restarting", "✓ 10 steps",
                                           "✓ 10 steps"]


def test_a_torchft_rounds_losses_are_named_by_their_replica():
    """A torchft round lists only its participants' losses: replica 2's loss is drawn as replica 2 even while
    replica 1 is absent."""
    rounds = [torchft_round(1, [member(0, loss=3.0), {"replica": 1, "participated": False}, member(2, loss=2.0)])]
    frame = views.loss_frame(rounds, [])
    assert sorted(set(zip(frame["replica"], frame["loss"], strict=True))) == [("replica 0", 3.0), ("replica 2", 2.0)]


def test_the_tensorboard_hint_shows_only_when_the_run_wrote_event_files(tmp_path):
    """report_to tensorboard leaves <output>/runs (a torchft run: replica-r/runs); without it there is no hint."""
    run = make_run(tmp_path)
    assert views.tensorboard_hint(run) == ""
    (tmp_path / "output" / "runs").mkdir()
    logdir = tmp_path / "output" / "runs"
    assert views.tensorboard_hint(run) == f"TensorBoard for this run: `tensorboard --logdir {logdir}`"


def test_streaming_counts_whole_rounds_and_the_round_table_names_the_fragments_synced(tmp_path):
    """F = 5 fragments over 2 rounds of H = 15 (the syncs a streaming run records: one fragment each, the last sync
    carrying all five): the status bar says round 2 of its 10 syncs, not round 10; a run without fragments shows no
    fragment ids at all."""
    synced = [[0], [1], [2], [3], [4], [0], [1], [2], [3], [0, 1, 2, 3, 4]]
    rounds = [{**sync_record(n + 1, fragments=5), "fragments": ids} for n, ids in enumerate(synced)]
    run = make_run(tmp_path, rounds=rounds)
    bar = views.status_html(run)
    assert "round 2 (10 syncs)" in bar, bar
    table = views.round_rows(views.read_rounds(run))
    assert table["fragments"].tolist() == ["all", "3", "2", "1", "0", "4", "3", "2", "1", "0"]
    assert table["round"].tolist() == [2] * 5 + [1] * 5, "newest first, five syncs a round"
    (tmp_path / "old").mkdir()
    old = make_run(tmp_path / "old", rounds=[written_before_syncs_were_named(r) for r in rounds])
    assert "round 2 (10 syncs)" in views.status_html(old), "older runs count whole rounds alike"
    assert views.round_rows([sync_record(1), sync_record(2)])["fragments"].tolist() == ["", ""]


def test_the_sync_table_shows_each_replicas_steps_and_tokens_where_they_differ():
    """Every record's replica rows hold each replica's steps and tokens since its last sync (both backends): the table's
    last two columns show them per replica where they differ (time-budget rounds; – for a replica absent from a
    torchft sync); rounds in which every replica took the same steps leave them blank."""
    timed = {**sync_record(1), "replicas": [member(0, steps=90), member(1, steps=22)]}
    torchft = torchft_round(2, [member(0, steps=14), {"replica": 1, "participated": False}, member(2, steps=5)])
    even = {**sync_record(3), "replicas": [member(0), member(1)]}
    table = views.round_rows([timed, torchft, even, sync_record(4)])
    assert table["steps per replica"].tolist() == ["", "", "14 · – · 5", "90 · 22"]
    assert table["tokens per replica"].tolist() == ["", "", "1.8k · – · 640", "11.5k · 2.8k"]  # 128 a step


def test_a_stopped_run_says_which_checkpoint_it_kept_and_how_to_resume(tmp_path):
    import shlex

    run = make_run(tmp_path, status="stopped", rounds=[sync_record(1), sync_record(2)])
    (tmp_path / "output" / "stopped.json").write_text(json.dumps({"step": 20, "checkpoint": "checkpoint-20"}))
    bar = views.status_html(run)
    resume = shlex.join([*run.command, "--resume_from_checkpoint", "latest"])
    assert f"stopped at step 20; checkpoint-20 kept in {run.output_dir}. To resume from it: {resume}" in bar


def test_a_damaged_json_file_is_named_in_the_status_bar_and_the_rest_still_draws(tmp_path):
    """An empty progress.json (a disk that filled up) leaves the rounds drawn and the bar names the file and what
    to do, once; nothing is deleted."""
    run = make_run(tmp_path, rounds=[sync_record(1), sync_record(2)])
    progress = tmp_path / "output" / "progress.json"
    progress.write_text("")
    bar = views.status_html(run)
    assert "sent 4.0 MB/replica" in bar, "the rounds are still read"
    assert bar.count(f"{progress} is empty; restore it from a copy") == 1, bar
    assert views.read_progress(run) == {} and progress.exists()


APART = ("apart: it agrees with the others far less than they with each other (leave-one-out agreement 0.05 against "
         "their median 0.60; the check leaves out a gap above 0.35 twice running, and keeps out until two syncs agree)")
OUTLIER = "outlier: its pseudo-gradient norm 9 is 7.5x the median replica's (1.2); the check leaves out above 2.3x"
SIZE = ("size: its pseudo-gradient norm 40 is 9.1x what 10 AdamW steps at the agreed learning rate 0.001 can make; "
        "the check leaves out above 2x: is its learning rate the others'?")


def left_out_member(replica, reason):
    """A member's row as a sync writes it when a contribution check leaves the replica out: it trained its steps,
    but took no part in the merge."""
    return {**member(replica), "participated": False, "weight": 0.0, "excluded": reason}


def checked(record, excluded=(), flagged=()):
    """`record` as written with contribution checks: `excluded` (mode exclude) or `flagged` (mode warn) name
    replicas with the sentence why."""
    record = {**record, "excluded": [{"replica": r, "reason": reason} for r, reason in excluded]}
    if flagged:
        record["flagged"] = [{"replica": r, "reason": reason} for r, reason in flagged]
    return record


def test_a_left_out_contribution_is_named_per_sync_for_both_backends_and_per_replica_for_torchft():
    """Sync 1 (torch backend) left replica 2 out by `outlier`, sync 2 (torchft) replica 2 by `apart`, sync 3 (mode
    warn) only flagged replica 1 by `size` and merged it, sync 4 was written before the checks. The sync table's
    "left out" column names each replica with its rule, "flagged" for a warning, nothing for sync 4; the
    membership table (torchft) shows the left-out replica's cell as excluded by its rule, not absent."""
    torch = checked({**sync_record(1), "num_replicas": 3,
                     "replicas": [member(0), member(1), left_out_member(2, OUTLIER)]}, excluded=[(2, OUTLIER)])
    torchft = checked(torchft_round(2, [member(0), member(1), left_out_member(2, APART)]), excluded=[(2, APART)])
    warned = checked({**sync_record(3), "replicas": [member(0), member(1), member(2)]}, flagged=[(1, SIZE)])
    rounds = [torch, torchft, warned, sync_record(4)]
    table = views.round_rows(rounds)
    assert table.columns[-1] == "left out"
    assert table["left out"].tolist() == ["", "replica 1 (size, flagged)", "replica 2 (apart)", "replica 2 (outlier)"]
    assert table["steps per replica"].tolist() == ["", "", "10 · 10 · –", "10 · 10 · –"], "left out: no steps merged"
    membership = views.membership_rows(rounds, replicas=3)
    assert membership.values.tolist() == [[2, 20, 2, "yes", "✓ 10 steps", "✓ 10 steps", "excluded (apart)"]]
    both = checked(sync_record(5), excluded=[(0, SIZE), (2, OUTLIER)])
    assert views.left_out(both) == "replica 0 (size), replica 2 (outlier)"


def test_a_replica_left_out_in_the_sync_it_came_back_is_no_longer_shown_down():
    """Replica 1 went down after sync 1; in sync 2 it was back in the quorum but a check left it out, in sync 3 it
    was late: sync 2 shows it excluded and sync 3 absent, not "down, restarting"."""
    rounds = [torchft_round(1, [member(0), member(1)]),
              torchft_round(2, [member(0), left_out_member(1, SIZE)]),
              torchft_round(3, [member(0), {"replica": 1, "participated": False}])]
    states = [{"replica": 0, "outages": []}, {"replica": 1, "outages": [{"after_sync": 1, "restarted": True}]}]
    table = views.membership_rows(rounds, replicas=2, states=states)
    assert table["replica 1"].tolist() == ["absent", "excluded (size)", "✓ 10 steps"]


def test_the_status_bar_and_compare_table_count_the_contributions_left_out(tmp_path):
    """Three contributions left out over two syncs: the status bar and the Compare table count 3. A run whose
    checks left nothing out counts 0 in the table and says nothing in the bar; a run written before the checks
    leaves the table's cell empty."""
    import pandas as pd

    runs = {}
    for name, rounds in (("three", [checked(sync_record(1), excluded=[(1, SIZE)]),
                                    checked(sync_record(2), excluded=[(0, OUTLIER), (2, APART)])]),
                         ("none", [checked(sync_record(1)), checked(sync_record(2), flagged=[(1, SIZE)])]),
                         ("old", [sync_record(1), sync_record(2)])):
        (tmp_path / name).mkdir()
        runs[name] = make_run(tmp_path / name, rounds=rounds)
    assert "waited for syncs 0.2 s · 3 contributions left out" in views.status_html(runs["three"])
    assert "left out" not in views.status_html(runs["none"]) and "left out" not in views.status_html(runs["old"])
    table = views.compare_rows(list(runs.values()))
    assert table.columns[-1] == "contributions left out"
    counted = table["contributions left out"].tolist()
    assert counted[:2] == [3, 0] and pd.isna(counted[2]), counted


def test_every_folder_a_run_wrote_is_a_run_of_the_app_whoever_started_it(tmp_path):
    """Under the runs folder: a run trained here by `hf_diloco.train.train` (what `hf-diloco train` calls, no app),
    folders left by runs that stopped, still train, ended early or whose every replica failed, a run the app
    started (run.json), and the app's drafts folder. Every run folder is listed with what its files say (name,
    status, trainer, H, replicas, step); the drafts folder is not a run; the app's Stop refuses a run it did not
    start in one sentence saying how to stop it, and its Stop button stays off."""
    import os
    import time

    from app.server import App
    from hf_diloco import DiLoCoConfig, RunArguments, runs
    from hf_diloco.train import train as train_run

    runs_dir = tmp_path / "runs"
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": f"document {i}: " + "some words " * 10}) for i in range(60)))
    train_run(RunArguments(dataset_name=str(corpus), block_size=32),
              DiLoCoConfig(output_dir=str(runs_dir / "from-python"), inner_steps=2, max_steps=4,
                           per_device_train_batch_size=4, eval_strategy="no", save_strategy="no", report_to="none",
                           disable_tqdm=True, use_cpu=True))

    def progress(name, step, phase="training", age=0.0, **files):
        folder = runs_dir / name
        folder.mkdir(parents=True)
        (folder / runs.PROGRESS_FILE).write_text(json.dumps({"phase": phase, "step": step, "max_steps": 100}))
        for file, value in files.items():
            (folder / file).write_text(json.dumps(value))
        for path in folder.iterdir():
            os.utime(path, (time.time() - age,) * 2)

    progress("stopped-one", 40, **{runs.STOPPED_FILE: {"step": 40, "checkpoint": "checkpoint-40"}})
    progress("still-training", 30)
    progress("ended-early", 20, age=3600)
    (runs_dir / "torchft-failed" / "replica-0").mkdir(parents=True)
    (runs_dir / "torchft-failed" / "replica-0" / "syncs.jsonl").write_text(json.dumps(sync_record(1)) + "\n")
    (runs_dir / "torchft-failed" / runs.REPLICAS_FILE).write_text(json.dumps([{"replica": 0, "exit_code": 1}]))
    os.utime(runs_dir / "torchft-failed" / "replica-0" / "syncs.jsonl", (time.time() - 3600,) * 2)
    (runs_dir / "drafts").mkdir()
    (runs_dir / "drafts" / "draft-1.yaml").write_text("max_steps: 5\n")
    started = runs.plan(runs_dir, str(REPO / "recipes" / "tiny-pretrain.yaml"), "c.yaml", [], name="by-the-app")
    started.folder.mkdir(parents=True)
    runs._write(started.folder, started)

    listed = {run.id: run for run in runs.list_runs(runs_dir)}
    assert sorted(listed) == ["by-the-app", "ended-early", "from-python", "still-training", "stopped-one",
                              "torchft-failed"]
    assert {name: run.status for name, run in listed.items() if run.found} == {
        "from-python": "finished", "stopped-one": "stopped", "still-training": "running", "ended-early": "unfinished",
        "torchft-failed": "failed"}
    assert not listed["by-the-app"].found
    table = views.runs_table([listed["from-python"]])
    assert table.iloc[0][["run", "status", "trainer", "H", "replicas", "step"]].tolist() == \
        ["from-python", "finished", "diloco", "2", "1", 4]
    assert "round 2 " in views.status_html(listed["from-python"]) + " "
    app = App(runs_dir)
    assert app.run("from-python").output_dir == str(runs_dir / "from-python")
    refusal = app.stop("still-training")
    assert refusal.startswith("**still-training** was not started from the app") and runs.STOP_FILE in refusal
    assert not (runs_dir / "still-training" / runs.STOP_FILE).exists()
    assert app.refresh("still-training", None)[12]["interactive"] is False, "no Stop for a run it did not start"
    compared = app.compare(["from-python", "stopped-one"])[1]
    assert compared.iloc[0]["run"] == "from-python" and compared.iloc[0]["H"] == "2", compared
    card = app.card("from-python", "alice/found")[0]
    assert "## DiLoCo settings" in card, "the push tab's card preview is written from the found run's folder"
