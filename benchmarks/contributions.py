"""Contribution checks: each injected fault with and without the checks, and what the checks cost a sync.

    python benchmarks/contributions.py            # 3 replicas, 80 rounds of H = 5 (400 steps) a run (about 14 min)
    python benchmarks/contributions.py --quick    # 20 rounds of H = 5, cost repeated twice (about 5 min)

    python benchmarks/contributions.py --resume   # read back the runs an interrupted invocation finished

Every run is `hf-diloco launch` of the peer task (recipes/tiny-pretrain.yaml, block 32, batch 4) with 3 replicas
on the torch backend, each reading its own third of the built-in corpus (non_iid), held-out loss every 10 rounds.
One replica goes wrong the way a site would: its third of the data is random characters (`garbage`) or every
character permuted (`permuted`, data read with another tokenizer), or through the test hook
(tests/scripts/contribution_hook) its learning rate is 100x (`lr x100`), its Δ_i is sent 3 times over (`scaled x3`)
or negated (`sign flip`); `garbage, sparse codec` is the garbage third with every sync sent through the sparse
codec with SparseLoCo's settings (64 of 4096 values, error feedback 0.95, outer lr 1 without momentum), its
reference too. Each fault runs with `contribution_checks exclude` and `off`, and the reference is the run without
that replica: the same launch, same data, with that replica left out from the first sync (the hook).

Columns: held-out loss at the end, with and without the checks, against the reference; rounds to recovery: the
first evaluated round from which the run's held-out loss stays within 2% of the reference's at the same round
(`never` when it does not); syncs the faulty replica was left out of, and how many of the healthy ones were.
Cost: a clean run with the checks and without them, interleaved and repeated: the record's bytes per sync (the
checks' table, exact) and the seconds a sync kept the inner loop waiting (median [min, max] over the repeats of
each run's median), beside the bound the bytes set on a 1 Gbit/s link.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import REPO, curve_panels, markdown_table, run_env, save, show, spread, work_folder

sys.path.insert(0, str(REPO / "tests"))
from helpers import corrupted_corpora  # noqa: E402  (the corrupted copies the tests read)

from hf_diloco.launch import free_port
from hf_diloco.metrics import read_syncs

HOOK = REPO / "tests" / "scripts" / "contribution_hook"
WORK = Path("/tmp/hf-diloco-bench-contributions")
H = 5
# SparseLoCo's outer step (docs/guides/slow-links.md): plain averaging of sparse values at outer lr 1, no momentum
SPARSE = ("--compression", "sparse", "--error_feedback", "true", "--error_feedback_decay", "0.95", "--outer_lr", "1",
          "--outer_momentum", "0")
FAULTS = {  # name: (data, hook environment, the faulty replica, more launch arguments)
    "garbage": ("garbage", {}, 0, ()),
    "garbage, sparse codec": ("garbage", {}, 0, SPARSE),
    "permuted": ("permuted-third", {}, 0, ()),
    "lr x100": ("clean", {"CONTRIBUTION_HOOK_LR": "100", "CONTRIBUTION_HOOK_RANK": "1"}, 1, ()),
    "scaled x3": ("clean", {"CONTRIBUTION_HOOK_SCALE": "3", "CONTRIBUTION_HOOK_RANK": "1"}, 1, ()),
    "sign flip": ("clean", {"CONTRIBUTION_HOOK_SCALE": "-1", "CONTRIBUTION_HOOK_RANK": "1"}, 1, ()),
}


def launch(out: Path, data: Path, rounds: int, hook: dict[str, str], checks: str, extra=()) -> list[dict]:
    """One run's records; a run this invocation's folder already holds whole (its summary written) is read back
    (`--resume`)."""
    if (out / "diloco_summary.json").exists():
        print(f"  {out.name}: read back", flush=True)
        return read_syncs(out)
    steps = rounds * H
    command = [sys.executable, "-m", "hf_diloco.cli", "launch", "recipes/tiny-pretrain.yaml", "--accelerate-config",
               "accelerate_configs/cpu-4proc.yaml", "--num_processes", "3", "--port", str(free_port()), "--",
               "--max_steps", str(steps), "--inner_steps", str(H), "--block_size", "32",
               "--per_device_train_batch_size", "4", "--eval_strategy", "steps", "--eval_steps", str(10 * H),
               "--eval_on_start", "false", "--save_every_rounds", "0", "--disable_tqdm", "true", "--report_to", "none",
               "--data_sharding", "non_iid", "--dataset_name", str(data), "--contribution_checks", checks,
               "--output_dir", str(out), *extra]
    started = time.time()
    result = subprocess.run(command, cwd=REPO, env=run_env(1, PYTHONPATH=str(HOOK), **hook), capture_output=True,
                            text=True)
    if result.returncode != 0:
        raise SystemExit(f"benchmark run failed: {' '.join(command)}\n{result.stderr[-3000:]}")
    print(f"  {out.name}: {time.time() - started:.0f} s", flush=True)
    return read_syncs(out)


def evals(records: list[dict]) -> dict[int, float]:
    return {r["round"]: r["eval_loss"] for r in records if r.get("eval_loss") is not None}


def recovery(run: dict[int, float], reference: dict[int, float]) -> int | None:
    """The first evaluated round from which `run` stays within 2% of `reference`."""
    rounds = sorted(set(run) & set(reference))
    for i, r in enumerate(rounds):
        if all(run[s] <= 1.02 * reference[s] for s in rounds[i:]):
            return r
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="20 rounds a run, cost repeated twice")
    parser.add_argument("--resume", action="store_true",
                        help="read back the runs an interrupted invocation finished instead of running them again")
    args = parser.parse_args()
    rounds, repeats = (20, 2) if args.quick else (80, 3)
    began = time.time()
    work = work_folder(WORK, args.quick, args.resume)
    data = corrupted_corpora(work / "data")
    references: dict[tuple[str, int], list[dict]] = {}
    rows, raw = [], {"rounds": rounds, "inner_steps": H, "faults": {}, "cost": {}}
    curves = {}
    for name, (corpus, hook, faulty, extra) in FAULTS.items():
        print(f"{name}:", flush=True)
        key = (corpus, faulty, extra)
        if key not in references:
            references[key] = launch(work / f"without-{corpus}-{faulty}{'-sparse' if extra else ''}", data[corpus],
                                     rounds, {"CONTRIBUTION_HOOK_LEAVE_OUT": str(faulty)}, "exclude", extra)
        slug = name.replace(" ", "-").replace(",", "")
        checked = launch(work / f"{slug}-checks", data[corpus], rounds, hook, "exclude", extra)
        unchecked = launch(work / f"{slug}-off", data[corpus], rounds, hook, "off", extra)
        reference = evals(references[key])
        left_out = [r["round"] for r in checked if any(e["replica"] == faulty for e in r["excluded"])]
        healthy_out = sum(1 for r in checked for e in r["excluded"] if e["replica"] != faulty)
        with_checks, without_checks = evals(checked), evals(unchecked)
        last = max(reference)
        back = [recovery(with_checks, reference), recovery(without_checks, reference)]
        rows.append([name, f"{with_checks[last]:.4f}", f"{without_checks[last]:.4f}", f"{reference[last]:.4f}",
                     *[str(b) if b is not None else "never" for b in back],
                     f"{len(left_out)} of {len(checked)} (first: {min(left_out) if left_out else '-'})",
                     healthy_out])
        raw["faults"][name] = {"with_checks": with_checks, "without_checks": without_checks, "reference": reference,
                               "left_out_rounds": left_out, "healthy_left_out": healthy_out,
                               "recovery": back}
        curves[name] = (with_checks, without_checks, reference)
    print("cost:", flush=True)
    waits = {"exclude": [], "off": []}
    sent, false_alarms, clean_contributions = {}, 0, 0
    for repeat in range(repeats):
        for checks in ("exclude", "off"):
            records = launch(work / f"cost-{checks}-{repeat}", data["clean"], rounds, {}, checks)
            waits[checks].append(statistics.median(r["blocked_seconds"] for r in records))
            sent[checks] = statistics.median(r["bytes_per_replica"] for r in records)
            if checks == "exclude":  # false alarms: contributions of a clean run left out
                false_alarms += sum(len(r["excluded"]) for r in records)
                clean_contributions += sum(len(r["replicas"]) for r in records)
    extra = sent["exclude"] - sent["off"]
    cost = [["bytes a replica sends per sync", f"{sent['exclude']:,.0f}", f"{sent['off']:,.0f}", f"{extra:+,.0f}"],
            ["seconds a sync keeps the inner loop waiting", show(spread(waits["exclude"]), "{:.4f}"),
             show(spread(waits["off"]), "{:.4f}"),
             f"{statistics.median(waits['exclude']) - statistics.median(waits['off']):+.4f}"],
            ["the extra bytes' time on a 1 Gbit/s link (bound)", "", "", f"{extra * 8 / 1e9:.2e} s"],
            ["clean contributions left out (false alarms)", f"{false_alarms} of {clean_contributions}", "", ""]]
    raw["cost"] = {"bytes": sent, "blocked_seconds": {k: spread(v) for k, v in waits.items()},
                   "false_alarms": false_alarms, "clean_contributions": clean_contributions}
    table = (f"### Faults, 3 replicas, {rounds} rounds of H = {H} (held-out loss every 10 rounds)\n\n"
             + markdown_table(["fault", "held-out loss, checks", "no checks", "without the replica",
                               "rounds to recovery, checks", "no checks", "faulty replica left out (syncs)",
                               "healthy ones left out"], rows)
             + f"\n\n### What the checks cost a sync (clean run, {repeats} interleaved repeats each)\n\n"
             + markdown_table(["", "checks", "off", "difference"], cost))
    figure = curve_panels({name: [(reference, "without the replica", "#222"), (unchecked, "no checks", "#d62728"),
                                  (checked, "checks", "#1f77b4")]
                           for name, (checked, unchecked, reference) in curves.items()}, "round", "held-out loss")
    save("contributions", table, raw, figure, quick=args.quick, seconds=time.time() - began)


if __name__ == "__main__":
    main()
