"""Two "nodes" on one machine: network namespaces joined by a veth pair, one replica in each.

Runs `accelerate launch --num_machines 2` once per namespace, with gloo bound to the veth
(GLOO_SOCKET_IFNAME), and checks that both replicas end every round with identical parameters.
Needs root (ip netns); anywhere namespaces cannot be made the test is skipped and says why.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
from helpers import REPO, env, free_port

SCRIPT = str(REPO / "tests" / "scripts" / "replica_run.py")


def sh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True)


@pytest.fixture
def two_nodes():
    if shutil.which("ip") is None:
        pytest.skip("iproute2's `ip` is not installed, so no network namespaces can be made")
    tag = str(os.getpid() % 10000)
    names = [f"hfd{tag}a", f"hfd{tag}b"]
    links = [f"vh{tag}a", f"vh{tag}b"]
    addresses = ["10.77.0.1", "10.77.0.2"]
    made = sh("ip", "netns", "add", names[0])
    if made.returncode != 0:
        pytest.skip(f"network namespaces cannot be made here: {made.stderr.strip()}")
    try:
        sh("ip", "netns", "add", names[1])
        steps = [("ip", "link", "add", links[0], "type", "veth", "peer", "name", links[1])]
        for name, link, address in zip(names, links, addresses, strict=True):
            steps += [
                ("ip", "link", "set", link, "netns", name),
                ("ip", "netns", "exec", name, "ip", "addr", "add", f"{address}/24", "dev", link),
                ("ip", "netns", "exec", name, "ip", "link", "set", link, "up"),
                ("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"),
            ]
        for step in steps:
            result = sh(*step)
            assert result.returncode == 0, f"{' '.join(step)}: {result.stderr}"
        yield list(zip(names, links, addresses, strict=True))
    finally:
        for name in names:
            sh("ip", "netns", "del", name)


def test_two_node_diloco_over_veth_ends_with_identical_parameters(two_nodes, tmp_path):
    port = str(free_port())
    settings = json.dumps({"out": str(tmp_path), "inner_steps": 3, "max_steps": 7})
    procs = []
    for rank, (namespace, link, _) in enumerate(two_nodes):
        command = [
            "ip", "netns", "exec", namespace, "env", f"GLOO_SOCKET_IFNAME={link}",
            sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "2",
            "--num_processes", "2", "--machine_rank", str(rank), "--main_process_ip", two_nodes[0][2],
            "--main_process_port", port, "--mixed_precision", "no", "--dynamo_backend", "no", SCRIPT, settings,
        ]
        procs.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(),
                                      cwd=REPO))
    outputs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["world_size"] == 2
    assert [s for s, _ in ranks[0]["digests"]] == [3, 6, 7]
    assert ranks[0]["digests"] == ranks[1]["digests"]
