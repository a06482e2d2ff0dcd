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
import tempfile
import time
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


@dataclass
class Overlay:
    """A WireGuard overlay over the hosts' link: per host its interface and overlay address."""

    interfaces: list[str]
    addresses: list[str]
    port: int

    def transfer(self, index: int, host: Host) -> tuple[int, int]:
        """(bytes received, bytes sent) through host `index`'s tunnel, as `wg show transfer` counts them."""
        result = _ip("netns", "exec", host.namespace, "wg", "show", self.interfaces[index], "transfer")
        received, sent = result.stdout.split()[1:3]
        return int(received), int(sent)


def close_all_but_overlay(host: Host, interface: str) -> None:
    """The firewall rule docs/guides/across-machines.md gives for a machine on an overlay: new TCP connections to
    unprivileged ports are dropped unless they arrive on the overlay interface (or loopback)."""
    rules = "\n".join(["table inet hfdiloco {", "  chain input {",
                       "    type filter hook input priority 0; policy accept;",
                       f'    iifname != {{ "lo", "{interface}" }} tcp dport 1024-65535 ct state new drop',
                       "  }", "}", ""])
    result = subprocess.run(["ip", "netns", "exec", host.namespace, "nft", "-f", "-"], input=rules,
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"nft refused the rule: {result.stderr.strip()}")


@contextlib.contextmanager
def wireguard(hosts: list[Host], subnet: str = "10.99.0", port: int = 51820) -> Iterator[Overlay]:
    """An encrypted overlay between the hosts: userspace WireGuard (wireguard-go; the kernel needs no module) in each
    namespace, each interface with a name of its own (wireguard-go's control sockets share /var/run/wireguard),
    overlay address `subnet`.(i + 1), peers reaching each other over the veth link. The interfaces have
    wireguard-go's MTU, 1420 bytes (80 less than the link's 1500 for the encryption's headers)."""
    for tool in ("wireguard-go", "wg", "nft"):
        if shutil.which(tool) is None:
            raise NamespaceError(f"{tool} is not installed (apt-get install wireguard-go wireguard-tools nftables)")
    tag = str(os.getpid() % 100000)
    overlay = Overlay([f"wg{tag}{s}" for s in "ab"], [f"{subnet}.{i + 1}" for i in range(len(hosts))], port)
    keys = [subprocess.run(["wg", "genkey"], capture_output=True, text=True, check=True).stdout.strip()
            for _ in hosts]
    public = [subprocess.run(["wg", "pubkey"], input=key, capture_output=True, text=True, check=True).stdout.strip()
              for key in keys]
    daemons = []
    try:
        for host, interface in zip(hosts, overlay.interfaces, strict=True):
            daemons.append(subprocess.Popen(["ip", "netns", "exec", host.namespace, "wireguard-go", "-f", interface],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                            env={**os.environ, "WG_I_PREFER_BUGGY_USERSPACE_TO_POLISHED_KMOD": "1"}))
        for i, host in enumerate(hosts):
            other = 1 - i
            for _ in range(100):  # the interface exists once wireguard-go has opened its tun device
                if _ip("-n", host.namespace, "link", "show", overlay.interfaces[i]).returncode == 0:
                    break
                time.sleep(0.1)
            with tempfile.NamedTemporaryFile("w", delete=False) as key_file:  # 0600: mkstemp's mode
                key_file.write(keys[i])
            try:
                steps = [("netns", "exec", host.namespace, "wg", "set", overlay.interfaces[i], "private-key",
                          key_file.name, "listen-port", str(port), "peer", public[other], "endpoint",
                          f"{hosts[other].address}:{port}", "allowed-ips", f"{overlay.addresses[other]}/32"),
                         ("-n", host.namespace, "addr", "add", f"{overlay.addresses[i]}/24", "dev",
                          overlay.interfaces[i]),
                         ("-n", host.namespace, "link", "set", overlay.interfaces[i], "up")]
                for step in steps:
                    result = _ip(*step)
                    if result.returncode != 0:  # the tools are there: a failure is a bug, not a missing feature
                        raise RuntimeError(f"ip {' '.join(step)}: {result.stderr.strip()}")
            finally:
                os.unlink(key_file.name)
        yield overlay
    finally:
        for daemon in daemons:
            daemon.kill()
            daemon.wait()
        for interface in overlay.interfaces:
            with contextlib.suppress(OSError):
                os.unlink(f"/var/run/wireguard/{interface}.sock")


@dataclass
class Star:
    """Hosts joined through a bridge in a hub namespace (a switch): host i reaches the others and the hub over its
    own link, which can be shaped or cut alone. `hub` is an address on the bridge (for a Lighthouse)."""

    hub: Host
    hosts: list[Host]
    hub_links: list[str]  # the hub-side end of each host's link

    def shape(self, index: int, rate_bits_per_second: float | None) -> None:
        """Limit host `index`'s link in both directions (None: no limit)."""
        host = self.hosts[index]
        shape([host, Host(self.hub.namespace, self.hub_links[index], self.hub.address)], rate_bits_per_second)

    def cut(self, index: int, cut: bool) -> None:
        """Take host `index`'s link down (every packet to and from it is lost) or bring it back."""
        result = _ip("-n", self.hosts[index].namespace, "link", "set", self.hosts[index].link,
                     "down" if cut else "up")
        if result.returncode != 0:
            raise RuntimeError(f"ip link set {self.hosts[index].link}: {result.stderr.strip()}")


@contextlib.contextmanager
def star(count: int, subnet: str = "10.81.0") -> Iterator[Star]:
    """`count` namespaces, each linked by a veth pair to a bridge in a hub namespace; addresses `subnet`.1, .2, ...
    and the hub `subnet`.254. Everything is removed on exit."""
    if shutil.which("ip") is None:
        raise NamespaceError("iproute2's `ip` is not installed")
    tag = str(os.getpid() % 10000)
    hub = Host(f"hfd{tag}hub", f"br{tag}", f"{subnet}.254")
    hosts = [Host(f"hfd{tag}s{i}", f"vs{tag}s{i}", f"{subnet}.{i + 1}") for i in range(count)]
    hub_links = [f"vh{tag}s{i}" for i in range(count)]
    made = _ip("netns", "add", hub.namespace)
    if made.returncode != 0:
        raise NamespaceError(made.stderr.strip() or "ip netns add failed")
    try:
        steps = [("-n", hub.namespace, "link", "add", hub.link, "type", "bridge"),
                 ("-n", hub.namespace, "addr", "add", f"{hub.address}/24", "dev", hub.link),
                 ("-n", hub.namespace, "link", "set", hub.link, "up"),
                 ("-n", hub.namespace, "link", "set", "lo", "up")]
        for host, hub_link in zip(hosts, hub_links, strict=True):
            steps += [("netns", "add", host.namespace),
                      ("link", "add", host.link, "type", "veth", "peer", "name", hub_link),
                      ("link", "set", host.link, "netns", host.namespace),
                      ("link", "set", hub_link, "netns", hub.namespace),
                      ("-n", hub.namespace, "link", "set", hub_link, "master", hub.link),
                      ("-n", hub.namespace, "link", "set", hub_link, "up"),
                      ("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.link),
                      ("-n", host.namespace, "link", "set", host.link, "up"),
                      ("-n", host.namespace, "link", "set", "lo", "up")]
        for step in steps:
            result = _ip(*step)
            if result.returncode != 0:
                raise NamespaceError(f"ip {' '.join(step)}: {result.stderr.strip()}")
        yield Star(hub, hosts, hub_links)
    finally:
        for host in [*hosts, hub]:
            _ip("netns", "del", host.namespace)
