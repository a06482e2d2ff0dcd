"""Contribution checks where sites come and go: three torchft sites against one Lighthouse, started one by one.

    python benchmarks/contributions_sites.py           # 200 steps a faulty run, 800 for the clean one (about 9 min)
    python benchmarks/contributions_sites.py --quick   # 100 and 400 steps (about 5 min)

Every site is one `hf-diloco launch recipes/torchft-3.yaml --lighthouse URL --replica_id k --num_replicas 3
--max-restarts 3` (docs/guides/elastic.md), reading its own third of the built-in corpus (block 32, batch 4, H = 10,
held-out loss every 50 steps, `data_sharding non_iid`); a sync needs two sites and waits 3 s for the third. The
faulty site and a second one are started together, and the second goes quiet (SIGSTOP) as soon as it has joined;
the third is started once the faulty site trains, joins its first sync with no steps, and the quiet one comes back
(SIGCONT) once that sync is recorded: the faulty site's first contribution is merged alone, beside a site that
joined with no steps, as a site's first can be where sites start at different times (a quorum needs two).
Faults: the faulty site is given `--learning_rate 0.1` (100x the recipe's), or its third of the data is random
characters (`garbage`) or every character permuted (`permuted`). Each is set against the run without that
site: the other two sites alone, reading the same thirds.

The clean run has all three sites at the recipe's settings for 80 syncs, and site 1's training process is
SIGKILLed twice (a quarter and half-way in); its launch starts it again and it heals from the live sites. False
alarms: contributions of that run left out, counted on site 0's records (every site's records hold the same
verdicts).

Columns: held-out loss at the end on site 0's records (site 1's where site 0 is the faulty one), the faulty site's
syncs (those it brought steps to) and how many it was left out of, whether its first contribution was merged alone,
whether any of its contributions moved θ_global (merged with a weight above 0), and the healthy contributions left
out.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from common import REPO, curve_panels, markdown_table, run_env, save, work_folder

sys.path.insert(0, str(REPO / "tests"))
from helpers import corrupted_corpora, lighthouse, replica_training_pid  # noqa: E402  (what the tests start sites with)

from hf_diloco.metrics import read_syncs  # noqa: E402

WORK = Path("/tmp/hf-diloco-bench-contributions-sites")
H = 10
FAULTS = {  # name: (corpus, the faulty site, its own flags)
    "lr x100": ("clean", 2, ["--learning_rate", "0.1"]),
    "garbage": ("garbage", 0, []),
    "permuted": ("permuted-third", 0, []),
}


def start_site(out: Path, address: str, k: int, data: Path, steps: int, extra: list[str]) -> subprocess.Popen:
    """Site k, as docs/guides/elastic.md starts one on its own machine; its console in out/site-k.log."""
    command = [sys.executable, "-m", "hf_diloco.cli", "launch", "recipes/torchft-3.yaml", "--accelerate-config",
               "accelerate_configs/torchft-replica.yaml", "--lighthouse", address, "--replica_id", str(k),
               "--num_replicas", "3", "--replica_address", "127.0.0.1", "--max-restarts", "3", "--",
               "--max_steps", str(steps), "--inner_steps", str(H), "--block_size", "32",
               "--per_device_train_batch_size", "4", "--eval_strategy", "steps", "--eval_steps", "50",
               "--eval_on_start", "false", "--disable_tqdm", "true", "--report_to", "none", "--min_replicas", "2",
               "--sync_grace_seconds", "3", "--data_sharding", "non_iid", "--dataset_name", str(data),
               "--output_dir", str(out / f"replica-{k}"),
               *extra]
    return subprocess.Popen(command, cwd=REPO, env=run_env(1), stdout=(out / f"site-{k}.log").open("w"),
                            stderr=subprocess.STDOUT)


def sites(out: Path, data: Path, steps: int, order: list[int], extra: dict[int, list[str]],
          kills: tuple[int, ...] = (), alone: bool = False) -> dict[int, list[dict]]:
    """Sites `order` started one by one (4 s apart) against a fresh Lighthouse; site 1's training process killed
    once each of its records reaches a step in `kills`. `alone`: the first site's first contribution is brought
    alone (see the module's docstring). Site → its records."""
    out.mkdir(parents=True, exist_ok=True)
    if all((out / f"replica-{k}" / "diloco_summary.json").exists() for k in order):
        print(f"  {out.name}: read back", flush=True)
        return {k: read_syncs(out / f"replica-{k}") for k in order}
    started = time.time()
    with lighthouse(min_replicas=2, grace=3, log=out / "lighthouse.log") as address:
        launched = {}
        if alone:
            first, quiet, last = order
            launched = {k: start_site(out, address, k, data, steps, extra.get(k, [])) for k in (first, quiet)}
            wait_for_text(out / f"site-{quiet}.log", f"replica {quiet} joined at round 0")
            pid = replica_training_pid(out, quiet)
            os.kill(pid, signal.SIGSTOP)
            try:
                launched[last] = start_site(out, address, last, data, steps, extra.get(last, []))
                while not read_syncs(out / f"replica-{first}"):
                    time.sleep(0.1)
            finally:
                os.kill(pid, signal.SIGCONT)
        for k in order if not alone else []:
            launched[k] = start_site(out, address, k, data, steps, extra.get(k, []))
            time.sleep(4)
        killer = threading.Thread(target=kill_at, args=(out, kills), daemon=True)
        killer.start()
        for k, process in launched.items():
            if process.wait() != 0:
                raise SystemExit(f"site {k} of {out.name} failed:\n{(out / f'site-{k}.log').read_text()[-3000:]}")
    print(f"  {out.name}: {time.time() - started:.0f} s", flush=True)
    return {k: read_syncs(out / f"replica-{k}") for k in order}


def wait_for_text(path: Path, text: str, timeout: float = 300) -> None:
    """Until `text` is in the file at `path` (a site's console), polled every 20 ms."""
    end = time.time() + timeout
    while not (path.exists() and text in path.read_text()):
        if time.time() > end:
            raise SystemExit(f"{path.name}: no {text!r} after {timeout:.0f} s")
        time.sleep(0.02)


def kill_at(out: Path, steps: tuple[int, ...]) -> None:
    """SIGKILL site 1's training process once its records reach each of `steps` (its launch starts it again)."""
    for step in steps:
        while not any(r["step"] >= step for r in read_syncs(out / "replica-1")):
            time.sleep(0.2)
        pid = replica_training_pid(out, 1)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            print(f"  killed site 1 at step {step}", flush=True)


def committed(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("committed", True)]


def final_loss(records: list[dict]) -> float:
    return [r["eval_loss"] for r in committed(records) if r.get("eval_loss") is not None][-1]


def contributions(records: list[dict], site: int) -> list[tuple[int, float, bool, int]]:
    """(sync, weight, left out, participants bringing steps) of each committed sync `site` brought steps to."""
    found = []
    for r in committed(records):
        mine = [m for m in r["replicas"] if m["replica"] == site and m.get("steps", 0) > 0]
        if mine:
            bringing = sum(1 for m in r["replicas"] if m.get("steps", 0) > 0)
            found.append((r["sync"], mine[0]["weight"], any(e["replica"] == site for e in r["excluded"]), bringing))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="100 steps a faulty run, 400 for the clean one")
    parser.add_argument("--resume", action="store_true", help="read back the runs an interrupted invocation finished")
    args = parser.parse_args()
    steps, clean_steps = (100, 400) if args.quick else (200, 800)
    began = time.time()
    work = work_folder(WORK, args.quick, args.resume)
    data = corrupted_corpora(work / "data")
    rows, raw, curves = [], {"steps": steps, "clean_steps": clean_steps, "inner_steps": H, "faults": {}}, {}
    for name, (corpus, faulty, flags) in FAULTS.items():
        print(f"{name}:", flush=True)
        others = [k for k in range(3) if k != faulty]
        run = sites(work / name.replace(" ", "-"), data[corpus], steps, [faulty, *others], {faulty: flags},
                    alone=True)
        without = sites(work / f"without-{corpus}-{faulty}", data[corpus], steps, others, {})
        healthy = others[0]
        # Verdicts and weights are the same on every site's records; the faulty site's hold every sync it took part
        # in (the quiet site's and the late one's begin later).
        mine = contributions(run[faulty], faulty)
        merged = [weight for _sync, weight, _out, _n in mine if weight > 0]
        healthy_out = sum(len([e for e in r["excluded"] if e["replica"] != faulty]) for r in committed(run[faulty]))
        alone = bool(mine) and mine[0][3] == 1
        losses = (final_loss(run[healthy]), final_loss(without[healthy]))
        rows.append([name, f"site {faulty}", f"{losses[0]:.4f}", f"{losses[1]:.4f}",
                     f"{losses[0] / losses[1] - 1:+.1%}", f"{sum(out for *_x, out, _n in mine)} of {len(mine)}",
                     "yes" if alone else "no",
                     "yes" if merged else "no", healthy_out])
        raw["faults"][name] = {"site": faulty, "eval_loss": losses[0], "without": losses[1],
                               "contributions": mine, "first_alone": alone, "healthy_left_out": healthy_out}
        curves[name] = [{r["step"]: r["eval_loss"] for r in committed(records[healthy]) if r.get("eval_loss")}
                        for records in (run, without)]
    print("clean, with kills:", flush=True)
    clean = sites(work / "clean-kills", data["clean"], clean_steps, [0, 1, 2], {},
                  kills=(clean_steps // 4, clean_steps // 2))
    syncs = committed(clean[0])
    alarms = sum(len(r["excluded"]) for r in syncs)
    brought = sum(1 for r in syncs for m in r["replicas"] if m.get("steps", 0) > 0)
    healed = sum(1 for r in syncs for m in r["replicas"] if m.get("healed"))
    rows.append(["none (site 1 killed twice)", "-", f"{final_loss(syncs):.4f}", "-", "-", "-", "-", "-",
                 f"{alarms} of {brought}"])
    raw["clean"] = {"syncs": len(syncs), "contributions": brought, "false_alarms": alarms, "healed": healed,
                    "eval_loss": final_loss(syncs)}
    table = (f"### Three torchft sites started one by one, H = {H}: {steps} steps a faulty run, {clean_steps} "
             f"({len(syncs)} committed syncs on site 0) for the clean run with kills\n\n"
             + markdown_table(["fault", "faulty site", "held-out loss", "without the site", "difference",
                               "its contributions left out", "its first one alone", "any merged (moved θ_global)",
                               "healthy contributions left out"], rows))
    figure = curve_panels({name: [(reference, "without the site", "#222"), (faulty_run, "with it, checks on",
                                                                           "#1f77b4")]
                           for name, (faulty_run, reference) in curves.items()}, "step", "held-out loss")
    save("contributions-sites", table, raw, figure, quick=args.quick, seconds=time.time() - began)


if __name__ == "__main__":
    main()
