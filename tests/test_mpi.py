"""CPU replicas launched by MPI through accelerate's mpirun path (Debian's Open MPI), as on a CPU cluster."""

import json
import shutil
import subprocess
import sys

import pytest
from helpers import REPO, env, free_port

pytestmark = pytest.mark.process  # every test here starts processes

SCRIPT = str(REPO / "tests" / "scripts" / "replica_run.py")


def test_mpi_launch_trains_two_replicas_that_agree(tmp_path):
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun is not installed (apt-get install openmpi-bin; .ci/run installs it)")
    config = (REPO / "accelerate_configs" / "cpu-mpi.yaml").read_text()
    config = config.replace("main_process_port: 29513", f"main_process_port: {free_port()}")
    (tmp_path / "cpu-mpi.yaml").write_text(config)
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(tmp_path / "cpu-mpi.yaml"),
               SCRIPT, json.dumps({"out": str(tmp_path), "inner_steps": 3, "max_steps": 6})]
    mpi_env = {**env(), "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=mpi_env, cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["world_size"] == 2
    assert [s for s, _ in ranks[0]["digests"]] == [3, 6]
    assert ranks[0]["digests"] == ranks[1]["digests"]
    assert not set(ranks[0]["seen"]) & set(ranks[1]["seen"]), "each replica reads its own shard"
