"""CPU replicas launched by MPI through accelerate's mpirun path (Debian's Open MPI), as on a CPU cluster."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, env, free_port

pytestmark = pytest.mark.process  # every test here starts processes

SCRIPT = str(REPO / "tests" / "scripts" / "replica_run.py")


def training_listeners(launch: subprocess.Popen) -> set[tuple[str, int]]:
    """(address, port) of every socket the training processes of `launch` listened on, read with psutil every
    0.1 s until it exits (MPI's own daemons aside)."""
    import time

    import psutil

    found: set[tuple[str, int]] = set()
    while launch.poll() is None:
        try:
            processes = psutil.Process(launch.pid).children(recursive=True)
        except psutil.Error:
            break
        for process in processes:
            try:
                argv = process.cmdline()
                if SCRIPT in argv and "mpirun" not in Path(argv[0]).name:  # (mpirun's own argv names it too)
                    found |= {(c.laddr.ip, c.laddr.port) for c in process.net_connections(kind="inet")
                              if c.status == psutil.CONN_LISTEN}
            except psutil.Error:
                continue
        time.sleep(0.1)
    return found


def test_mpi_launch_trains_two_replicas_that_agree(tmp_path):
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun is not installed (apt-get install openmpi-bin; .ci/run installs it)")
    config = (REPO / "accelerate_configs" / "cpu-mpi.yaml").read_text()
    port = free_port()
    config = config.replace("main_process_port: 29513", f"main_process_port: {port}")
    (tmp_path / "cpu-mpi.yaml").write_text(config)
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(tmp_path / "cpu-mpi.yaml"),
               SCRIPT, json.dumps({"out": str(tmp_path), "inner_steps": 3, "max_steps": 6})]
    mpi_env = {**env(), "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    launch = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=mpi_env,
                              cwd=REPO)
    listening = training_listeners(launch)
    stdout, stderr = launch.communicate(timeout=300)
    assert launch.returncode == 0, stderr[-3000:]
    # Rank 0's rendezvous store (env:// under MPI, served by the process itself) and gloo: loopback only; plain
    # torch binds the store on every interface.
    assert listening and {address for address, _ in listening} == {"127.0.0.1"}, sorted(listening)
    assert port in {port for _, port in listening}, "the store is among them"
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["world_size"] == 2
    assert [s for s, _ in ranks[0]["digests"]] == [3, 6]
    assert ranks[0]["digests"] == ranks[1]["digests"]
    assert not set(ranks[0]["seen"]) & set(ranks[1]["seen"]), "each replica reads its own shard"
