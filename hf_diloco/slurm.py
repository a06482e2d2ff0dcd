"""`hf-diloco slurm`: the SLURM batch script of a recipe, checked, written (and with `--submit`, submitted) from one
place: `check_job` runs the checks `hf-diloco launch` makes, `write` the script, `submit` hands it to sbatch.

torch backend: one job of N nodes. srun starts one `accelerate launch` per node, machine rank = SLURM_NODEID; the
nodes meet at the job's first node (or `main_address`) on `port`.

torchft backend: one job array per site. Without a Lighthouse URL, array task 0 runs the Lighthouse on its node and
writes its address into `<output_dir>/slurm/`, a folder the nodes share (clusters share their home and project
filesystems); tasks 1..R are replicas `first_replica` .. `first_replica + R - 1`, which read that address. Task 0
stays until the replicas' tasks have ended. A second site submits its own array with `--lighthouse URL` (the first
site's address, printed in its log) and its own `--first-replica`, so replica ids stay unique.

Design choices:
- The script is the only shell text hf-diloco writes. Every word that comes from the user is shell-quoted; the
  shell expands only SLURM's variables and the node's host name. `--submit` runs `sbatch SCRIPT` as an argument list.
- A run over nodes listens on the network by nature: the rendezvous port on the first node (torch), or the
  Lighthouse, each replica's torchft ports and its healing server (torchft). The node's host name must resolve to
  an address the other nodes reach; docs/guides/across-machines.md (Ports) says which ports to open.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ConfigError, first_line

SCRIPT_NAME = "job.sbatch"


@dataclass
class Job:
    """What `hf-diloco slurm` was asked for; `sbatch` holds extra `#SBATCH` options (partition, time, ...)."""

    recipe: str
    accelerate_config: str
    overrides: list[str]
    output_dir: str
    job_name: str = "hf-diloco"
    nodes: int = 1
    processes_per_node: int = 1
    port: int = 29500
    main_address: str = ""
    replicas: int = 0  # torchft: this site's replicas (0: the torch backend)
    first_replica: int = 0
    total_replicas: int = 0
    lighthouse: str = ""
    min_replicas: int = 1
    grace_seconds: float = 5.0
    sbatch: dict = field(default_factory=dict)
    python: str = sys.executable

    @property
    def folder(self) -> str:
        """Where the script, the job's logs and the Lighthouse address go."""
        return f"{self.output_dir}/slurm"


def _words(words: list[str]) -> str:
    return " ".join(shlex.quote(str(word)) for word in words)


def _header(job: Job, nodes: int, array: str | None) -> list[str]:
    log = f"{job.folder}/slurm-%A_%a.log" if array else f"{job.folder}/slurm-%j.log"
    options = {"job-name": job.job_name, "nodes": nodes, "ntasks-per-node": 1, "output": log, **job.sbatch}
    if array:
        options["array"] = array
    return ["#!/bin/bash", *(f"#SBATCH --{key}={shlex.quote(str(value))}" for key, value in options.items()
                             if value not in (None, "")), "set -euo pipefail"]


def _launch(job: Job) -> list[str]:
    return [job.python, "-m", "hf_diloco.accelerate_launch", "--config_file", job.accelerate_config]


def _train(job: Job) -> list[str]:
    return ["-m", "hf_diloco.cli", "train", "--config", job.recipe, *job.overrides]


def torch_script(job: Job) -> str:
    """One job of `job.nodes` nodes with `job.processes_per_node` processes each."""
    main = shlex.quote(job.main_address) if job.main_address else \
        '"$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"'
    launch = [*_launch(job), "--num_machines", str(job.nodes),
              "--num_processes", str(job.nodes * job.processes_per_node), "--main_process_port", str(job.port)]
    train = [*_train(job), "--output_dir", job.output_dir]
    # srun runs this on every node: the static words arrive as arguments, the node fills in its rank.
    per_node = (f'exec "${{@:1:{len(launch)}}}" --machine_rank "$SLURM_NODEID" '
                f'--main_process_ip "$HF_DILOCO_MAIN_ADDRESS" "${{@:{len(launch) + 1}}}"')
    return "\n".join([
        *_header(job, job.nodes, None),
        f"# hf-diloco slurm: {job.nodes} node(s) x {job.processes_per_node} process(es), one accelerate launch per "
        f"node; they meet at the main node on port {job.port}.",
        f"export HF_DILOCO_MAIN_ADDRESS={main}",
        'echo "[hf-diloco slurm] job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, main node $HF_DILOCO_MAIN_ADDRESS"',
        f"srun --kill-on-bad-exit=1 --ntasks-per-node=1 bash -c {shlex.quote(per_node)} node \\",
        f"  {_words(launch)} \\",
        f"  {_words(train)}",
        "",
    ])


def torchft_script(job: Job) -> str:
    """A job array: the Lighthouse (task 0, unless `job.lighthouse` names one) and one task per replica."""
    total = job.total_replicas or job.first_replica + job.replicas
    url_file = f'{shlex.quote(job.folder + "/lighthouse-")}"$SLURM_ARRAY_JOB_ID".url'  # one per array job
    own = not job.lighthouse
    first_task = 1 if own else 0
    launch = _launch(job)
    port = ['--main_process_port "$((HF_DILOCO_PORT + REPLICA))"'] if job.processes_per_node > 1 else []
    lines = [
        *_header(job, 1, f"{0 if own else first_task}-{job.replicas - 1 + first_task}"),
        f"# hf-diloco slurm: torchft replicas {job.first_replica}..{job.first_replica + job.replicas - 1} of {total}"
        + (", array task 0 runs their Lighthouse." if own else f", joining the Lighthouse at {job.lighthouse}."),
        f"HF_DILOCO_PORT={job.port}",
    ]
    if own:
        lighthouse = [job.python, "-m", "hf_diloco.cli", "lighthouse", "--port", str(job.port),
                      "--min-replicas", str(job.min_replicas), "--grace-seconds", f"{job.grace_seconds:g}"]
        lines += [
            'if [ "$SLURM_ARRAY_TASK_ID" = 0 ]; then',
            '  HOST="$(hostname)"',
            f'  {_words(lighthouse)} --host "$HOST" &',
            "  SERVER=$!",
            f'  (umask 077; echo "http://$HOST:$HF_DILOCO_PORT" > {url_file})',
            '  echo "[hf-diloco slurm] Lighthouse on http://$HOST:$HF_DILOCO_PORT"',
            "  # The Lighthouse stays while any replica task of this array is pending or running.",
            '  while squeue -h -r -j "$SLURM_ARRAY_JOB_ID" -o %K | grep -qvx 0; do sleep 5; done',
            '  kill "$SERVER"; exit 0',
            "fi",
            f"while [ ! -s {url_file} ]; do sleep 1; done",
            # The address is taken only from a file of this user's: another user who can write in the folder
            # could otherwise point every replica at a Lighthouse of theirs.
            f"if [ ! -O {url_file} ]; then",
            f'  echo "[hf-diloco slurm] "{url_file}" belongs to another user: not joining the Lighthouse it'
            ' names." >&2',
            "  exit 1",
            "fi",
            f'HF_DILOCO_LIGHTHOUSE="$(cat {url_file})"',
        ]
    else:
        lines.append(f"HF_DILOCO_LIGHTHOUSE={shlex.quote(job.lighthouse)}")
    replica = f"$((SLURM_ARRAY_TASK_ID - {first_task} + {job.first_replica}))"
    lines += [
        f"REPLICA={replica}",
        'echo "[hf-diloco slurm] replica $REPLICA on $(hostname), Lighthouse $HF_DILOCO_LIGHTHOUSE"',
        f"exec {_words(launch)} {' '.join(port)} \\",
        f"  {_words(_train(job))} \\",
        f'  --outer_backend torchft --replica_id "$REPLICA" --num_replicas {total} '
        f'--lighthouse "$HF_DILOCO_LIGHTHOUSE" \\',
        f'  --output_dir {shlex.quote(job.output_dir + "/replica-")}"$REPLICA" --replica_address "$(hostname)"',
        "",
    ]
    return "\n".join(lines)


def script(job: Job) -> str:
    return torchft_script(job) if job.replicas else torch_script(job)


# --- checking, writing and submitting -------------------------------------------------------------------------------


def check_job(run, config, accelerate_config: str, nodes: int, replicas: int, first_replica: int) -> int:
    """The checks `hf-diloco launch` makes before starting anything, for a job of `nodes` nodes (torch backend) or
    `replicas` array tasks (torchft); returns the processes each node starts. ConfigError in one sentence."""
    from . import train as training

    if nodes < 1 or replicas < 0 or first_replica < 0:
        raise ConfigError("--nodes must be 1 or more, --replicas and --first-replica 0 or more.")
    values = training.check_accelerate_config(accelerate_config, config)
    per_node = int(values.get("num_processes", 1) or 1) // int(values.get("num_machines", 1) or 1)
    torchft = config.outer_backend == "torchft"
    if torchft and not replicas:
        raise ConfigError("outer_backend torchft runs one job array task per replica: give --replicas N (this "
                          "site's).")
    if not torchft and replicas:
        raise ConfigError("--replicas is for outer_backend torchft; a torch-backend run's replicas are its processes "
                          "(--nodes times the accelerate config's processes per machine).")
    if torchft and nodes != 1:
        raise ConfigError("a torchft replica runs on one node (its replica_group_size processes); scale with "
                          "--replicas, not --nodes.")
    group = values["hf_diloco_layout"]["group"]  # replica_group_size, or the config's dp_shard_size × tp_size
    if torchft and per_node != group:
        raise ConfigError(f"outer_backend torchft starts one launch per replica of replica_group_size="
                          f"{group} process(es), but {accelerate_config!r} starts {per_node}; "
                          f"use accelerate_configs/torchft-replica.yaml (one process) or torchft-replica-2proc.yaml.")
    if not torchft:
        layout = training.check_accelerate_config(accelerate_config, config, processes=nodes * per_node,
                                                  machines=nodes, rank=0)["hf_diloco_layout"]
        if layout["note"]:
            print(f"hf-diloco: warning: {layout['note']}", file=sys.stderr, flush=True)
    training.check_arguments(run, config)
    training.check_output_dir(config)
    return per_node


def without_output_dir(overrides: list[str]) -> list[str]:
    """The recipe overrides less any --output_dir (the job is given its absolute output folder once, at the end).

    >>> without_output_dir(["--inner_steps", "5", "--output_dir", "out", "--output_dir=x", "--seed", "1"])
    ['--inner_steps', '5', '--seed', '1']
    """
    kept, skip = [], False
    for word in overrides:
        if skip or word.startswith("--output_dir="):
            skip = False
            continue
        skip = word == "--output_dir"
        if not skip:
            kept.append(word)
    return kept


def write(job: Job, target: str | Path | None = None) -> Path:
    """Write the job's script to `target` (default: <output_dir>/slurm/job.sbatch) and make the folder its logs go
    to; returns where it went."""
    target = Path(target) if target else Path(job.folder) / SCRIPT_NAME
    target.parent.mkdir(parents=True, exist_ok=True)
    Path(job.folder).mkdir(parents=True, exist_ok=True)
    target.write_text(script(job))
    return target


def submit(target: Path) -> str:
    """`sbatch` the script; the job id, or ConfigError in one sentence."""
    try:
        result = subprocess.run(["sbatch", "--parsable", str(target)], capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise ConfigError("sbatch is not on PATH; run `hf-diloco slurm --submit` on a SLURM login node, or submit "
                          f"{target} there.") from None
    if result.returncode != 0:
        raise ConfigError(f"sbatch refused the job: {first_line(result.stderr.strip() or result.stdout.strip())}.")
    return result.stdout.strip().split(";")[0]
