"""`hf-diloco slurm` against a real SLURM: a one-node cluster on this machine (Debian's slurmctld, slurmd and munge,
state and spool in a temp folder), to which the tests submit runs and from which they read the round records."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest
from helpers import REPO, env, free_port, wait_for

from hf_diloco.metrics import read_syncs

pytestmark = pytest.mark.process  # every test here starts processes

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A one-node SLURM cluster (controller and node daemon as root, auth by a munge daemon of its own); yields the
    environment that points SLURM's commands at it."""
    if not all(shutil.which(name) for name in DAEMONS):
        pytest.skip("SLURM is not installed (apt-get install slurmctld slurmd slurm-client munge; .ci/run does)")
    if os.getuid() != 0:
        pytest.skip("the test cluster's daemons run as root")
    folder = tmp_path_factory.mktemp("slurm")
    for name in ("state", "spool", "munge"):
        (folder / name).mkdir()
    key = folder / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    socket_path = folder / "munge" / "munge.sock"
    subprocess.run(["munged", "--force", f"--key-file={key}", f"--socket={socket_path}",
                    f"--pid-file={folder / 'munge' / 'munged.pid'}", f"--log-file={folder / 'munge' / 'munged.log'}",
                    f"--seed-file={folder / 'munge' / 'seed'}"], check=True, timeout=30)
    host = socket.gethostname().split(".")[0]
    conf = folder / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=hfdtest", f"SlurmctldHost={host}(127.0.0.1)", "SlurmUser=root", "SlurmdUser=root",
        "AuthType=auth/munge", f"AuthInfo=socket={socket_path}", "CredType=cred/munge",
        f"StateSaveLocation={folder / 'state'}", f"SlurmdSpoolDir={folder / 'spool'}",
        f"SlurmctldPidFile={folder / 'slurmctld.pid'}", f"SlurmdPidFile={folder / 'slurmd.pid'}",
        f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}", "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none", "SchedulerType=sched/builtin",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU", "ReturnToService=2", "MpiDefault=none",
        "MinJobAge=600", "SlurmdParameters=config_overrides",  # the node offers 8 CPUs whatever it has
        f"SlurmctldLogFile={folder / 'slurmctld.log'}", f"SlurmdLogFile={folder / 'slurmd.log'}",
        f"NodeName={host} NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN",
        "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP", ""]))
    environment = {**env(), "SLURM_CONF": str(conf)}
    for daemon in ("slurmctld", "slurmd"):
        subprocess.run([daemon, "-f", str(conf)], check=True, env=environment, timeout=60)
    try:
        wait_for(lambda: "idle" in subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True,
                                                  env=environment).stdout, 60, "the node to be idle")
        yield environment
    finally:
        subprocess.run(["scancel", "--full", "-u", "root"], env=environment, capture_output=True)
        for pid_file in ("slurmd.pid", "slurmctld.pid", "munge/munged.pid"):
            try:
                os.kill(int((folder / pid_file).read_text()), signal.SIGTERM)
            except (OSError, ValueError):
                pass


def submit(cluster, recipe: str, config: str, *args: str) -> str:
    result = subprocess.run([sys.executable, "-m", "hf_diloco.cli", "slurm", str(REPO / "recipes" / recipe),
                             "--accelerate-config", str(REPO / "accelerate_configs" / config), "--submit", *args],
                            capture_output=True, text=True, env=cluster, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.split("submitted job ")[1].split(";")[0]


def job_states(cluster, job: str) -> list[str]:
    """The state of each of the job's tasks (an array job has one per task)."""
    shown = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True, env=cluster)
    return [word.split("=", 1)[1] for line in shown.stdout.splitlines() for word in line.split()
            if word.startswith("JobState=")]


def wait_for_job(cluster, job: str, tasks: int, timeout: float) -> list[str]:
    return wait_for(lambda: (s := job_states(cluster, job)) and len(s) == tasks and
                    all(state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING") for state in s) and s,
                    timeout, f"job {job} to end")


SHORT = ["--max_steps", "20", "--inner_steps", "10", "--block_size", "32", "--per_device_train_batch_size", "4",
         "--eval_strategy", "no", "--disable_tqdm", "true", "--logging_steps", "10"]


def test_a_torch_backend_run_of_two_replicas_runs_as_a_slurm_job(cluster, tmp_path):
    """One node of the cpu-2proc config: 2 replicas of recipes/sft-lora.yaml (TRL's SFTTrainer, its max_length
    field among the flags), whose round records show both; the LoRA adapter is saved."""
    out = tmp_path / "run"
    job = submit(cluster, "sft-lora.yaml", "cpu-2proc.yaml", "--nodes", "1", "--job-name", "hfd-torch",
                 "--", *SHORT, "--max_length", "64", "--output_dir", str(out))
    states = wait_for_job(cluster, job, 1, 300)
    log = next((out / "slurm").glob(f"slurm-{job}*.log")).read_text()
    assert states == ["COMPLETED"], log[-3000:]
    rounds = read_syncs(out)
    assert [r["step"] for r in rounds] == [10, 20] and all(len(r["replica_losses"]) == 2 for r in rounds)
    assert (out / "adapter_model.safetensors").exists()
    assert f"[hf-diloco slurm] job {job}" in log
    script = (out / "slurm" / "job.sbatch").read_text()
    assert "#SBATCH --job-name=hfd-torch" in script and "#SBATCH --nodes=1" in script


def test_a_torchft_run_of_two_replicas_and_its_lighthouse_run_as_one_job_array(cluster, tmp_path):
    """Array task 0 runs the Lighthouse and leaves once the replicas' tasks have ended; tasks 1 and 2 are replicas
    0 and 1, which find it through the output folder, take part in every round and end with the same model."""
    out = tmp_path / "ft"
    job = submit(cluster, "torchft-3.yaml", "torchft-replica.yaml", "--replicas", "2", "--port", str(free_port()),
                 "--", *SHORT, "--output_dir", str(out))
    states = wait_for_job(cluster, job, 3, 300)
    logs = {p.name: p.read_text() for p in (out / "slurm").glob("slurm-*.log")}
    assert states == ["COMPLETED"] * 3, json.dumps(logs)[-4000:]
    assert any("[hf-diloco slurm] Lighthouse on http://" in text for text in logs.values())
    for replica in (0, 1):
        rounds = read_syncs(out / f"replica-{replica}")
        assert [r["step"] for r in rounds] == [10, 20], logs
        assert all(r["participants"] == 2 for r in rounds)
    from safetensors.torch import load_file

    first, second = (load_file(out / f"replica-{r}" / "model.safetensors") for r in (0, 1))
    assert first.keys() == second.keys() and all((first[k] == second[k]).all() for k in first)


def test_a_replica_task_refuses_a_lighthouse_address_file_that_another_user_wrote(tmp_path):
    """The replica tasks of a torchft job array read the Lighthouse's address from a file in the job's folder (task
    0 writes it, readable by its user only); a file there that another user wrote (here: owned by nobody) is refused
    in one sentence before any replica starts, so a user who can write in the folder cannot point the replicas at
    a Lighthouse of theirs. (Needs no cluster: the script's replica task runs under bash.)"""
    from hf_diloco import slurm

    if os.getuid() != 0:
        pytest.skip("making a file that belongs to another user takes root")
    job = slurm.Job(str(REPO / "recipes" / "torchft-3.yaml"), "torchft-replica.yaml", [], str(tmp_path), replicas=1)
    script = tmp_path / "job.sh"
    script.write_text(slurm.torchft_script(job))
    planted = tmp_path / "slurm" / "lighthouse-7.url"
    planted.parent.mkdir()
    planted.write_text("http://lighthouse.elsewhere.example:29510\n")
    os.chown(planted, 65534, 65534)
    result = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60,
                            env={**env(), "SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_JOB_ID": "7"})
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert result.stderr.strip() == (f"[hf-diloco slurm] {planted} belongs to another user: not joining the "
                                     f"Lighthouse it names."), result.stderr
    assert "replica 0 on" not in result.stdout
