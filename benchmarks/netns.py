"""Two hosts on one machine: network namespaces joined by a veth pair, optionally shaped with tc tbf.

Used by the WAN benchmark and the two-node test. Needs root and iproute2. netem is not available on these
machines, so links are shaped in bandwidth only (token bucket); latency is not simulated. `shape` changes the rate
of a live pair, so a benchmark can run its unshaped baseline and its shaped runs in the same namespaces.
Everything made here is removed on exit from `two_hosts`, failure included (deleting a namespace deletes its veth
end and qdisc).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

BURST_BYTES = 32 * 1024  # tbf bucket: this many bytes may leave at line rate before the rate limit applies


class NamespaceError(RuntimeError):
    """Network namespaces cannot be made here (not root, no iproute2, ...)."""


@dataclass
class Host:
    namespace: str
    link: str
    address: str

    def exec_prefix(self) -> list[str]:
        """Command prefix that runs a program inside this host, with gloo bound to its veth."""
        return ["ip", "netns", "exec", self.namespace, "env", f"GLOO_SOCKET_IFNAME={self.link}"]

    def tx_bytes(self) -> int:
        path = f"/sys/class/net/{self.link}/statistics/tx_bytes"
        result = _ip("netns", "exec", self.namespace, "cat", path)
        return int(result.stdout)


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


def _tbf(rate_bits_per_second: float) -> list[str]:
    return ["tbf", "rate", f"{int(rate_bits_per_second)}bit", "burst", str(BURST_BYTES), "latency", "400ms"]


def shape(hosts: list[Host], rate_bits_per_second: float | None) -> None:
    """Limit both directions of the link to `rate_bits_per_second` (None: no limit)."""
    for host in hosts:
        tc = ("netns", "exec", host.namespace, "tc", "qdisc")
        if rate_bits_per_second is None:
            _ip(*tc, "del", "dev", host.link, "root")  # fails harmlessly when there is no qdisc
            continue
        result = _ip(*tc, "replace", "dev", host.link, "root", *_tbf(rate_bits_per_second))
        if result.returncode != 0:
            raise NamespaceError(f"tc qdisc replace on {host.link}: {result.stderr.strip()}")


@contextlib.contextmanager
def two_hosts(rate: str | None = None, subnet: str = "10.77.0") -> Iterator[list[Host]]:
    """Two namespaces joined by a veth pair; `rate` (a tc rate, e.g. "10mbit") shapes both directions."""
    if shutil.which("ip") is None:
        raise NamespaceError("iproute2's `ip` is not installed")
    tag = str(os.getpid() % 100000)
    hosts = [Host(f"hfd{tag}{s}", f"vh{tag}{s}", f"{subnet}.{i + 1}") for i, s in enumerate("ab")]
    made = _ip("netns", "add", hosts[0].namespace)
    if made.returncode != 0:
        raise NamespaceError(made.stderr.strip() or "ip netns add failed")
    try:
        steps = [("netns", "add", hosts[1].namespace),
                 ("link", "add", hosts[0].link, "type", "veth", "peer", "name", hosts[1].link)]
        for host in hosts:
            inside = ("netns", "exec", host.namespace, "ip")
            steps += [("link", "set", host.link, "netns", host.namespace),
                      (*inside, "addr", "add", f"{host.address}/24", "dev", host.link),
                      (*inside, "link", "set", host.link, "up"),
                      (*inside, "link", "set", "lo", "up")]
            if rate:
                steps.append(("netns", "exec", host.namespace, "tc", "qdisc", "add", "dev", host.link, "root",
                              "tbf", "rate", rate, "burst", "32kb", "latency", "400ms"))
        for step in steps:
            result = _ip(*step)
            if result.returncode != 0:
                raise NamespaceError(f"ip {' '.join(step)}: {result.stderr.strip()}")
        yield hosts
    finally:
        for host in hosts:
            _ip("netns", "del", host.namespace)
