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

pytestmark = pytest.mark.process  # every test here starts processes

SCRIPT = str(REPO / "tests" / "scripts" / "replica_run.py")


@pytest.fixture
def two_nodes():
    try:
        with two_hosts() as hosts:
            yield hosts
    except NamespaceError as error:
        pytest.skip(f"network namespaces cannot be made here: {error}")


def test_two_node_diloco_over_veth_ends_with_identical_parameters(two_nodes, tmp_path):
    """Two nodes, one process each, launched as `hf-diloco launch` launches (hf_diloco.accelerate_launch): the
    replicas end with identical digests, and every listener of each node (read with ss while it runs: node 0's
    rendezvous store, each node's gloo) is on that node's own address, none on every interface."""
    import time

    port = str(free_port())
    settings = json.dumps({"out": str(tmp_path), "inner_steps": 3, "max_steps": 7})
    procs = []
    for rank, host in enumerate(two_nodes):
        command = [
            *host.exec_prefix(), sys.executable, "-m", "hf_diloco.accelerate_launch", "--multi_gpu",
            "--num_machines", "2", "--num_processes", "2", "--machine_rank", str(rank),
            "--main_process_ip", two_nodes[0].address, "--main_process_port", port,
            "--mixed_precision", "no", "--dynamo_backend", "no", SCRIPT, settings,
        ]
        procs.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(),
                                      cwd=REPO))
    seen = [set(), set()]
    while any(p.poll() is None for p in procs):
        for host, found in zip(two_nodes, seen, strict=True):
            found |= listeners(host)
        time.sleep(0.2)
    outputs = [p.communicate(timeout=300) for p in procs]
    assert f"{two_nodes[0].address}:{port}" in seen[0], seen[0]  # the rendezvous store, on node 0's address
    for host, found in zip(two_nodes, seen, strict=True):
        assert found and {a.rsplit(":", 1)[0] for a in found} == {host.address}, found
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["world_size"] == 2
    assert [s for s, _ in ranks[0]["digests"]] == [3, 6, 7]
    assert ranks[0]["digests"] == ranks[1]["digests"]


def test_reported_bytes_match_the_veth_counters(two_nodes, tmp_path):
    """The bytes syncs.jsonl reports are what left each host: int8 syncs of the tiny Llama (1.08M values,
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
    rounds = [json.loads(line) for line in (output_dir / "syncs.jsonl").read_text().splitlines()]
    assert [r["compression"] for r in rounds] == ["int8"] * 3
    reported = sum(r["bytes_per_replica"] for r in rounds)
    assert 0 < rounds[0]["startup_bytes"] < 1000, "the digest check only"
    assert reported > 3 * 1_000_000  # ~1.09 MB a round: the syncs dominate what the counters see
    assert sent[1] == pytest.approx(reported, rel=0.10)
    assert sent[0] == pytest.approx(reported + rounds[0]["startup_bytes"], rel=0.10)


def test_a_two_site_torchft_run_over_wireguard_keeps_every_connection_on_the_overlay(tmp_path):
    """Two sites (namespaces) joined by a link shaped to 20 Mbit/s, a WireGuard overlay over it (wireguard-go), and at
    each site the firewall rule of docs/guides/across-machines.md: new TCP connections are dropped unless they come over
    the overlay. The Lighthouse binds site A's overlay address; each site runs one torchft replica whose replica_address
    is its overlay address and whose gloo uses the overlay interface. Both replicas take part in every round and end
    with identical models, the tunnels carried at least the bytes the rounds report, and every listener of each site
    (read with ss while it runs) is on that site's overlay address: none on the link address or every interface, gloo
    included with no GLOO_SOCKET_IFNAME given (it follows replica_address); each port refuses a connection to the site's
    link address (tried from inside the site, past its firewall, as soon as the port is seen)."""
    from netns import close_all_but_overlay, wireguard

    try:
        with two_hosts(rate="20mbit", subnet="10.79.0") as hosts, wireguard(hosts, subnet="10.99.0") as overlay:
            for host, interface in zip(hosts, overlay.interfaces, strict=True):
                close_all_but_overlay(host, interface)
            run_two_sites(hosts, overlay, tmp_path)
    except NamespaceError as error:
        pytest.skip(f"the overlay cannot be made here: {error}")


def listeners(host) -> set[str]:
    result = subprocess.run(["ip", "netns", "exec", host.namespace, "ss", "-Hltn"], capture_output=True, text=True)
    return {line.split()[3] for line in result.stdout.splitlines() if line.strip()}


def run_two_sites(hosts, overlay, tmp_path):
    import time

    from safetensors.torch import load_file

    from hf_diloco.metrics import read_syncs

    port = free_port()
    lighthouse = subprocess.Popen([*hosts[0].exec_prefix(), sys.executable, "-m", "hf_diloco.cli", "lighthouse",
                                   "--host", overlay.addresses[0], "--port", str(port), "--min-replicas", "2"],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env(), cwd=REPO)
    replicas = []
    try:
        for r, host in enumerate(hosts):
            command = ["ip", "netns", "exec", host.namespace, sys.executable, "-m", "accelerate.commands.launch",
                       "--config_file", str(REPO / "accelerate_configs" / "torchft-replica.yaml"), "-m",
                       "hf_diloco.cli", "train",
                       "--config", str(REPO / "recipes" / "torchft-3.yaml"), "--max_steps", "20", "--inner_steps",
                       "10", "--block_size", "32", "--per_device_train_batch_size", "4", "--eval_strategy", "no",
                       "--disable_tqdm", "true", "--replica_id", str(r), "--num_replicas", "2",
                       "--lighthouse", f"http://{overlay.addresses[0]}:{port}",
                       "--replica_address", overlay.addresses[r], "--output_dir", str(tmp_path / f"replica-{r}")]
            replicas.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                             env=env(), cwd=REPO))
        seen = [set(), set()]
        accepted = [{}, {}]  # per site: port -> whether a connection to the site's link address was accepted
        while any(p.poll() is None for p in replicas):
            for host, found, answers in zip(hosts, seen, accepted, strict=True):
                found |= listeners(host)
                for opened in {a.rsplit(":", 1)[1] for a in found} - answers.keys():
                    probe = subprocess.run(["ip", "netns", "exec", host.namespace, "timeout", "2", "bash", "-c",
                                            f"exec 3<>/dev/tcp/{host.address}/{opened}"], capture_output=True)
                    answers[opened] = b"Connection refused" not in probe.stderr
            time.sleep(0.5)
        outputs = [p.communicate()[0] for p in replicas]
    finally:
        for process in [*replicas, lighthouse]:
            if process.poll() is None:
                process.kill()
    for process, output in zip(replicas, outputs, strict=True):
        assert process.returncode == 0, output[-4000:]
    rounds = [read_syncs(tmp_path / f"replica-{r}") for r in (0, 1)]
    assert [[r["step"] for r in rs] for rs in rounds] == [[10, 20], [10, 20]]
    assert all(r["participants"] == 2 for rs in rounds for r in rs)
    first, second = (load_file(tmp_path / f"replica-{r}" / "model.safetensors") for r in (0, 1))
    assert all((first[k] == second[k]).all() for k in first), "identical replicas"
    reported = sum(r["bytes_per_replica"] for r in rounds[0])
    assert min(overlay.transfer(i, host)[1] for i, host in enumerate(hosts)) >= reported, "the rounds went through"
    assert f"{overlay.addresses[0]}:{port}" in seen[0], f"the Lighthouse on the overlay: {seen[0]}"
    for address, found, answers in zip(overlay.addresses, seen, accepted, strict=True):
        assert len(found) >= 4, f"the manager, store, gloo and healing transfer: {found}"
        assert {a.rsplit(":", 1)[0] for a in found} == {address}, f"a listener off the overlay address: {found}"
        assert answers and not any(answers.values()), f"a port reachable on the link address: {answers}"
