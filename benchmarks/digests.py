"""Digests of a fixed set of short runs, to prove that a refactor of the round engine changes no numbers.

Each case is a short run of the tiny-pretrain task (recipes/tiny-pretrain.yaml, or the recipe it names) launched
the way users launch it (`accelerate launch ... -m hf_diloco.cli train`, or `hf_diloco.cli launch --replicas N`
for torchft), one run at a time. Per case the JSON holds:

- param_digest: SHA-256 of the final saved model's parameters (benchmarks/common.py `parameter_hash`, copied);
- records_digest: SHA-256 of every record of `<output_dir>/syncs.jsonl` (sync_rounds.jsonl before; torchft: of each
  replica's, in replica order) with the wall-clock keys removed at every depth (TIMING_KEYS and any key ending in
  "seconds", see `deterministic_view`), serialised as canonical JSON (sorted keys);
- bytes_per_replica: the sum of the records' bytes_per_replica (and the summary's, and the startup bytes);
- records: the number of records; record_keys: every key seen (nested ones as parent.child); hashed_keys: those
  that went into the digest; excluded_keys: those left out;
- the τ choices of sync_delay auto, the seconds the case took, which hf_diloco the launched processes imported.

The kill-and-heal case is not deterministic (where the kill lands depends on timing): it records whether both
replicas end with bit-identical parameters, the last round, the committed round count and whether the killed
replica healed.

Usage (the tree to run is --repo, default the tree holding this file; it runs with PYTHONPATH=<repo> and its
folder as cwd, so `hf_diloco` is imported from that tree even when the venv holds an editable install of another):

    python benchmarks/digests.py --repo /work/baseline --out /work/digests/before.json
    python benchmarks/digests.py --out /work/digests/after.json            # this tree
    python benchmarks/digests.py --compare /work/digests/before.json /work/digests/after.json \
        [--repeat /work/digests/before-2.json]                             # the markdown table
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def parameter_hash(model_dir: Path) -> str:
    """SHA-256 over a saved model's parameters (names, shapes, fp32 bytes), in the model's order: the same function
    as benchmarks/common.py `parameter_hash` at b626ad5, copied so that this harness imports nothing of the tree
    it measures (common.py imports hf_diloco, which may be mid-refactor)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(f"{name}{tuple(param.shape)}".encode())
        digest.update(param.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


# Keys of a round record that hold wall-clock measurements (left out of records_digest at every depth), beside any
# key ending in "seconds" (sync_seconds, blocked_seconds, compute_seconds, replica_compute_seconds, quorum_seconds,
# exchange_seconds, step_seconds, ...).
TIMING_KEYS = {"time", "tokens_per_second"}

# Settings every case shares: no evaluation, no round checkpoints, no reporting, no progress bars.
COMMON = ["--eval_strategy", "no", "--eval_on_start", "false", "--save_every_rounds", "0", "--report_to", "none",
          "--disable_tqdm", "true", "--logging_steps", "10"]
SHORT = ["--max_steps", "100", "--inner_steps", "20"]  # 5 rounds (25 fragment syncs with 5 fragments)
STREAM = ["--compression", "int4", "--error_feedback", "true", "--num_fragments", "5"]

# name -> (kind, accelerate config, recipe, overrides). kind: "torch" (one accelerate launch), "torchft" (hf-diloco
# launch --replicas 2 with its own Lighthouse), "kill-heal" (the same, replica 1 killed mid-run and restarted).
CASES: dict[str, tuple[str, str, str, list[str]]] = {
    "torch-fp32": ("torch", "cpu-2proc.yaml", "tiny-pretrain.yaml", SHORT),
    "torch-int4-ef-stream-tau-auto": ("torch", "cpu-2proc.yaml", "tiny-pretrain.yaml",
                                      [*SHORT, *STREAM, "--sync_delay", "auto"]),
    "torch-int4-ef-stream-tau-fixed": ("torch", "cpu-2proc.yaml", "tiny-pretrain.yaml",
                                       [*SHORT, *STREAM, "--sync_delay", "2"]),
    "torch-sparse-ef": ("torch", "cpu-2proc.yaml", "sparseloco.yaml", SHORT),
    "torch-ddp-inside-2x2": ("torch", "cpu-4proc.yaml", "tiny-pretrain.yaml",
                             ["--max_steps", "60", "--inner_steps", "10", "--replica_group_size", "2"]),
    "torch-fsdp2-2x2": ("torch", "cpu-fsdp-2x2.yaml", "fsdp-replicas.yaml",
                        ["--max_steps", "60", "--inner_steps", "10"]),
    "torchft-fp32": ("torchft", "torchft-replica.yaml", "tiny-pretrain.yaml", [*SHORT, "--min_replicas", "2"]),
    "torchft-int4-ef-stream": ("torchft", "torchft-replica.yaml", "tiny-pretrain.yaml",
                               [*SHORT, *STREAM, "--sync_delay", "2", "--min_replicas", "2"]),
    # tests/test_torchft.py test_launch_replicas_of_several_processes_restarts_one_whose_member_was_killed, with
    # replicas of one process: 2 replicas, min_replicas 1, --max-restarts 1; replica 1's training process is
    # SIGKILLed once both have trained in a round at or after KILL_ROUND (so that the kill lands mid-run, not in
    # the start-up heals); the launcher starts it again, it heals from replica 0 and takes part again.
    "torchft-kill-heal": ("kill-heal", "torchft-replica.yaml", "tiny-pretrain.yaml",
                          ["--max_steps", "600", "--inner_steps", "10", "--block_size", "32",
                           "--per_device_train_batch_size", "4", "--sync_grace_seconds", "3", "--min_replicas", "1"]),
}
TIMEOUT = {"torch": 300, "torchft": 300, "kill-heal": 420}
KILL_ROUND = 10
# Cases whose digests differed between the baseline's two runs (/work/digests/README.txt): --compare marks them
# "n/a" instead of failing. τ auto picks each fragment's delay from measured exchange times, so the parameters,
# the records and even the record count follow the machine's load.
NONDETERMINISTIC = {"torch-int4-ef-stream-tau-auto": "τ auto follows measured timings"}


# --- runs ---------------------------------------------------------------------------------------------------------


def free_port() -> int:
    """A free local TCP port (its own copy, as parameter_hash: this harness imports nothing of the tree it runs)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_env(repo: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


class Watch:
    """Samples the launched process tree: the (cwd, PYTHONPATH) of every process running hf_diloco.cli, so the
    JSON says which tree the training processes imported (`python -m` puts the cwd first on sys.path)."""

    def __init__(self, pid: int):
        self.pid, self.seen, self.stopped = pid, set(), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import psutil

        while not self.stopped.is_set():
            try:
                tree = psutil.Process(self.pid).children(recursive=True)
            except psutil.Error:
                return
            for process in tree:
                try:
                    if "hf_diloco.cli" in process.cmdline():
                        self.seen.add((process.cwd(), process.environ().get("PYTHONPATH", "")))
                except psutil.Error:
                    pass
            self.stopped.wait(1.0)

    def stop(self) -> list[list[str]]:
        self.stopped.set()
        self.thread.join(timeout=5)
        return sorted([list(item) for item in self.seen])


def start(command: list[str], repo: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen(command, cwd=repo, env=run_env(repo), stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def end_group(process: subprocess.Popen) -> None:
    """SIGKILL the session we started (the launcher and everything under it), if still there."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


def wait(process: subprocess.Popen, timeout: float, log: Path) -> None:
    try:
        code = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        end_group(process)
        raise RuntimeError(f"timed out after {timeout:.0f} s:\n{log.read_text()[-3000:]}") from None
    if code != 0:
        raise RuntimeError(f"exit status {code}:\n{log.read_text()[-3000:]}")


def torch_command(config: str, recipe: str, overrides: list[str], out: Path) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"accelerate_configs/{config}",
            "--main_process_port", str(free_port()), "-m", "hf_diloco.cli", "train", "--config", f"recipes/{recipe}",
            *overrides, *COMMON, "--output_dir", str(out)]


def torchft_command(config: str, recipe: str, overrides: list[str], out: Path, max_restarts: int) -> list[str]:
    return [sys.executable, "-m", "hf_diloco.cli", "launch", f"recipes/{recipe}", "--accelerate-config",
            f"accelerate_configs/{config}", "--replicas", "2", "--max-restarts", str(max_restarts),
            "--outer_backend", "torchft", *overrides, *COMMON, "--output_dir", str(out)]


def training_pid(out: Path, replica: int) -> int | None:
    """The pid of torchft replica `replica`'s training process (not its accelerate launcher), as tests/helpers.py."""
    import psutil

    for process in psutil.process_iter(["cmdline"]):
        argv = process.info["cmdline"] or []
        if "hf_diloco.cli" in argv and "train" in argv and "accelerate.commands.launch" not in argv \
                and str(out / f"replica-{replica}") in argv:
            return process.pid
    return None


def read_records(folder: Path) -> list[dict]:
    path = folder / "syncs.jsonl"
    if not path.exists():
        path = folder / "sync_rounds.jsonl"  # the file's name before syncs.jsonl
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_case(name: str, repo: Path, work: Path) -> dict:
    kind, config, recipe, overrides = CASES[name]
    out, log = work / name, work / f"{name}.log"
    shutil.rmtree(out, ignore_errors=True)
    started = time.monotonic()
    extra: dict = {}
    if kind == "torch":
        process = start(torch_command(config, recipe, overrides, out), repo, log)
        watch = Watch(process.pid)
        try:
            wait(process, TIMEOUT[kind], log)
        finally:
            imported = watch.stop()
        folders = [out]
    else:
        process = start(torchft_command(config, recipe, overrides, out, 1 if kind == "kill-heal" else 0), repo, log)
        watch = Watch(process.pid)
        try:
            if kind == "kill-heal":
                extra = kill_replica_1(process, out, log)
            wait(process, TIMEOUT[kind], log)
        finally:
            imported = watch.stop()
            end_group(process)
        folders = [out / "replica-0", out / "replica-1"]
    seconds = time.monotonic() - started
    result = {"kind": kind, "command_overrides": [*overrides, *COMMON], "accelerate_config": config,
              "recipe": recipe, "seconds": round(seconds, 1), "imported_from": imported, **extra}
    result.update(summarise(folders, kind, log))
    if kind == "kill-heal":
        result["healed_after_kill"] = any(r > result["killed_after_round"] for r in result["rounds_replica_1_healed"])
    return result


def trained_in(record: dict, replica: int) -> bool:
    """Whether `replica` contributed to this round: a participating member with a weight (a healing one has 0)."""
    return any(m.get("replica") == replica and m.get("participated", True) and m.get("weight", 1) > 0
               for m in record.get("replicas", record.get("members", [])))


def kill_replica_1(process: subprocess.Popen, out: Path, log: Path) -> dict:
    """Once both replicas have trained in a round at or after KILL_ROUND, SIGKILL replica 1's training process (the
    launcher restarts it and it heals from replica 0)."""
    deadline = time.monotonic() + 180
    while not any(r["round"] >= KILL_ROUND and trained_in(r, 0) and trained_in(r, 1)
                  for r in read_records(out / "replica-0")):
        if process.poll() is not None or time.monotonic() > deadline:
            end_group(process)
            raise RuntimeError(f"no round of both replicas to kill after:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    pid = training_pid(out, 1)
    if pid is None:
        raise RuntimeError("replica 1's training process was not found")
    killed_after_round = max((r["round"] for r in read_records(out / "replica-0")), default=0)
    os.kill(pid, signal.SIGKILL)
    return {"killed_after_round": killed_after_round}


# --- digests ------------------------------------------------------------------------------------------------------


# Keys a comparison leaves out beside the timing ones (--exclude-keys): a record field whose value a change between
# the two trees moved on purpose (say so beside the table), so that everything else is still compared bit for bit.
LEFT_OUT: set[str] = set()


def is_timing(key: str) -> bool:
    return key in TIMING_KEYS or key in LEFT_OUT or key.endswith("seconds")


def deterministic_view(value, path: str = "", hashed: set | None = None, excluded: set | None = None):
    """`value` with the timing keys removed at every depth; the dotted key paths kept and dropped are collected."""
    if isinstance(value, dict):
        kept = {}
        for key, item in value.items():
            dotted = f"{path}.{key}" if path else key
            if is_timing(key):
                excluded.add(dotted)
            else:
                hashed.add(dotted)
                kept[key] = deterministic_view(item, dotted, hashed, excluded)
        return kept
    if isinstance(value, list):
        return [deterministic_view(item, path, hashed, excluded) for item in value]
    return value


# Record keys renamed when a sync and a round got separate names: a record is hashed under the older names, so
# digests taken before and after compare. Before, `round` held what `sync` holds now (the sync's number); the
# whole round it belongs to, ceil(sync / F), was not recorded. `replicas` (a row per replica of the sync) was
# `members`, a name that now means the processes of one replica.
RENAMED_KEYS = {"sync": "round", "sync_steps": "round_steps", "agreement_sync": "agreement_round",
                "replicas": "members"}


def under_older_names(record: dict) -> dict:
    if "sync" not in record:  # written before the split
        return record
    return {RENAMED_KEYS.get(key, key): value for key, value in record.items() if key != "round"}


def summarise(folders: list[Path], kind: str, log: Path) -> dict:
    hashed, excluded = set(), set()
    digest = hashlib.sha256()
    per_replica = []
    for folder in folders:
        records = read_records(folder)
        per_replica.append(records)
        for record in records:
            view = deterministic_view(under_older_names(record), "", hashed, excluded)
            digest.update(json.dumps(view, sort_keys=True, separators=(",", ":")).encode())
            digest.update(b"\n")
        digest.update(b"--\n")
    first = per_replica[0]
    summary_file = folders[0] / "diloco_summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    params = [parameter_hash(folder) for folder in folders]
    result = {
        "param_digest": params[0],
        "replica_param_digests": params,
        "replicas_identical": len(set(params)) == 1,
        "records_digest": digest.hexdigest(),
        "records": [len(r) for r in per_replica] if len(per_replica) > 1 else len(first),
        "bytes_per_replica": sum(r.get("bytes_per_replica", 0) for r in first),
        "summary_bytes_per_replica": summary.get("bytes_per_replica"),
        "startup_bytes": sum(r.get("startup_bytes", 0) for r in first),
        "last_round": first[-1]["round"] if first else None,
        "last_step": first[-1]["step"] if first else None,
        "record_keys": sorted(hashed | excluded),
        "hashed_keys": sorted(hashed),
        "excluded_keys": sorted(excluded),
    }
    tau = [[r["round"], r["sync_delay_auto"].get("fragments"), r["sync_delay_auto"].get("chosen")]
           for r in first if "sync_delay_auto" in r]
    if tau:
        result["sync_delay_auto_choices"] = tau
    if kind != "torch":
        result["committed_rounds"] = sum(1 for r in first if r.get("committed"))
        result["participants"] = [r.get("participants") for r in first]
    if kind == "kill-heal":
        text = log.read_text()
        result["healed"] = "healed from a live peer" in text
        result["restarted"] = "replica 1 exited with status" in text and "starting it again" in text
        result["rounds_without_replica_1"] = [r["round"] for r in first if not trained_in(r, 1)]
        result["rounds_replica_1_healed"] = [
            r["round"] for r in first
            if any(m.get("replica") == 1 and m.get("healed") for m in r.get("replicas", r.get("members", [])))]
        result["replica_1_trained_after_heal"] = any(
            trained_in(r, 1) for r in first if r["round"] > max(result["rounds_replica_1_healed"] or [1 << 30]))
    return result


# --- compare ------------------------------------------------------------------------------------------------------


def short(value) -> str:
    return value[:12] if isinstance(value, str) else str(value)


def compare(before_file: str, after_file: str, repeat_file: str | None) -> int:
    before = json.loads(Path(before_file).read_text())["cases"]
    after = json.loads(Path(after_file).read_text())["cases"]
    repeat = json.loads(Path(repeat_file).read_text())["cases"] if repeat_file else {}
    keys = ("param_digest", "records_digest", "bytes_per_replica")
    rows = ["| case | param digest before | after | records digest before | after | bytes before | after | same? |",
            "|---|---|---|---|---|---|---|---|"]
    differs = 0
    for name in [*before, *[n for n in after if n not in before]]:
        b, a = before.get(name), after.get(name)
        if not b or not a or "error" in b or "error" in a:
            rows.append(f"| {name} | {short((b or {}).get('param_digest', (b or {}).get('error', 'missing')))} | "
                        f"{short((a or {}).get('param_digest', (a or {}).get('error', 'missing')))} | | | | | "
                        f"NO ({'not run on one side' if not b or not a else 'a run failed'}) |")
            differs += 1
            continue
        if b.get("kind") == "kill-heal":
            # Not deterministic: the invariants, not the digests, must hold on both sides.
            ok = all(x.get("replicas_identical") and x.get("healed_after_kill") for x in (a, b)) \
                and a.get("last_round") == b.get("last_round")
            same = f"{'yes' if ok else 'NO'} (invariants: replicas identical {b.get('replicas_identical')} / " \
                   f"{a.get('replicas_identical')}, healed after the kill {b.get('healed_after_kill')} / " \
                   f"{a.get('healed_after_kill')}, last round " \
                   f"{b.get('last_round')} / {a.get('last_round')}, committed {b.get('committed_rounds')} / " \
                   f"{a.get('committed_rounds')})"
        else:
            equal = all(b[k] == a[k] for k in keys)
            unstable = [k for k in keys if name in repeat and "error" not in repeat[name] and repeat[name][k] != b[k]]
            if equal:
                same = "yes"
            elif unstable or name in NONDETERMINISTIC:
                why = NONDETERMINISTIC.get(name) or f"the baseline's repeat differs too in {', '.join(unstable)}"
                same = f"n/a (not deterministic: {why})"
            else:
                same = "NO (" + ", ".join(k for k in keys if b[k] != a[k]) + ")"
        differs += same.startswith("NO")
        rows.append(f"| {name} | {short(b['param_digest'])} | {short(a['param_digest'])} | "
                    f"{short(b['records_digest'])} | {short(a['records_digest'])} | {b['bytes_per_replica']} | "
                    f"{a['bytes_per_replica']} | {same} |")
    print("\n".join(rows))
    return 1 if differs else 0


# --- main ---------------------------------------------------------------------------------------------------------


def git(repo: Path, *args: str) -> str:
    result = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)
    return result.stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", default=str(HERE), help="the tree to run (default: the one holding this file)")
    parser.add_argument("--out", help="the JSON file to write")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated (default all: {','.join(CASES)})")
    parser.add_argument("--keep", help="keep the run folders and logs in this folder (default: a temp folder, removed)")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="print the comparison table")
    parser.add_argument("--repeat", help="with --compare: the baseline's repeat, to mark digests that vary run to run")
    parser.add_argument("--exclude-keys", default="", help="comma-separated record keys left out of the records "
                        "digest beside the timing ones (a field the trees compared changed on purpose)")
    args = parser.parse_args()
    LEFT_OUT.update(k.strip() for k in args.exclude_keys.split(",") if k.strip())
    if args.compare:
        return compare(*args.compare, args.repeat)
    if not args.out:
        parser.error("--out is required (or --compare)")
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES)}")
    repo = Path(args.repo).resolve()
    work = Path(args.keep).resolve() if args.keep else Path(tempfile.mkdtemp(prefix="hf-diloco-digests-"))
    work.mkdir(parents=True, exist_ok=True)
    probe = subprocess.run([sys.executable, "-c", "import hf_diloco; print(hf_diloco.__file__)"], cwd=repo,
                           env=run_env(repo), capture_output=True, text=True)
    result = {"repo": str(repo), "head": git(repo, "rev-parse", "HEAD"),
              "dirty_files": git(repo, "status", "--porcelain").splitlines(), "python": sys.executable,
              "hf_diloco_file": probe.stdout.strip() or probe.stderr.strip()[-500:],
              "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "timing_keys": sorted(TIMING_KEYS), "timing_rule": "keys in timing_keys or ending in 'seconds'",
              "left_out_keys": sorted(LEFT_OUT),
              "cases": {}}
    print(f"hf_diloco from {result['hf_diloco_file']}", flush=True)
    out_file = Path(args.out)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    try:
        for name in cases:
            print(f"{name} ...", flush=True)
            try:
                case = run_case(name, repo, work)
            except Exception as error:  # one failed case must not lose the others
                case = {"error": str(error)[-3000:]}
            result["cases"][name] = case
            print(f"  {short(case.get('param_digest', 'ERROR'))} {short(case.get('records_digest', ''))} "
                  f"bytes {case.get('bytes_per_replica')} records {case.get('records')} "
                  f"{case.get('seconds', '')} s", flush=True)
            if "error" in case:
                print(case["error"][-1500:], flush=True)
            out_file.write_text(json.dumps(result, indent=2) + "\n")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {out_file}")
    return 1 if any("error" in c for c in result["cases"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
