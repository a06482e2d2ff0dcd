"""What the app draws from a run folder: log tail, status bar, plot frames (pure functions, no server)."""

import json
import sys

from helpers import REPO

sys.path.insert(0, str(REPO))
from app import views  # noqa: E402
from hf_diloco.runs import Run  # noqa: E402


def make_run(tmp_path, status="running", rounds=()):
    (tmp_path / "output").mkdir()
    (tmp_path / "output" / "sync_rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    return Run("r1", str(REPO / "recipes" / "tiny-pretrain.yaml"), "c.yaml", ["--max_steps", "100"], ["x"],
               str(tmp_path / "output"), status=status)


def round_record(n, agreement=None):
    record = {"round": n, "step": 10 * n, "loss": 3.0 / n, "replica_losses": [3.1 / n, 2.9 / n],
              "pseudo_grad_norm": 0.5, "replica_pseudo_grad_norms": [0.6, 0.7], "bytes_per_replica": 2_000_000,
              "ddp_bytes_per_replica": 20_000_000, "sync_seconds": 0.1, "compute_seconds": 2.0,
              "tokens_per_second": 1000.0, "num_replicas": 2}
    if agreement:
        record.update(agreement_round=n - 1, replica_agreement=agreement)
    return record


def test_log_tail_keeps_complete_lines_and_the_last_state_of_progress_bars(tmp_path):
    run = make_run(tmp_path)
    (tmp_path / "run.log").write_text("start\n 50%|##   \x1b[A\r100%|####\x1b[A\nlast line\nhalf-writ")
    assert views.log_tail(run) == "start\n100%|####\nlast line"
    assert views.log_tail(run, lines=1) == "last line"


def test_status_bar_shows_state_progress_and_bytes(tmp_path):
    run = make_run(tmp_path, rounds=[round_record(1), round_record(2)])
    bar = views.status_html(run)
    assert "data-status='running'" in bar and "<progress value='20' max='100'>" in bar
    assert "sent 4.0 MB/replica" in bar and "2 replicas" in bar


def test_plot_frames_are_long_format_per_replica(tmp_path):
    rounds = [round_record(1), round_record(2, agreement=[0.9, 0.8])]
    losses = views.replica_loss_frame(rounds)
    assert set(losses["replica"]) == {"replica 0", "replica 1"} and len(losses) == 4
    traffic = views.bytes_frame(rounds)
    cumulative = traffic[traffic["traffic"] == "DiLoCo (cumulative)"]["MB"].tolist()
    ddp = traffic[traffic["traffic"] == "DDP for the same steps"]["MB"].tolist()
    assert cumulative == [2.0, 4.0] and ddp == [20.0, 40.0]
    agreement = views.agreement_frame(rounds)
    assert agreement["round"].tolist() == [1, 1] and agreement["cosine"].tolist() == [0.9, 0.8]
    assert views.round_rows(rounds)["round"].tolist() == [2, 1], "newest first"


def test_half_written_round_is_ignored(tmp_path):
    run = make_run(tmp_path, rounds=[round_record(1)])
    with open(tmp_path / "output" / "sync_rounds.jsonl", "a") as f:
        f.write('{"round": 2, "st')
    assert [r["round"] for r in views.read_rounds(run)] == [1]
