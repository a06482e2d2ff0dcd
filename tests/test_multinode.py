"""Two "nodes" on one machine: network namespaces joined by a veth pair, one replica in each.

Runs `accelerate launch --num_machines 2` once per namespace, with gloo bound to the veth
(GLOO_SOCKET_IFNAME), and checks that both replicas end every round with identical parameters.
Needs root (ip netns); anywhere namespaces cannot be made the test is skipped and says why.
"""

import json
import subprocess
import sys

import pytest
from helpers import REPO, env, free_port

sys.path.insert(0, str(REPO / "benchmarks"))
from netns import NamespaceError, two_hosts  # noqa: E402

SCRIPT = str(REPO / "tests" / "scripts" / "replica_run.py")


@pytest.fixture
def two_nodes():
    try:
        with two_hosts() as hosts:
            yield hosts
    except NamespaceError as error:
        pytest.skip(f"network namespaces cannot be made here: {error}")


def test_two_node_diloco_over_veth_ends_with_identical_parameters(two_nodes, tmp_path):
    port = str(free_port())
    settings = json.dumps({"out": str(tmp_path), "inner_steps": 3, "max_steps": 7})
    procs = []
    for rank, host in enumerate(two_nodes):
        command = [
            *host.exec_prefix(), sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
            "--num_machines", "2", "--num_processes", "2", "--machine_rank", str(rank),
            "--main_process_ip", two_nodes[0].address, "--main_process_port", port,
            "--mixed_precision", "no", "--dynamo_backend", "no", SCRIPT, settings,
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


def test_reported_bytes_match_the_veth_counters(two_nodes, tmp_path):
    """The bytes sync_rounds.jsonl reports are what left each host: int8 syncs of the tiny Llama (1.08M values,
    three rounds) between two namespaces, against the veth's tx counter. The counter also holds the start-up check
    (the replicas share a seed, so no parameters are broadcast), TCP/IP headers and the rendezvous; within 10%."""
    port = str(free_port())
    output_dir = tmp_path / "run"
    before = [host.tx_bytes() for host in two_nodes]
    procs = []
    for rank, host in enumerate(two_nodes):
        command = [
            *host.exec_prefix(), sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
            "--num_machines", "2", "--num_processes", "2", "--machine_rank", str(rank),
            "--main_process_ip", two_nodes[0].address, "--main_process_port", port,
            "--mixed_precision", "no", "--dynamo_backend", "no",
            "-m", "hf_diloco.cli", "train", "--config", str(REPO / "recipes" / "tiny-pretrain.yaml"),
            "--output_dir", str(output_dir), "--max_steps", "6", "--inner_steps", "2", "--compression", "int8",
            "--per_device_train_batch_size", "2", "--block_size", "64", "--eval_strategy", "no",
            "--eval_on_start", "false", "--logging_steps", "100",
        ]
        procs.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(),
                                      cwd=REPO))
    outputs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err[-3000:]
    sent = [host.tx_bytes() - start for host, start in zip(two_nodes, before, strict=True)]
    rounds = [json.loads(line) for line in (output_dir / "sync_rounds.jsonl").read_text().splitlines()]
    assert [r["compression"] for r in rounds] == ["int8"] * 3
    reported = sum(r["bytes_per_replica"] for r in rounds)
    assert 0 < rounds[0]["startup_bytes"] < 1000, "the digest check only"
    assert reported > 3 * 1_000_000  # ~1.09 MB a round: the syncs dominate what the counters see
    assert sent[1] == pytest.approx(reported, rel=0.10)
    assert sent[0] == pytest.approx(reported + rounds[0]["startup_bytes"], rel=0.10)
