"""outer_backend torchft: replicas that come, go and lag. Real processes: a Lighthouse (`hf-diloco lighthouse`) and
one process per replica, talking over torchft's gloo process group on this machine."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    ACCELERATE_CPU_2PROC,
    ACCELERATE_CPU_4PROC,
    REPO,
    ListenerWatch,
    accelerate_launch,
    cli,
    env,
    free_port,
    lighthouse,
    replica_training_pid,
    wait_for,
)

from hf_diloco.contributions import CHECK_FIELDS
from hf_diloco.metrics import read_syncs
from hf_diloco.torchft_backend import MEMBER_FIELDS

TORCHFT_RUN = str(REPO / "tests" / "scripts" / "torchft_run.py")


def start_replica(settings: dict | list[dict], log: Path) -> subprocess.Popen:
    """One torchft replica: a process, or with "group": 2 an `accelerate launch` of two processes; given a list of
    settings, it trains each run in turn (tests/scripts/torchft_run.py)."""
    launcher = [sys.executable]
    if (settings[0] if isinstance(settings, list) else settings).get("group", 1) > 1:
        launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                    str(REPO / "accelerate_configs" / "torchft-replica-2proc.yaml"),
                    "--main_process_port", str(free_port())]
    return subprocess.Popen([*launcher, TORCHFT_RUN, json.dumps(settings)], stdout=log.open("a"),
                            stderr=subprocess.STDOUT, env=env(), cwd=REPO)


def finish(processes: list[subprocess.Popen], logs: list[Path], timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    for process, log in zip(processes, logs, strict=True):
        try:
            code = process.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in processes:
                p.kill()
            raise AssertionError(f"a replica did not finish in {timeout:.0f} s:\n{log.read_text()[-3000:]}") from None
        assert code == 0, log.read_text()[-4000:]


def max_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def step_of(folder: Path, replica: int) -> int:
    with contextlib.suppress(OSError, ValueError):
        return int((folder / f"step{replica}.txt").read_text())
    return 0


def committed(folder: Path) -> list[dict]:
    return [r for r in read_syncs(folder) if r["committed"]]


def takes_part(record: dict, replica: int) -> bool:
    """Whether `replica` took part in the round of this record (its membership table, not the count)."""
    return any(m["replica"] == replica and m.get("participated", True) for m in record["replicas"])


def held_until_2_restarts(folder: Path, replica: int, step: int = 60) -> dict:
    """Settings that hold replicas 0 and 1 after global step `step` until a restarted replica 2 begins training
    (`restarted_2` is what that restart adds), so that, however slowly it starts, it finds them still running
    (torchft_run.py's "hold" and "announce")."""
    return {} if replica == 2 else {"hold": [step, str(folder / "replica-2-is-back")]}


def restarted_2(folder: Path) -> dict:
    return {"announce": str(folder / "replica-2-is-back")}


def run_torch_backend(out: Path, round_settings: dict, max_steps: int = 12, inner_steps: int = 4, group: int = 1,
                      **extra) -> dict:
    """Two replicas of `group` processes as one `torch` launch into `out`; returns {replica: final parameters}."""
    out.mkdir()
    # torchft's last round syncs every fragment (final_sync auto is blocking there): the torch run ends alike.
    settings = {"max_steps": max_steps, "inner_steps": inner_steps, "group": group, **extra,
                "round": {**round_settings, "final_sync": "blocking"}}
    result = accelerate_launch([TORCHFT_RUN, json.dumps({"out": str(out), "backend": "torch", **settings})],
                               config=ACCELERATE_CPU_4PROC if group == 2 else ACCELERATE_CPU_2PROC)
    assert result.returncode == 0, result.stderr[-4000:]
    return {r: torch.load(out / f"params{r * group}.pt") for r in range(2)}


def run_torchft(out: Path, round_settings: dict, max_steps: int = 12, inner_steps: int = 4, group: int = 1,
                **extra) -> dict:
    """The same two replicas as run_torch_backend, as two torchft replicas with a Lighthouse, into `out`; returns
    {replica: final parameters}."""
    out.mkdir()
    common = {"max_steps": max_steps, "inner_steps": inner_steps, "round": round_settings, "group": group, **extra}
    with lighthouse(min_replicas=2, grace=5) as address:
        logs = [out / f"replica{r}.log" for r in range(2)]
        replicas = [start_replica({"out": str(out), "replica": r, "replicas": 2, "lighthouse": address,
                                   "min_replicas": 2, **common}, logs[r]) for r in range(2)]
        finish(replicas, logs)
    return {r: torch.load(out / f"params{r}.pt") for r in range(2)}


def run_both_backends(tmp_path: Path, round_settings: dict, **settings):
    """The same two replicas on the same data, once as one `torch` launch (tmp_path/torch) and once as two
    torchft replicas with a Lighthouse (tmp_path/torchft); returns ({replica: final parameters} for torch, the same
    for torchft)."""
    return (run_torch_backend(tmp_path / "torch", round_settings, **settings),
            run_torchft(tmp_path / "torchft", round_settings, **settings))


@pytest.mark.process
@pytest.mark.parametrize("backend,told", [("torch", "nan"), ("torch", 1e9), ("torch", -0.999), ("torchft", "nan")])
def test_a_replica_that_lies_in_a_sync_costs_that_sync_only(tmp_path, backend, told):
    """Replica 1 lies in the second of three syncs (H = 4, 12 steps): it reports finite values and sends a NaN, or
    reports a merge weight no honest replica has (1e9; −0.999, which would leave the divisor 0.001). Every replica
    refuses that sync, naming why in its record: θ_global after it is θ_global after the first, bit for bit, on
    every process; the replicas keep their own progress, and the third sync, honest, merges both and moves θ_global
    to finite values, where the run ends, identical on both replicas."""
    settings = {"globals": True, "lie": [1, 2, told]}
    if backend == "torch":
        final, folder = run_torch_backend(tmp_path / "run", {}, **settings), tmp_path / "run" / "run"
    else:
        final, folder = run_torchft(tmp_path / "run", {}, **settings), tmp_path / "run" / "replica-0"
    records = read_syncs(folder)
    assert [r["step"] for r in records] == [4, 8, 12], records
    second = records[1]
    why = "is not finite" if told == "nan" else f"replica 1 ({told:g})"
    assert second["outer_step_skipped"] and any(why in reason for reason in second["refused"]), second
    assert not records[0].get("refused") and not records[2].get("refused")
    for process in range(2):  # (the process on torch, the replica on torchft)
        after = {step: torch.load(tmp_path / "run" / f"global{process}-{step}.pt") for step in (4, 8, 12)}
        assert max_difference(after[4], after[8]) == 0.0, "the refused sync left θ_global as it was"
        assert max_difference(after[8], after[12]) > 0.0 and all(bool(torch.isfinite(p).all()) for p in after[12])
    assert max_difference(final[0], final[1]) == 0.0


@pytest.mark.process
@pytest.mark.parametrize("backend", ["torch", "torchft"])
def test_a_replica_that_claims_a_trillion_tokens_weighs_no_more_than_the_weight_limit(tmp_path, backend):
    """Replica 1 reports 10^12 tokens in its second sync (torchft: in its membership row, its weight computed from
    them, as an honest replica's is; torch: in a time-budget sync's agreement, where the tokens are the weights):
    every replica bounds it to WEIGHT_LIMIT times the median weight (the lower median: replica 0's), so the sync
    merges with weights 1 : WEIGHT_LIMIT rather than 1 : 10^8 (the record's weights are relative to the largest), both
    replicas record those weights, and they end identical and finite."""
    from hf_diloco.backends import WEIGHT_LIMIT

    if backend == "torch":  # (tokens weigh a sync only under time budgets there: rounds of H weigh alike)
        final = run_torch_backend(tmp_path / "run", {"round_seconds": 0.3, "sync_delay": 0}, max_steps=48,
                                  step_sleep=0.02, claim_tokens=[1, 2, 10**12])  # (blocking: a sync every budget)
        folders = [tmp_path / "run" / "run"]
    else:
        final = run_torchft(tmp_path / "run", {}, claim_tokens=[1, 2, 10**12])
        folders = [tmp_path / "run" / f"replica-{r}" for r in range(2)]
    for folder in folders:
        records = read_syncs(folder)
        assert len(records) >= 3 and not any(r.get("refused") for r in records), records
        assert backend == "torch" or all(r["committed"] for r in records), records  # (torch backend syncs: no vote)
        weights = [{m["replica"]: m["weight"] for m in r["replicas"]} for r in records]
        assert weights[1] == {0: 1 / WEIGHT_LIMIT, 1: 1.0}, records[1]
        if backend == "torchft":
            tokens = [{m["replica"]: m["tokens"] for m in r["replicas"]} for r in records]
            assert tokens[1][1] == 10**12 and tokens[0][0] == tokens[1][0] == tokens[0][1], tokens
            assert weights[0] == weights[2] == {0: 1.0, 1: 1.0}, records
    assert max_difference(final[0], final[1]) == 0.0 and all(bool(torch.isfinite(p).all()) for p in final[0])


@pytest.mark.process
def test_processes_that_resume_from_different_checkpoints_stop_in_one_sentence(tmp_path):
    """Machines that do not share output_dir resume from what each one holds: here rank 0 resumes from a round
    checkpoint and rank 1 from none. Before the first step every process learns that the launch starts at steps 0
    and 4, and the launch ends in one sentence naming the shared filesystem or save_on_each_node, instead of
    training replicas that are rounds apart (or waiting forever in a collective only one side makes)."""
    run_torch_backend(tmp_path / "first", {"save_every_rounds": 1}, max_steps=8)
    checkpoint = tmp_path / "first" / "run" / "checkpoint-4"
    assert checkpoint.is_dir()
    out = tmp_path / "second"
    out.mkdir()
    result = accelerate_launch([TORCHFT_RUN, json.dumps({"out": str(out), "backend": "torch", "max_steps": 8,
                                                         "resume_by_rank": {"0": str(checkpoint)}})],
                               config=ACCELERATE_CPU_2PROC, timeout=240)
    assert result.returncode != 0
    assert "the processes of this launch start at different steps (0 and 4)" in result.stderr, result.stderr[-3000:]
    assert "save_on_each_node: true" in result.stderr and not read_syncs(out / "run")


@pytest.mark.process
def test_no_checkpoint_is_saved_from_a_global_model_that_is_not_finite(tmp_path):
    """Two replicas (torch backend), a checkpoint every round (H = 4, 12 steps, save_total_limit 1). θ_global is
    spoiled with a NaN after step 5 (no sync can do that now: a non-finite average is refused, but an outer step is
    arithmetic). The saves at steps 8 and 12 are skipped with one line, so checkpoint-4, the last saved from a
    finite θ_global, stays complete and newest: rotation never removed it."""
    from hf_diloco import checkpoints

    out = tmp_path / "run"
    settings = {"out": str(out), "backend": "torch", "max_steps": 12, "inner_steps": 4, "nan_global_at_step": 5,
                "round": {"save_every_rounds": 1, "save_total_limit": 1, "final_sync": "blocking"}}
    result = accelerate_launch([TORCHFT_RUN, json.dumps(settings)], config=ACCELERATE_CPU_2PROC)
    assert result.returncode == 0, result.stderr[-4000:]
    for step in (8, 12):
        assert f"[diloco] no checkpoint at step {step}: θ_global is not finite" in result.stdout, result.stdout[-3000:]
    assert [p.name for p in checkpoints.complete_checkpoints(out / "run")] == ["checkpoint-4"]
    assert not (out / "run" / "checkpoint-8").exists() and not (out / "run" / "checkpoint-12").exists()


CODECS = {
    "sparse+ef": {"compression": "sparse", "error_feedback": True, "sparse_k": 16, "sparse_chunk": 256},
    "streaming-int4+ef-overlap": {"compression": "int4", "error_feedback": True, "num_fragments": 2, "sync_delay": 1,
                                  "fragment_alpha": 0.5},
    "muon-inner": {"inner_optimizer": "muon"},  # the round does not care what trained the replicas
}
# Every codec on a model whose weights are bfloat16 (bf16 autocast, the CPU chosen as no GPU is here): the torch
# backend trains each, torchft the one with error feedback.
BF16_CODECS = {"none": {}, "bf16": {"compression": "bf16"}, "fp16": {"compression": "fp16"},
               "int8": {"compression": "int8"}, "int4+ef": {"compression": "int4", "error_feedback": True},
               "sparse+ef": CODECS["sparse+ef"]}
# Runs of two torchft replicas that one pair of replica processes trains in turn, against one Lighthouse (min
# replicas 2): the process start-up, most of a run's time here, is paid once. Each run has its own folder and logs.
PAIR = {
    "plain": {"max_steps": 12, "inner_steps": 4, "round": {}},
    "seeds": {"max_steps": 12, "inner_steps": 4, "round": {}, "seed_by_replica": True},
    **{name: {"max_steps": 12, "inner_steps": 4, "round": codec} for name, codec in CODECS.items()},
    "sync-delay-auto": {"max_steps": 48, "inner_steps": 12, "step_sleep": 0.05, "slow_sync_seconds": 0.2,
                        "round": {"num_fragments": 2, "sync_delay": "auto"}},
    "slow-link-budget": {"max_steps": 240, "round_seconds": 0.2, "step_sleep": 0.03, "slow_sync_seconds": 0.6,
                         "round": {"sync_delay": "auto"}},
    "budget-overlap": {"max_steps": 200, "round_seconds": 0.5, "step_sleep": 0.02,
                       "round": {"sync_delay": 1, "overlap_landing": "eager", "save_every_rounds": 1},
                       "replica 1": {"step_sleep": 0.3}},
    "non-finite": {"max_steps": 16, "inner_steps": 4, "replica 1": {"nan_at_step": 6}},
    "bf16-weights-int4+ef": {"max_steps": 12, "inner_steps": 4, "weights": "bfloat16", "round": BF16_CODECS["int4+ef"]},
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Path:
    """The runs of PAIR, each in `folder / name` (records in replica-r/, output in replica<r>.log, final parameters
    in params<r>.pt); returns the folder."""
    folder = tmp_path_factory.mktemp("pair")
    with lighthouse(min_replicas=2, grace=5, log=folder / "lighthouse.log") as address:
        def runs(r: int) -> list[dict]:
            return [{"out": str(folder / name), "replica": r, "replicas": 2, "lighthouse": address, "min_replicas": 2,
                     "log": str(folder / name / f"replica{r}.log"),
                     **{k: v for k, v in settings.items() if not k.startswith("replica ")},
                     **settings.get(f"replica {r}", {})} for name, settings in PAIR.items()]

        logs = [folder / f"replica{r}.log" for r in range(2)]
        finish([start_replica(runs(r), logs[r]) for r in range(2)], logs, timeout=600)
    return folder


@pytest.fixture(scope="module")
def torch_backend(tmp_path_factory) -> Path:
    """The same two replicas on the torch backend, in one launch, for the runs of PAIR compared with it (plain and
    each codec; torchft's last round syncs every fragment, so these end blocking, as final_sync auto does there)."""
    folder = tmp_path_factory.mktemp("torch")
    runs = [{"out": str(folder / name), "backend": "torch", "max_steps": 12, "inner_steps": 4, "group": 1,
             "round": {**PAIR[name]["round"], "final_sync": "blocking"}} for name in ("plain", *CODECS)]
    runs += [{"out": str(folder / f"bf16-weights-{name}"), "backend": "torch", "max_steps": 12, "inner_steps": 4,
              "group": 1, "weights": "bfloat16", "round": {**codec, "final_sync": "blocking"}}
             for name, codec in BF16_CODECS.items()]
    result = accelerate_launch([TORCHFT_RUN, json.dumps(runs)], config=ACCELERATE_CPU_2PROC)
    assert result.returncode == 0, result.stderr[-4000:]
    return folder


def final_parameters(folder: Path) -> dict:
    return {r: torch.load(folder / f"params{r}.pt") for r in range(2)}


@pytest.fixture(scope="module")
def torch_backend_plain(torch_backend) -> dict:
    """Final parameters of two replicas built from seed 0 on the torch backend, fp32 rounds (12 steps, H = 4): where
    the torchft runs of the next two tests must end, whether their replicas start alike or apart (the torch backend
    starts apart replicas from rank 0's parameters, built from seed 0 too)."""
    return final_parameters(torch_backend / "plain")


@pytest.mark.process
def test_torchft_without_faults_matches_the_torch_backend(pair, torch_backend_plain):
    """Two replicas, equal speeds, no failure: the torchft rounds (quorum, token-weighted merge, vote) end with
    exactly the parameters the fixed-world torch backend reaches on the same data. Equal tokens give every
    replica the relative weight 1, so the merge is the torch backend's plain mean, bit for bit."""
    expected, got = torch_backend_plain, final_parameters(pair / "plain")
    for rank in (0, 1):
        assert max_difference(expected[rank], got[rank]) == 0.0
    rounds = read_syncs(pair / "plain" / "replica-0")
    assert [r["step"] for r in rounds] == [4, 8, 12]
    assert all(r["participants"] == 2 and r["committed"] for r in rounds)
    # Each replica trained on 128 tokens in the round (4 steps x 2 blocks x 16 tokens): equal weights.
    assert all(m["tokens"] == 128 and m["weight"] == 1.0 for r in rounds for m in r["replicas"])
    # Built from one seed, the replicas agree on θ by digest: nobody heals at the start, nothing else is sent.
    assert rounds[0]["startup_bytes"] == 0
    logs = [(pair / "plain" / f"replica{r}.log").read_text() for r in range(2)]
    assert all("[diloco] replica" in log for log in logs) and not any("healed from a live peer" in log for log in logs)


@pytest.mark.process
def test_replicas_built_from_different_seeds_start_from_the_first_ones_parameters(pair, torch_backend_plain):
    """Replica r builds its model from seed r. The first round's digests differ, so the first participant's θ (seed
    0's) goes to the other (one all-reduce, counted as startup bytes), as the torch backend broadcasts rank 0's
    (tests/test_distributed.py): the run ends bit for bit where the torch backend's replicas built from seed 0
    end."""
    expected, got = torch_backend_plain, final_parameters(pair / "seeds")
    assert max_difference(expected[0], expected[1]) == 0.0
    for replica in (0, 1):
        assert max_difference(expected[replica], got[replica]) == 0.0, replica
    rounds = read_syncs(pair / "seeds" / "replica-0")
    numel = sum(p.numel() for p in got[0])
    assert rounds[0]["startup_bytes"] == numel * 4  # ring all-reduce over 2: 2 (M - 1)/M x payload
    assert "started from different parameters" in (pair / "seeds" / "replica1.log").read_text()


@pytest.mark.process
def test_replicas_built_apart_stop_in_one_sentence_when_a_peer_spoils_the_first_ones_parameters(tmp_path):
    """Replicas built from different seeds take the first participant's parameters in one all-reduce where the
    others send zeros; replica 1 sends its own instead. What arrives does not match the digest the first reported,
    so every replica stops before its first sync with one sentence saying so, instead of training from a sum of
    two models."""
    out = tmp_path / "run"
    out.mkdir()
    with lighthouse(min_replicas=2, grace=5) as address:
        logs = [out / f"replica{r}.log" for r in range(2)]
        replicas = [start_replica({"out": str(out), "replica": r, "replicas": 2, "lighthouse": address,
                                   "min_replicas": 2, "seed_by_replica": True, "noisy_start": True}, logs[r])
                    for r in range(2)]
        codes = [p.wait(timeout=240) for p in replicas]
    sentence = "those the first participant sent are not the ones its digest names"
    for code, log in zip(codes, logs, strict=True):
        assert code != 0 and sentence in log.read_text(), log.read_text()[-3000:]
    assert not any(read_syncs(out / f"replica-{r}") for r in range(2))


@pytest.mark.process
@pytest.mark.parametrize("codec", list(CODECS))
def test_codecs_streaming_and_muon_on_torchft_match_the_torch_backend(pair, torch_backend, codec):
    """The round is one code path: the codecs with error feedback (sparse; int4 with F = 2 fragments whose exchange
    overlaps one inner step and mixes with alpha 0.5) and replicas trained by Muon (inner_optimizer muon, fp32
    syncs) give bit-identical parameters on both backends (12 steps,
    H = 4: three rounds, six with two fragments; int8 differs from int4 in its codec alone, tests/test_codecs.py).
    The torchft records carry the same bytes per round as the torch backend's, with the membership table in place
    of the contribution checks' table (torchft carries the checks' numbers in it)."""
    expected, got = final_parameters(torch_backend / codec), final_parameters(pair / codec)
    for rank in (0, 1):
        assert max_difference(expected[rank], got[rank]) == 0.0, rank
    torch_rounds = read_syncs(torch_backend / codec / "run")
    ft_rounds = read_syncs(pair / codec / "replica-0")
    assert [r["step"] for r in ft_rounds] == [r["step"] for r in torch_rounds]
    assert [r["fragments"] for r in ft_rounds] == [r["fragments"] for r in torch_rounds]
    assert [(r["sync"], r["round"]) for r in ft_rounds] == [(r["sync"], r["round"]) for r in torch_rounds]
    assert all(r["committed"] and r["compression"] == torch_rounds[0]["compression"] for r in ft_rounds)
    for ft, fixed in zip(ft_rounds, torch_rounds, strict=True):
        # Each an all-reduce over 2 replicas of 2 rows of float64: the membership table a column per field, the
        # checks' table the checks' numbers.
        assert ft["bytes_per_replica"] - fixed["bytes_per_replica"] == 2 * len(MEMBER_FIELDS) * 8 - \
            2 * len(CHECK_FIELDS) * 8


@pytest.mark.process
def test_bf16_weights_train_with_every_codec_on_both_backends(pair, torch_backend):
    """Weights in bfloat16 with bf16 autocast, on a machine without a GPU and no use_cpu given (the CPU is chosen),
    two replicas, 12 steps, H = 4: with every codec the replicas end identical, their weights bfloat16 and moved from
    the start, the loss lower at the last sync than at the first, and the outer state (θ_global and the momentum)
    float32: each codec sends θ_global − θ, formed in float32 from the bfloat16 weights. Two torchft replicas with
    int4 + error feedback end bit for bit where the torch backend's do."""
    from helpers import tiny_llama

    start = [p.detach() for p in tiny_llama(seed=0).to(torch.bfloat16).parameters()]
    for name in BF16_CODECS:
        folder = torch_backend / f"bf16-weights-{name}"
        final = final_parameters(folder)
        assert max_difference(final[0], final[1]) == 0.0, name
        assert all(p.dtype == torch.bfloat16 and bool(torch.isfinite(p).all()) for p in final[0]), name
        assert max_difference(final[0], start) > 0.01, name
        records = read_syncs(folder / "run")
        assert [r["step"] for r in records] == [4, 8, 12], name
        assert {r["compression"] for r in records} == {name}, name
        assert records[-1]["loss"] < records[0]["loss"], (name, [r["loss"] for r in records])
        for rank in (0, 1):
            outer = json.loads((folder / f"outer{rank}.json").read_text())
            assert outer["global"] == ["torch.float32"] and outer["optimizer"] == ["torch.float32"], (name, outer)
            assert outer["optimizer_tensors"] == len(start), "a momentum buffer per parameter"
    name = "bf16-weights-int4+ef"
    expected, got = final_parameters(torch_backend / name), final_parameters(pair / name)
    for rank in (0, 1):
        assert max_difference(expected[rank], got[rank]) == 0.0, rank
    assert json.loads((pair / name / "outer0.json").read_text())["global"] == ["torch.float32"]


@pytest.mark.process
def test_sync_delay_auto_on_torchft_chooses_alike_on_every_replica(pair):
    """sync_delay auto on torchft over a slower link (each all-reduce waits 0.2 s, a step 0.05 s): the exchange times
    ride with the round's statistics as on the torch backend, so both replicas record the same τ (above 1) for the
    same fragment at the same sync, every later sync of that fragment lands
    τ steps after its launch, and the replicas end identical. torchft's end is blocking: the last round syncs every
    fragment."""
    folder = pair / "sync-delay-auto"
    records = [read_syncs(folder / f"replica-{r}") for r in range(2)]
    choices = [[(r["sync"], r["sync_delay_auto"]["fragments"], r["sync_delay_auto"]["chosen"]) for r in rounds
                if "sync_delay_auto" in r] for rounds in records]
    assert choices[0] and choices[0] == choices[1], choices
    assert max(tau for *_, tau in choices[0]) > 1, choices
    delays = {}
    for record in records[0]:
        if len(record["fragments"]) == 1:
            assert record["step"] - record["launch_step"] == delays.get(record["fragments"][0], 1), record
        choice = record.get("sync_delay_auto", {})
        delays.update({f: choice["chosen"] for f in choice.get("fragments", [])})
        delays.update({int(f): tau for f, tau in choice.get("estimated", {}).items()})
    assert records[0][-1]["step"] == 48 and records[0][-1]["fragments"] == [0, 1]
    first, second = (torch.load(folder / f"params{r}.pt") for r in range(2))
    assert max_difference(first, second) == 0.0


@pytest.mark.process
def test_a_link_too_slow_for_the_time_budget_stretches_it_on_torchft_and_nobody_waits(pair):
    """Time-budget rounds of 0.2 s with `sync_delay: auto` over a link on which each all-reduce waits 0.6 s
    first (a step 0.03 s): the exchange does not fit the budget. The first one is still running when the next
    budget is spent: the next sync waits for it to land while the replica trains on, so it keeps replica 0 under an
    eighth of 0.6 s (landing it when the next came due waited about 0.4 s). Once the first exchange's time has been
    agreed the budget stretches to the sync's time in flight (the quorum, then the exchange) plus two steps, alike
    on both replicas (TimeBudget.stretch), and the later overlapped syncs keep replica 0 waiting at their landing
    under an eighth of the link's 0.6 s at the median and a quarter on average (without the stretch, most of 0.6 s
    each). The replicas end identical."""
    folder = pair / "slow-link-budget"
    records = [read_syncs(folder / f"replica-{r}") for r in range(2)]
    first = next(r for r in records[0] if "launch_step" in r)
    assert first["sync_seconds"] >= 0.6 and first["blocked_seconds"] < 0.6 / 8, first
    budgets = [[(r["sync"], r["sync_delay_auto"]["budget_seconds"]) for r in rounds if "sync_delay_auto" in r]
               for rounds in records]
    # Alike where both chose: a replica whose last sync lands at max_steps makes no choice for a next round, and
    # under time budgets each replica lands in its own steps, so the other may still choose at that sync.
    both = {n for n, _ in budgets[0]} & {n for n, _ in budgets[1]}
    assert budgets[0] and [b for b in budgets[0] if b[0] in both] == [b for b in budgets[1] if b[0] in both], budgets
    assert len(both) >= max(len(budgets[0]), len(budgets[1])) - 1, budgets
    stretched = [n for n, budget in budgets[0] if budget > 0.2]
    assert stretched and stretched[0] <= 3, budgets
    settled = [r for r in records[0][:-1] if r["sync"] > stretched[0] + 1 and "launch_step" in r]
    assert len(settled) >= 3, records[0]
    blocked = sorted(r["blocked_seconds"] for r in settled)
    assert blocked[len(blocked) // 2] <= 0.6 / 8 and sum(blocked) / len(blocked) <= 0.6 / 4, settled
    assert records[0][-1]["step"] == 240
    first, second = (torch.load(folder / f"params{r}.pt") for r in range(2))
    assert max_difference(first, second) == 0.0


@pytest.mark.process
def test_under_time_budgets_an_overlapped_sync_lands_once_its_exchange_is_done_so_the_fast_replica_never_waits(pair):
    """Time-budget rounds of 0.5 s with sync_delay 1 on torchft: replica 1's steps take about 0.3 s, replica 0's
    about 0.03 s, so replica 1 reaches a sync up to half of its step after replica 0 (its budget ends at the step
    nearest 0.5 s). Replica 0 launches its exchange in the background and trains on: a sync lands at τ = 1 or, when
    the exchange is still waiting for replica 1 then, at a later step once it is done, so replica 0's loop is
    blocked only by its snapshot and the landing (under 0.03 s a sync at the median, against replica 1's half-step
    arrival spread of up to 0.15 s that a landing at exactly τ would wait for). The last budget is sized to end as
    replica 0 reaches max_steps. Every sync is committed by both, and the replicas end identical. A round
    checkpoint after every sync (save_every_rounds 1) costs no blocking sync: each replica saves in its own folder
    at a step where a sync landed and none is in flight, and every sync but the last overlaps."""
    folder = pair / "budget-overlap"
    records = read_syncs(folder / "replica-0")
    middle = records[1:-1]  # the first sync carries start-up; the last one lands at max_steps, blocking
    assert len(middle) >= 6 and all(r["committed"] and r["participants"] == 2 for r in records), records
    assert all("launch_step" in r for r in records[:-1]), [(r["sync"], r.get("launch_step")) for r in records]
    for r in range(2):
        saved = sorted(int(c.name.split("-")[1]) for c in (folder / f"replica-{r}").glob("checkpoint-*"))
        landed = {rec["step"] for rec in read_syncs(folder / f"replica-{r}")}
        assert saved and set(saved) <= landed, (r, saved, sorted(landed))
    late = [r for r in middle if r["step"] - r["launch_step"] > 1]
    assert late, [(r.get("launch_step"), r["step"]) for r in middle]
    blocked = sorted(r["blocked_seconds"] for r in middle)
    assert blocked[len(blocked) // 2] < 0.03, blocked
    assert any("last_budget_seconds" in r for r in records[-3:]), records[-3:]
    first, second = (torch.load(folder / f"params{r}.pt") for r in range(2))
    assert max_difference(first, second) == 0.0


@pytest.mark.process
@pytest.mark.parametrize("round_settings", [
    {"compression": "int4", "error_feedback": True, "num_fragments": 2, "sync_delay": 1, "overlap_landing": "eager"},
], ids=["streaming-int4+ef-overlap-eager"])
def test_replicas_of_two_processes_on_torchft_match_the_torch_backend(tmp_path, round_settings):
    """2 replicas x 2 processes: on torchft each replica is an `accelerate launch` of two processes (DDP inside),
    whose Manager ranks 0 and 1 each sync their half of the pseudo-gradient with the same rank of the other replica;
    on the torch backend the same layout is one launch of four processes with replica_group_size 2. The final
    parameters are bit-identical (the same sums of the same slices in the same order, and equal replica weights),
    and both members of a torchft replica hold the same parameters."""
    expected, got = run_both_backends(tmp_path, round_settings, group=2)
    for replica in (0, 1):
        assert max_difference(expected[replica], got[replica]) == 0.0, replica
    torch_rounds = read_syncs(tmp_path / "torch" / "run")
    ft_rounds = read_syncs(tmp_path / "torchft" / "replica-0")
    assert [(r["step"], r["fragments"]) for r in ft_rounds] == [(r["step"], r["fragments"]) for r in torch_rounds]
    assert all(r["committed"] and r["participants"] == 2 for r in ft_rounds)
    # A replica's weight is the tokens of both its processes (per process: H/F steps x 2 blocks x 16 tokens).
    steps = 4 // round_settings.get("num_fragments", 1)
    assert all(m["tokens"] == 2 * steps * 2 * 16 for r in ft_rounds[:-1] for m in r["replicas"])


@pytest.mark.process
def test_a_killed_replica_is_left_out_then_heals_and_rejoins(tmp_path):
    """Three replicas, min_replicas 2. Replica 2 is SIGKILLed mid-run: the other two keep training (no round waits
    longer than the grace window plus the Lighthouse's heartbeat timeout), their rounds list replica 2 as absent.
    Replica 2 is started again and dies once more, this time inside the quorum it joined, before it connects to the
    others: they give that sync up after group_timeout (3 s; sync_timeout is 60) and go on without it. Started a
    third time, it heals from a live peer before its first inner step, takes part again, and at the end all three
    hold identical parameters."""
    grace, heartbeat, group_timeout = 3.0, 2.0, 3.0
    back, back_again = tmp_path / "replica-2-is-back", tmp_path / "replica-2-is-back-again"
    with lighthouse(min_replicas=2, grace=grace, heartbeat=heartbeat, log=tmp_path / "lighthouse.log") as address:
        def settings(r, **extra):
            return {"out": str(tmp_path), "replica": r, "replicas": 3, "lighthouse": address, "min_replicas": 2,
                    "max_steps": 120, "inner_steps": 4, "step_sleep": 0.1, "round": {"group_timeout": group_timeout},
                    **({} if r == 2 else {"hold": [[60, str(back)], [88, str(back_again)]]}), **extra}

        logs = [tmp_path / f"replica{r}.log" for r in range(3)]
        replicas = [start_replica(settings(r), logs[r]) for r in range(3)]
        wait_for(lambda: step_of(tmp_path, 2) >= 10, 120, "replica 2 to reach step 10")
        os.kill(replicas[2].pid, signal.SIGKILL)
        replicas[2].wait()
        killed_at = step_of(tmp_path, 0)

        def rounds_without_2():
            return [r for r in read_syncs(tmp_path / "replica-0") if not takes_part(r, 2)]

        wait_for(lambda: len(rounds_without_2()) >= 2, 60, "two rounds without replica 2")
        before = len(read_syncs(tmp_path / "replica-0"))
        replicas[2] = start_replica(settings(2, announce=str(back), die_in_group_forming=1), logs[2])
        assert replicas[2].wait(timeout=120) == -signal.SIGKILL, logs[2].read_text()[-3000:]
        wait_for(lambda: any(r["committed"] for r in read_syncs(tmp_path / "replica-0")[before:]), 60,
                 "a committed sync after the one given up")
        replicas[2] = start_replica(settings(2, announce=str(back_again)), logs[2])
        finish(replicas, logs)
    for r in (0, 1):  # the group was given up after group_timeout: the store's own words, then the sync's
        assert re.search(r"the sync at step \d+ did not commit \(wait timeout after 3000ms, keys: /torchft/",
                         logs[r].read_text()), logs[r].read_text()[-3000:]
    rounds = read_syncs(tmp_path / "replica-0")
    absent = [r for r in rounds if not takes_part(r, 2)]
    assert absent and all({"replica": 2, "participated": False} in r["replicas"] for r in absent)
    assert all(r["step"] > killed_at - 4 for r in absent)
    rejoined = [r for r in rounds if r["participants"] == 3 and r["step"] > absent[-1]["step"]]
    assert rejoined, "replica 2 took part again after its restart"
    healed = [m for r in rounds for m in r["replicas"] if m["replica"] == 2 and m.get("healed")]
    assert healed, "replica 2's first round after the restart was a heal"
    for replica in (0, 1):
        waits = [r["quorum_seconds"] + r["sync_seconds"] for r in read_syncs(tmp_path / f"replica-{replica}")]
        assert max(waits) <= max(grace + heartbeat, group_timeout) + 3.0, waits
    final = [torch.load(tmp_path / f"params{r}.pt") for r in range(3)]
    assert max_difference(final[0], final[1]) == 0.0 and max_difference(final[0], final[2]) == 0.0
    assert "healed from a live peer" in logs[2].read_text()


@pytest.mark.process
def test_a_replica_cut_off_inside_an_exchange_costs_the_other_seconds_not_sync_timeout(tmp_path):
    """Two replicas, min_replicas 1, sync_timeout 60 s, group_timeout 2 s. Replica 1 stops (SIGSTOP: its process
    and link silent, its connections open, as when its link goes down) inside its 6th bucket all-reduce, for 8 s.
    Replica 0 waits in that collective ExchangeTimeout's seconds (here the 2 s floor: its exchanges take a small
    fraction of that), the sync rolls back, and it syncs on alone while replica 1 is stopped; replica 1, let go,
    fails that sync, heals from replica 0 and takes part again, and both end with the same parameters. (Without the
    timeout replica 0 waited in the collective until replica 1 came back, and that sync committed.)"""
    stall = 8.0
    with lighthouse(min_replicas=1, grace=1.0, heartbeat=2.0) as address:
        def settings(r, **extra):
            return {"out": str(tmp_path), "replica": r, "replicas": 2, "lighthouse": address, "min_replicas": 1,
                    "max_steps": 160, "inner_steps": 4, "step_sleep": 0.1, "sync_timeout": 60,
                    "round": {"group_timeout": 2.0}, **extra}

        logs = [tmp_path / f"replica{r}.log" for r in range(2)]
        replicas = [start_replica(settings(0), logs[0]), start_replica(settings(1, stall_in_all_reduce=[6, stall]),
                                                                        logs[1])]
        finish(replicas, logs)
    rounds = read_syncs(tmp_path / "replica-0")
    given_up = [r for r in rounds if not r["committed"]]
    assert given_up, "the sync replica 1 was stopped in did not commit"
    cut = given_up[0]
    assert cut["sync_seconds"] < 2.0 + 2.0 < stall, cut  # the 2 s floor, not until replica 1 came back
    alone = [r for r in rounds if r["committed"] and r["participants"] == 1 and r["step"] > cut["step"]]
    assert len(alone) >= 2, [(r["step"], r["participants"], r["committed"]) for r in rounds]
    back = [r for r in rounds if r["participants"] == 2 and r["step"] > alone[-1]["step"]]
    assert back, "replica 1 took part again after it was let go"
    assert any(m.get("healed") for r in back for m in r["replicas"] if m["replica"] == 1)
    final = [torch.load(tmp_path / f"params{r}.pt") for r in range(2)]
    assert max_difference(final[0], final[1]) == 0.0


@pytest.mark.process
def test_a_heal_refuses_a_wrong_shape_a_nan_and_a_wrong_step_and_the_syncs_go_on(tmp_path):
    """Replica 0 runs alone, then replica 1 joins and must heal from it. The first four states replica 0 sends
    are spoiled (its first parameter a scalar, which copy_ would broadcast; NaN; a global_step past the run's end; a
    θ_global moved by 1e-3, sound in itself but not the one replica 0 reports holding in the quorum): replica 1
    refuses each in one sentence naming what is wrong, takes nothing, sits that sync out with weight 0 and does not
    commit it, while replica 0's syncs with it commit without waiting for a timeout. The fifth state is sound:
    replica 1 heals, takes part, and both end with the same finite parameters."""
    ready = tmp_path / "replica-1-is-up"
    with lighthouse(min_replicas=1, grace=1.0) as address:
        def settings(r, **extra):
            return {"out": str(tmp_path), "replica": r, "replicas": 2, "lighthouse": address, "min_replicas": 1,
                    "max_steps": 48, "inner_steps": 4, "step_sleep": 0.05, "sync_timeout": 30, **extra}

        logs = [tmp_path / f"replica{r}.log" for r in range(2)]
        spoiled = ["shape", "nan", "step", "drift"]
        replicas = [start_replica(settings(0, hold=[8, str(ready)], bad_heals=spoiled), logs[0])]
        wait_for(lambda: step_of(tmp_path, 0) >= 7, 120, "replica 0 to reach its hold at step 8")
        replicas.append(start_replica(settings(1, announce=str(ready)), logs[1]))
        finish(replicas, logs)
    own = read_syncs(tmp_path / "replica-1")
    refusals = [r["heal_refused"] for r in own if "heal_refused" in r]
    start = "refused the state sent by replica 0 to heal this one: "
    assert refusals[:4] == [
        start + "its outer state does not fit this model: parameter 0 is torch.float32 () where this replica's is "
        f"torch.float32 {tuple(torch.load(tmp_path / 'params0.pt')[0].shape)}",
        start + "its outer state does not fit this model: parameter 0 holds NaN or infinite values",
        start + "its global_step 480 is outside the run's 0..48 steps",
        start + "its θ_global is not the one the quorum's other replicas hold"], refusals
    assert len(refusals) == 4 and not any(r["committed"] for r in own if "heal_refused" in r)
    assert len(logs[1].read_text().split(start + "its global_step 480")) == 3  # said once, and once as the vote
    refused_steps = {r["step"] for r in own if "heal_refused" in r}
    sender = read_syncs(tmp_path / "replica-0")
    with_1 = [r for r in sender if takes_part(r, 1)]
    assert with_1 and all(r["committed"] for r in with_1)
    at_weight_0 = [r for r in with_1 if any(m["replica"] == 1 and m["weight"] == 0 for m in r["replicas"])]
    assert len(at_weight_0) >= 4 and max(r["sync_seconds"] for r in with_1) < 10, with_1
    healed = [r for r in own if r["committed"] and any(m["replica"] == 1 and m["healed"] for m in r["replicas"])]
    assert healed and healed[0]["step"] > max(refused_steps)
    final = [torch.load(tmp_path / f"params{r}.pt") for r in range(2)]
    assert all(bool(torch.isfinite(p).all()) for p in final[1]) and max_difference(final[0], final[1]) == 0.0


@pytest.mark.process
def test_a_replica_killed_inside_a_streamed_int4_round_rolls_it_back_then_heals(tmp_path):
    """Three replicas, min_replicas 2, int4 with error feedback, F = 2 fragments overlapped by one step. Replica 2
    is SIGKILLed inside a round, after that round's all-to-all went through and before its all-gather: the
    survivors' all-gather fails, they vote the round down and apply none of it (the record says committed false)
    and bring that progress to their next round (its tokens include the rolled-back round's). The survivors go on
    without replica 2; started again, it heals, rejoins, and all three end with the same finite parameters."""
    with lighthouse(min_replicas=2, grace=3.0, heartbeat=2.0) as address:
        def settings(r, **extra):
            return {"out": str(tmp_path), "replica": r, "replicas": 3, "lighthouse": address, "min_replicas": 2,
                    "max_steps": 120, "inner_steps": 4, "step_sleep": 0.1, "sync_timeout": 30,
                    "round": {"compression": "int4", "error_feedback": True, "num_fragments": 2, "sync_delay": 1},
                    **held_until_2_restarts(tmp_path, r), **extra}

        logs = [tmp_path / f"replica{r}.log" for r in range(3)]
        replicas = [start_replica(settings(r, **({"die_in_all_gather": 6} if r == 2 else {})), logs[r])
                    for r in range(3)]
        assert replicas[2].wait(timeout=180) == -signal.SIGKILL, logs[2].read_text()[-3000:]

        def rounds_without_2():
            return [r for r in read_syncs(tmp_path / "replica-0") if not takes_part(r, 2)]

        wait_for(lambda: len(rounds_without_2()) >= 2, 90, "two rounds without replica 2")
        replicas[2] = start_replica(settings(2, **restarted_2(tmp_path)), logs[2])
        finish(replicas, logs)
    for survivor in (0, 1):
        rounds = read_syncs(tmp_path / f"replica-{survivor}")
        failed = [i for i, r in enumerate(rounds) if not r["committed"]]
        assert failed, "the round replica 2 died in did not commit"
        rolled_back, after = rounds[failed[0]], rounds[failed[0] + 1]
        assert rolled_back["outer_step_skipped"] and after["committed"]
        mine = [m for m in after["replicas"] if m["replica"] == survivor][0]
        own = [m for m in rolled_back["replicas"] if m["replica"] == survivor][0]
        assert mine["tokens"] > own["tokens"], "the rolled-back round's tokens come with the next round"
        assert all(r["compression"] == "int4+ef" for r in rounds)
    rounds = read_syncs(tmp_path / "replica-0")
    assert any(m["replica"] == 2 and m.get("healed") for r in rounds for m in r["replicas"])
    assert [r for r in rounds if r["participants"] == 3 and r["step"] > rounds_without_2()[-1]["step"]]
    # Healed inside an overlapped sync (its quorum runs while the others train on), replica 2 takes the step that
    # sync started at, so it runs every later sync at the others' steps and ends with them. (The sync it healed
    # in is recorded at the step it joined, the others' at the step it landed, τ later.)
    # Only the restarted process's syncs after its heal count: the first process's syncs (before the kill) may
    # start with a sync it joined blocking, recorded at the step it joined.
    steps = {r["sync"]: r["step"] for r in rounds if r["committed"]}
    own = read_syncs(tmp_path / "replica-2")
    healed_at = max(i for i, r in enumerate(own) if any(m["replica"] == 2 and m.get("healed") for m in r["replicas"]))
    healer = [r for r in own[healed_at + 1:] if r["committed"]]
    assert healer, "replica 2 took part in syncs after it healed"
    assert [(r["sync"], r["step"]) for r in healer] == [(r["sync"], steps[r["sync"]]) for r in healer]
    final = [torch.load(tmp_path / f"params{r}.pt") for r in range(3)]
    assert max_difference(final[0], final[1]) == 0.0 and max_difference(final[0], final[2]) == 0.0
    assert all(bool(torch.isfinite(p).all()) for p in final[0])


@pytest.mark.process
def test_a_replica_behind_when_the_last_round_commits_ends_with_the_final_model(tmp_path):
    """Three replicas, min_replicas 2. Replica 2 pauses 15 s after its 6th step; the other two finish the run without
    it and stay (end_linger_seconds) to hand over the final model. When replica 2 reaches its round end, it meets
    them in a quorum, heals, learns that the run is over, and exits 0 with the same parameters as the others,
    within seconds of arriving instead of waiting sync_timeout for a round that can no longer form."""
    with lighthouse(min_replicas=2, grace=1.0) as address:
        logs = [tmp_path / f"replica{r}.log" for r in range(3)]
        replicas = [start_replica({"out": str(tmp_path), "replica": r, "replicas": 3, "lighthouse": address,
                                   "min_replicas": 2, "max_steps": 40, "inner_steps": 4, "step_sleep": 0.05,
                                   "sync_timeout": 120, **({"pause": [6, 15.0]} if r == 2 else {})}, logs[r])
                   for r in range(3)]
        finish(replicas[:2], logs[:2], timeout=240)
        started = time.monotonic()
        finish(replicas[2:], logs[2:], timeout=240)
        late_exit = time.monotonic() - started
    finished = read_syncs(tmp_path / "replica-0")
    assert finished[-1]["round"] == 10 and finished[-1]["participants"] == 2
    assert max(r["step"] for r in read_syncs(tmp_path / "replica-2")) < 40, "replica 2 was behind at the end"
    final = [torch.load(tmp_path / f"params{r}.pt") for r in range(3)]
    assert max_difference(final[0], final[1]) == 0.0 and max_difference(final[0], final[2]) == 0.0
    assert "handed the final model to replica(s) 2" in logs[0].read_text() + logs[1].read_text()
    assert late_exit < 60, late_exit


@pytest.mark.process
def test_a_replica_restarted_after_the_last_sync_heals_into_the_finished_run_and_ends_with_the_final_model(tmp_path):
    """Two replicas, min_replicas 1. Replica 1 is SIGKILLed after two syncs; replica 0 trains to max_steps alone
    and stays (end_linger_seconds) for the replica it knows missed the last sync. Started again only then, replica
    1 heals in its joining sync from replica 0 into a run that is over: it takes the one inner step Trainer takes
    after training begins, yet ends with replica 0's parameters, exactly, and exits 0."""
    max_steps = 24
    with lighthouse(min_replicas=1, grace=1.0) as address:
        up = str(tmp_path / "replica-1-is-up")

        def settings(r):
            # Replica 0 waits at step 2 for replica 1 to begin, so that (however slowly it starts) both take part
            # in the first syncs: at min_replicas 1, replica 0 alone can otherwise run all 24 steps first.
            return {"out": str(tmp_path), "replica": r, "replicas": 2, "lighthouse": address, "min_replicas": 1,
                    "max_steps": max_steps, "inner_steps": 4, "step_sleep": 0.05,
                    **({"announce": up} if r else {"hold": [2, up]})}

        logs = [tmp_path / f"replica{r}.log" for r in range(2)]
        replicas = [start_replica(settings(r), logs[r]) for r in range(2)]
        wait_for(lambda: sum(takes_part(r, 1) for r in committed(tmp_path / "replica-0")) >= 2, 120,
                 "two syncs with replica 1")
        os.kill(replicas[1].pid, signal.SIGKILL)
        replicas[1].wait()
        wait_for(lambda: any(r["step"] == max_steps for r in committed(tmp_path / "replica-0")), 120,
                 "replica 0's last sync")
        assert replicas[0].poll() is None, "replica 0 stays for the replica that missed the last sync"
        replicas[1] = start_replica(settings(1), logs[1])
        finish(replicas, logs)
    assert not takes_part(committed(tmp_path / "replica-0")[-1], 1)
    assert "handed the final model to replica(s) 1" in logs[0].read_text(), logs[0].read_text()[-3000:]
    assert int((tmp_path / "step1.txt").read_text()) == max_steps + 1, "the one step Trainer takes after the heal"
    final = [torch.load(tmp_path / f"params{r}.pt") for r in range(2)]
    assert max_difference(final[0], final[1]) == 0.0


@pytest.mark.process
def test_under_cpu_quotas_a_slow_replica_takes_fewer_steps_with_round_seconds_and_a_killed_fast_one_rejoins(
        tmp_path, cpu_quota):
    """Three replicas under real CPU quotas (cgroups: 60%, 60% and 20% of a core, 1.4 of the machine's 2 cores),
    rounds of round_seconds 1.5 s. Every replica trains for the same time: replica 2 takes about a third of the
    others' steps per sync, each member's merge weight is its tokens relative to the most (independently: steps x
    32 tokens), and in the syncs all three make without a heal (but the last, which the fast ones reach at
    max_steps before their budget is spent) no replica waits for the quorum longer than a third of its budget.
    Replica 0, a fast one, is SIGKILLed mid-run and started again (the others are held, once they have synced twice
    without it, until it is up): it heals from a live peer, takes part again, and all three end with identical
    parameters; the run ends when a replica reaches max_steps."""
    # 8 syncs or more: under their quota the fast replicas take 40 to 150 steps per budget, run to run (at 600 steps
    # a run at 150 ended in 5 syncs, before the restarted replica could take part again; it rejoins at about sync 6).
    # A faster CPU takes 200 to 300 a budget: 5 syncs, and the restarted replica's joining sync is the last one (it
    # heals into a run that is over, as in the test above).
    budget, max_steps = 1.5, 1200
    quotas = [cpu_quota(0.6), cpu_quota(0.6), cpu_quota(0.2)]
    hold, back = tmp_path / "hold", tmp_path / "replica-0-is-back"
    with lighthouse(min_replicas=2, grace=2.0, log=tmp_path / "lighthouse.log") as address:
        def settings(r, **extra):
            return {"out": str(tmp_path), "replica": r, "replicas": 3, "lighthouse": address, "min_replicas": 2,
                    "max_steps": max_steps, "inner_steps": 1000, "round_seconds": budget, "cgroup": str(quotas[r]),
                    **({} if r == 0 else {"pause_while": [str(hold), str(back)]}), **extra}

        logs = [tmp_path / f"replica{r}.log" for r in range(3)]
        replicas = [start_replica(settings(r), logs[r]) for r in range(3)]
        wait_for(lambda: len(committed(tmp_path / "replica-1")) >= 2, 120, "two syncs")
        os.kill(replicas[0].pid, signal.SIGKILL)
        replicas[0].wait()
        wait_for(lambda: sum(not takes_part(r, 0) for r in committed(tmp_path / "replica-1")) >= 2, 60,
                 "two syncs without replica 0")
        hold.write_text("held")
        replicas[0] = start_replica(settings(0, announce=str(back)), logs[0])
        finish(replicas, logs)
    rounds = committed(tmp_path / "replica-1")
    assert [r["round"] for r in rounds] == list(range(1, len(rounds) + 1))
    assert rounds[-1]["step"] == max_steps, "the run ends when a replica reaches max_steps"
    without = [r for r in rounds if not takes_part(r, 0)]
    again = [r for r in rounds if takes_part(r, 0) and r["round"] > without[-1]["round"]]
    assert len(without) >= 2 and again, [[m["replica"] for m in r["replicas"] if m["participated"]] for r in rounds]
    assert any(m["replica"] == 0 and m.get("healed") for r in again for m in r["replicas"])
    took_part = [m for r in rounds for m in r["replicas"] if m["participated"]]
    steps = {i: sorted(m["steps"] for m in took_part if m["replica"] == i and not m["healed"]) for i in range(3)}
    fast, slow = sorted(steps[0] + steps[1]), steps[2]
    assert 0.15 <= slow[len(slow) // 2] / fast[len(fast) // 2] <= 0.6, steps
    for r in rounds:
        took_part = [m for m in r["replicas"] if m["participated"]]
        largest = max(m["tokens"] / (1 + m["staleness"]) for m in took_part)
        assert all(m["weight"] == pytest.approx(m["tokens"] / (1 + m["staleness"]) / largest, abs=1e-12)
                   for m in took_part), r["replicas"]
    # Syncs of all three with no heal, after one that committed (a rolled-back sync's tokens ride with the next):
    own = read_syncs(tmp_path / "replica-1")
    # (The last sync is left out: the fast replicas reach max_steps before their budget is spent and wait there.)
    calm = [r for before, r in zip(own, own[1:-1], strict=False) if before["committed"] and r["committed"] and
            r["participants"] == 3 and not any(m["healed"] for m in r["replicas"])]
    assert calm and all(m["tokens"] == 32 * m["steps"] for r in calm for m in r["replicas"]), \
        [r["replicas"] for r in calm]
    assert all(m["waited_seconds"] <= budget / 3 for r in calm for m in r["replicas"]), \
        [[m["waited_seconds"] for m in r["replicas"]] for r in calm]
    final = [torch.load(tmp_path / f"params{r}.pt") for r in range(3)]
    assert max_difference(final[0], final[1]) == 0.0 and max_difference(final[0], final[2]) == 0.0


@pytest.mark.process
def test_a_replica_that_goes_non_finite_sits_the_round_out_on_torchft(pair):
    """Two replicas; replica 1's weights turn NaN at step 6 (inside round 2, H = 4). That round merges replica 0's
    pseudo-gradient alone (replica 1 sends zeros with weight 0), the record of every replica names replica 1,
    replica 1 takes θ_global and trains on, and both end with the same finite parameters."""
    tmp_path = pair / "non-finite"
    logs = [tmp_path / f"replica{r}.log" for r in range(2)]
    for r in range(2):
        rounds = read_syncs(tmp_path / f"replica-{r}")
        bad = [x for x in rounds if x.get("non_finite_replicas")]
        assert [(x["step"], x["non_finite_replicas"]) for x in bad] == [(8, [1])], rounds
        weights = {m["replica"]: m["weight"] for m in bad[0]["replicas"]}
        assert weights[1] == 0.0 and weights[0] > 0 and bad[0]["committed"]
        assert all(not x.get("non_finite_replicas") and x["committed"] for x in rounds if x["step"] > 8)
    final = [torch.load(tmp_path / f"params{r}.pt") for r in range(2)]
    assert max_difference(final[0], final[1]) == 0.0 and all(bool(torch.isfinite(p).all()) for p in final[0])
    assert "non-finite pseudo-gradient at step 8" in logs[1].read_text()


@pytest.mark.process
def test_a_replica_that_misses_rounds_brings_its_progress_with_a_staleness_weight(tmp_path):
    """Three replicas, min_replicas 2, grace 1 s. Replica 2 pauses 8 s after its 6th step: the other two merge rounds
    without it. When it arrives, its base is rounds old: it heals θ_global from a live peer and its local progress
    joins that round with weight tokens / (1 + rounds behind), as the record lists; at the end all three hold
    identical parameters."""
    with lighthouse(min_replicas=2, grace=1.0) as address:
        logs = [tmp_path / f"replica{r}.log" for r in range(3)]
        replicas = [start_replica({"out": str(tmp_path), "replica": r, "replicas": 3, "lighthouse": address,
                                   "min_replicas": 2, "max_steps": 200, "inner_steps": 4, "step_sleep": 0.05,
                                   **({"pause": [6, 8.0]} if r == 2 else {})}, logs[r]) for r in range(3)]
        finish(replicas, logs)
    rounds = {x["round"]: x for r in range(3) for x in read_syncs(tmp_path / f"replica-{r}")}
    late = [(x, m) for x in rounds.values() for m in x["replicas"]
            if m["replica"] == 2 and m.get("participated") and m["staleness"] > 0]
    assert len(late) == 1, [x["replicas"] for x in rounds.values()]
    record, member = late[0]
    assert member["healed"] and member["steps"] > 0 and record["committed"]
    largest = max(m["tokens"] / (1 + m["staleness"]) for m in record["replicas"] if m.get("participated"))
    assert member["weight"] == pytest.approx(member["tokens"] / (1 + member["staleness"]) / largest, abs=1e-12), \
        record["replicas"]
    missed = [x for x in rounds.values() if x["round"] < record["round"] and x["participants"] == 2]
    assert len(missed) >= member["staleness"], "the rounds it missed were merged without it"
    final = [torch.load(tmp_path / f"params{r}.pt") for r in range(3)]
    assert max_difference(final[0], final[1]) == 0.0 and max_difference(final[0], final[2]) == 0.0


def test_a_replica_whose_overlapped_sync_ended_the_run_launches_no_further_sync():
    """Under time budgets a slow replica's last budget ends before the fastest reaches max_steps (it is sized to),
    so its last sync is an overlapped one, launched short of max_steps; the fastest brings max_steps to it, and
    where it lands the slow replica continues at max_steps with the run over. No sync is due then: one more
    (as before this was checked) waited for peers that had finished until sync_timeout, and the replica failed
    without the final model (benchmarks/speeds.py --overlap, 300 s). At max_steps in a run not yet over, the last
    sync is due as before."""
    from types import SimpleNamespace

    from hf_diloco.torchft_backend import TorchftQuorum

    def quorum(over: bool) -> SimpleNamespace:
        return SimpleNamespace(run_over=lambda: over, args=SimpleNamespace(round_seconds=1.0))

    assert TorchftQuorum.due(quorum(over=True), 200, 200, progress=None) is False
    assert TorchftQuorum.due(quorum(over=False), 200, 200, progress=None) is True


def test_the_replica_group_gives_up_a_member_that_never_connects_and_waits_for_a_slow_exchange():
    """The group across replicas (two members, as threads here): a member that never connects is given up after
    group_timeout (1 s), not sync_timeout (30 s), with the store's own sentence; once the group has formed, a member
    that comes to the exchange 2.5 s late (past group_timeout) is waited for and the all-reduce sums both."""
    import threading
    from datetime import timedelta

    from torch.distributed import AllreduceOptions, TCPStore

    from hf_diloco.torchft_backend import replica_group

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    alone = replica_group(sync_timeout=30.0, group_timeout=1.0)
    started = time.perf_counter()
    with pytest.raises(Exception, match="wait timeout after 1000ms"):
        alone.configure(f"127.0.0.1:{store.port}/alone", "replica_0", 0, 2)
    assert 1.0 <= time.perf_counter() - started < 5.0
    sums, errors = {}, []

    def member(rank: int) -> None:
        try:
            group = replica_group(sync_timeout=30.0, group_timeout=1.0)
            group.configure(f"127.0.0.1:{store.port}/formed", f"replica_{rank}", rank, 2)
            if rank == 1:
                time.sleep(2.5)
            values = torch.full((3,), float(rank + 1))
            group.allreduce([values], AllreduceOptions()).wait()
            sums[rank] = values.tolist()
        except Exception as error:  # noqa: BLE001 (reported by the assertion below)
            errors.append(f"member {rank}: {error}")

    members = [threading.Thread(target=member, args=(rank,)) for rank in (0, 1)]
    for thread in members:
        thread.start()
    for thread in members:
        thread.join(60)
    assert errors == [] and sums == {0: [3.0, 3.0, 3.0], 1: [3.0, 3.0, 3.0]}, (errors, sums)


def test_outer_backend_torchft_names_its_missing_pieces_in_one_sentence(tmp_path):
    no_lighthouse = cli("train", "--config", "recipes/tiny-pretrain.yaml", "--outer_backend", "torchft",
                        "--output_dir", str(tmp_path / "a"), "--max_steps", "1", "--inner_steps", "1")
    assert no_lighthouse.returncode != 0
    assert no_lighthouse.stderr.strip().splitlines()[-1].startswith("hf-diloco: error: outer_backend torchft needs "
                                                                     "a Lighthouse")
    for backend in ("torch", "torchft"):  # one process cannot hold a replica of two
        grouped = cli("train", "--config", "recipes/tiny-pretrain.yaml", "--outer_backend", backend,
                      "--lighthouse", "http://127.0.0.1:1", "--replica_group_size", "2",
                      "--output_dir", str(tmp_path / backend), "--max_steps", "1", "--inner_steps", "1")
        assert grouped.returncode == 2 and grouped.stderr.strip().splitlines()[-1] == (
            "hf-diloco: error: replica_group_size=2 does not divide the 1 launched process(es); launch a multiple of "
            "it (accelerate launch --num_processes)."), grouped.stderr
    assert "Traceback" not in no_lighthouse.stderr
    # `launch --replicas`: each replica's launch starts the accelerate config's processes, which must be one replica
    # (replica_group_size, or the config's dp_shard_size x tp_size); checked before anything starts.
    for config, group, hint in (("torchft-replica-2proc.yaml", "1", "starts 2"),
                                ("torchft-fsdp-tp-replica.yaml", "2", "dp_shard_size=2 × tp_size=2")):
        refused = cli("launch", "recipes/torchft-3.yaml", "--accelerate-config", f"accelerate_configs/{config}",
                      "--replicas", "2", "--replica_group_size", group, "--output_dir", str(tmp_path / config))
        assert refused.returncode == 2 and hint in refused.stderr and "Traceback" not in refused.stderr, \
            refused.stderr
        assert not (tmp_path / config).exists()


@pytest.mark.process
def test_two_processes_of_one_torchft_launch_are_one_replica_or_refused(tmp_path):
    """Two processes in one torchft launch are one replica of two, or nothing."""
    two = accelerate_launch(["-m", "hf_diloco.cli", "train", "--config", "recipes/tiny-pretrain.yaml",
                             "--outer_backend", "torchft", "--lighthouse", "http://127.0.0.1:1", "--max_steps", "1",
                             "--inner_steps", "1", "--output_dir", str(tmp_path / "two")])
    assert two.returncode != 0
    assert ("hf-diloco: error: outer_backend torchft starts one launch per replica, so the 2 processes of this launch "
            "are one replica: set replica_group_size 2 (or launch one process per replica).") in two.stderr


def test_without_torchft_installed_the_backend_says_how_to_install_it(tmp_path, monkeypatch):
    """torchft is an optional extra: a Python without it gets one sentence naming the install command."""
    monkeypatch.setitem(sys.modules, "torchft", None)  # `import torchft` raises ImportError, as where it is absent
    result = cli("train", "--config", "recipes/tiny-pretrain.yaml", "--outer_backend", "torchft", "--lighthouse",
                 "http://127.0.0.1:1", "--output_dir", str(tmp_path / "out"))
    assert result.returncode == 2
    assert result.stderr.strip() == ("hf-diloco: error: outer_backend torchft needs torchft: pip install -e '.[ft]' "
                                     "(or pip install torchft==0.2.0).")


def healed(record: dict, replica: int) -> bool:
    """Whether `replica` took θ_global from a live peer in this sync's quorum."""
    return any(m["replica"] == replica and m.get("healed") for m in record.get("replicas", []))


def launch_and_kill_replica_1(command: list[str], out: Path, log: Path, ready, what: str,
                              read_listeners: bool = False) -> tuple[str, ListenerWatch | None]:
    """Run an `hf-diloco launch --replicas` command; once `ready()`, SIGKILL replica 1's training process (one of
    them); the launch must still exit 0. Returns its output, and with `read_listeners` what the launch's processes
    listened on (ListenerWatch)."""
    launcher = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env(), cwd=REPO)
    listeners = ListenerWatch(launcher) if read_listeners else None
    try:
        wait_for(ready, 180, what)
        os.kill(replica_training_pid(out, 1), signal.SIGKILL)
        assert launcher.wait(timeout=300) == 0, log.read_text()[-4000:]
    finally:
        if launcher.poll() is None:
            launcher.kill()
    return log.read_text(), listeners


@pytest.mark.process
def test_launch_replicas_starts_a_lighthouse_and_restarts_a_killed_replica_which_heals(tmp_path):
    """`hf-diloco launch recipes/torchft-3.yaml --replicas 3 --max-restarts 1`: one command starts the Lighthouse
    and three replicas. Replica 1's training process is killed; the launcher starts it again, it heals from the
    live replicas and rejoins, the launch exits 0 at step 300 and all three replicas end with the same model. (30
    syncs of 10 steps: the restarted replica has been back by about round 11, killed after round 1.)

    As docs/guides/elastic.md starts it on one machine, it listens on loopback only: read with psutil every 0.1 s
    while it runs, every listener of every process of the launch (the launcher with its Lighthouse; each replica's
    torchft manager, store, process group and healing server) is on 127.0.0.1, a training process of each
    replica held at least four of them (manager, store, gloo, healing), and each port, as soon as it is seen, refuses a
    connection to this machine's external address."""
    out = tmp_path / "run"
    command = [sys.executable, "-m", "hf_diloco.cli", "launch", "recipes/torchft-3.yaml", "--accelerate-config",
               "accelerate_configs/torchft-replica.yaml", "--replicas", "3", "--max-restarts", "1",
               "--output_dir", str(out), "--max_steps", "300", "--inner_steps", "10", "--block_size", "32",
               "--per_device_train_batch_size", "4", "--eval_strategy", "no", "--disable_tqdm", "true",
               "--sync_grace_seconds", "3"]
    text, listeners = launch_and_kill_replica_1(command, out, tmp_path / "launch.log",
                                                lambda: len(read_syncs(out / "replica-1")) >= 1,
                                                "a round of replica 1", read_listeners=True)
    addresses, ports, reachable = listeners.result()
    assert addresses == {"127.0.0.1"}, addresses
    assert reachable and not any(reachable.values()), reachable
    # a training process of each of the three replicas held four listeners (one restarted: seen twice)
    assert sum(len(p) >= 4 for p in ports.values()) >= 3, ports
    assert "[diloco] replica 1 exited with status 1; starting it again (restart 1 of 1)" in text
    assert "[diloco] replica 1 joined at round" in text and "healed from a live peer" in text
    rounds = read_syncs(out / "replica-0")
    # A sync the kill rolled back carries its steps to the next one: 40 syncs, one fewer committed for each.
    assert rounds[-1]["step"] == 300 and rounds[-1]["participants"] == 3
    assert rounds[-1]["round"] == 30 - sum(not r["committed"] for r in rounds), \
        [(r["round"], r["step"], r["committed"]) for r in rounds]
    # A round went on without the killed replica, or (restarted quicker than a round) it healed into the next one.
    assert any(r["participants"] == 2 or healed(r, 1) for r in rounds), "replica 1 missed no round and never healed"
    # (The restarted replica's fresh AdamW moments can make it an outlier for a while: left out, it still ends
    # with θ_global, and the summary names the replicas whose contributions merged.)
    merged = ", ".join(str(m["replica"]) for m in rounds[-1]["replicas"] if m["participated"])
    assert merged in ("0, 1, 2", "0, 2"), rounds[-1]
    assert (f"[diloco] the run ended at round {rounds[-1]['round']} (step 300), committed by replica(s) {merged}; "
            "replica 0 exit 0, replica 1 exit 0, replica 2 exit 0") in text
    from safetensors.torch import load_file

    models = [load_file(out / f"replica-{r}" / "model.safetensors") for r in range(3)]
    assert all(float((models[0][k] - m[k]).abs().max()) == 0.0 for m in models[1:] for k in models[0])
    # Finished means finished, whoever healed when: what `hf-diloco push` reads says so for the launch and each
    # replica (push refuses any other outcome).
    from hf_diloco.hub import run_outcome

    for folder in (out, *(out / f"replica-{r}" for r in range(3))):
        assert run_outcome(folder) == {"ended": "finished", "step": 300, "max_steps": 300, "checkpoint": None}


# Each layout of a torchft replica: its accelerate config, the settings that choose it, and the steps of the run.
# Replicas split by tensor parallel with each piece sharded by FSDP2: each member heals its own piece of θ_global
# and of the outer momentum, a DTensor over the replica's 2-D mesh that is both sharded and split, through the code
# that FSDP2 alone and tensor parallel alone run too. Whole replicas of one process are killed and healed by the
# test above; replicas of two processes with DDP inside sync on torchft in
# test_replicas_of_two_processes_on_torchft_match_the_torch_backend.
# 6 rounds of 10 steps: the restarted replica 1 comes back late in the run or after its last round (killed after
# round 1; its four processes take most of a minute to start on 2 cores), and then heals from replica 0 lingering with
# the final model; the checks below hold either way.
REPLICA_LAYOUTS = {
    "fsdp+tp": ("torchft-fsdp-tp-replica.yaml", [], 60),
}


@pytest.mark.process
@pytest.mark.parametrize("inside", list(REPLICA_LAYOUTS))
def test_launch_replicas_of_several_processes_restarts_one_whose_member_was_killed(tmp_path, inside):
    """`hf-diloco launch ... --accelerate-config accelerate_configs/torchft-fsdp-tp-replica.yaml --replicas 2`: two
    replicas of four processes (split by tensor parallel, each piece sharded by FSDP2), each launch on its own
    rendezvous port. One member of replica 1 is SIGKILLed: its launch
    ends, replica 0 goes on alone (min_replicas 1), the launcher starts replica 1 again, all of its processes heal
    from their counterparts in replica 0 (sharded or split: each its own piece of θ_global and of the outer
    momentum), and both replicas end with the same model."""
    out = tmp_path / "run"
    config, layout, steps = REPLICA_LAYOUTS[inside]
    command = [sys.executable, "-m", "hf_diloco.cli", "launch", "recipes/torchft-3.yaml", "--accelerate-config",
               f"accelerate_configs/{config}", "--replicas", "2", *layout,
               "--min_replicas", "1", "--max-restarts", "1", "--output_dir", str(out), "--max_steps", str(steps),
               "--inner_steps", "10", "--block_size", "32", "--per_device_train_batch_size", "4",
               "--eval_strategy", "no", "--disable_tqdm", "true", "--sync_grace_seconds", "3"]
    # With min_replicas 1 a replica that starts first trains alone until the other joins: kill only once both
    # have taken part in a round.
    text, _ = launch_and_kill_replica_1(command, out, tmp_path / "launch.log",
                                        lambda: any(r["participants"] == 2 for r in read_syncs(out / "replica-1")),
                                        "a round of both replicas")
    assert "[diloco] replica 1 exited with status 1; starting it again (restart 1 of 1)" in text
    # Started twice; the second time replica 1 healed (from replica 0 mid-run, or, on a slow machine, from replica 0
    # lingering after the last round with the final model).
    joins = [line for line in text.splitlines() if line.startswith("[diloco] replica 1 joined at round")]
    assert len(joins) == 2 and "healed from a live peer" in joins[1], joins
    rounds = read_syncs(out / "replica-0")
    assert rounds[-1]["step"] == steps  # a sync the kill rolled back carries its steps to the next one
    assert rounds[-1]["round"] == steps // 10 - sum(not r["committed"] for r in rounds)
    together = [r["round"] for r in rounds if r["participants"] == 2]
    # A round went on without the killed replica, or (restarted quicker than a round) it healed into the next one.
    assert together and any((r["participants"] == 1 or healed(r, 1)) and r["round"] > together[0] for r in rounds), \
        "replica 1 missed no round and never healed"
    from safetensors.torch import load_file

    a, b = (load_file(out / f"replica-{r}" / "model.safetensors") for r in range(2))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_healing_transport_listens_on_its_address_and_loads_only_tensors(tmp_path):
    """What heals a joining replica: the sender listens on the replica's address only (not every interface), the
    outer state (tensors, numbers, the optimizer's settings) arrives whole, and a peer that serves a pickle which
    would run code if loaded (as torchft's own transport would load it) is refused in one sentence naming it, and
    the code never runs."""
    import http.server
    import threading
    from datetime import timedelta

    from torch.distributed._serialization import _streaming_load, _streaming_save

    from hf_diloco.torchft_backend import HealRefused, safe_checkpoint_transport

    timeout = timedelta(seconds=20)
    sender, receiver = safe_checkpoint_transport("127.0.0.1", timeout), safe_checkpoint_transport("127.0.0.1", timeout)
    try:
        assert sender._server.socket.getsockname()[0] == "127.0.0.1"
        assert sender.metadata().startswith("http://127.0.0.1:")
        params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
        optimizer = torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer.step()
        state = {"user": {"outer": {"global_params": [p.detach() for p in params],
                                    "optimizer": optimizer.state_dict()}, "global_sync": 3, "global_step": 12},
                 "torchft": {"step": 3, "batches_committed": 6}}
        sender.send_checkpoint(dst_ranks=[1], step=3, state_dict=state, timeout=timeout)
        got = receiver.recv_checkpoint(src_rank=0, metadata=sender.metadata(), step=3, timeout=timeout)
        assert got["user"]["global_sync"] == 3 and got["torchft"] == {"step": 3, "batches_committed": 6}
        assert all(torch.equal(a, b) for a, b in zip(got["user"]["outer"]["global_params"], params, strict=True))
        momentum = got["user"]["outer"]["optimizer"]["state"][0]["momentum_buffer"]
        assert torch.equal(momentum, optimizer.state_dict()["state"][0]["momentum_buffer"])
    finally:
        sender.shutdown()

    ran = tmp_path / "code-ran"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (ran,))

    poisoned = io.BytesIO()
    _streaming_save({"global_params": [torch.zeros(2)], "extra": Payload()}, poisoned)

    class Poisoner(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(poisoned.getvalue())

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Poisoner)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    address = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(HealRefused) as refused:
            receiver.recv_checkpoint(src_rank=0, metadata=f"{address}/checkpoint/", step=3, timeout=timeout)
    finally:
        server.shutdown()
        receiver.shutdown()
    assert str(refused.value).startswith(f"refused the state sent by {address}: it holds more than tensors")
    assert not ran.exists(), "the poisoned state ran code"
    # The same bytes loaded as torchft's own transport loads them (weights_only=False) do run the code.
    _streaming_load(io.BytesIO(poisoned.getvalue()), weights_only=False)
    assert ran.exists()


def listening_addresses(pid: int) -> set[str]:
    import psutil

    return {c.laddr.ip for c in psutil.Process(pid).net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}


@pytest.mark.process
def test_the_lighthouse_listens_on_loopback_unless_given_an_address(tmp_path):
    """`hf-diloco lighthouse` with no --host listens on 127.0.0.1 only and says so; given a wildcard address it
    says who can reach it and that it has no authentication."""
    for host, reach in ((None, "open to this machine only"), ("0.0.0.0", "open to anyone who can reach this address")):
        log = tmp_path / f"lighthouse-{host}.log"
        port = free_port()
        process = subprocess.Popen([sys.executable, "-m", "hf_diloco.cli", "lighthouse", "--port", str(port),
                                    *(["--host", host] if host else [])],
                                   stdout=log.open("w"), stderr=subprocess.STDOUT, env=env(), cwd=REPO)
        try:
            wait_for(lambda log=log: "Lighthouse on" in log.read_text(), 60, "the Lighthouse to start")
            text = log.read_text()
            assert reach in text, text
            listening = listening_addresses(process.pid)
            if host is None:
                assert listening == {"127.0.0.1"}, listening
                assert "no authentication" not in text
            else:
                assert listening == {"0.0.0.0"}, listening
                assert f"has no authentication: keep port {port} on a private network" in text
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=20)
