"""Which network interface a run's sockets use: gloo and NCCL on the interface the run meets on, not on whatever
address the machine's host name resolves to.

gloo binds the interface GLOO_SOCKET_IFNAME names, else the address of the host name (which many machines map to
their LAN or cloud address); NCCL picks a non-loopback interface unless NCCL_SOCKET_IFNAME names one. A run on one
machine needs neither on the network, so `python -m hf_diloco.accelerate_launch` (every launch of hf-diloco and the
app) names loopback for both; a run across machines gets the interface that reaches `main_process_ip`. A value the
user set is kept. A torchft replica's launch is left alone: its gloo talks to other replicas, through the interface
of its replica_address (hf_diloco.torchft_backend).

    interface_of(address)        the interface of this machine that holds an address (or a name)
    launch_interface(argv)       the interface for an `accelerate launch` command line, or None
"""

from __future__ import annotations

import contextlib
import os
import socket


def interface_of(address: str) -> str | None:
    """The network interface of this machine that holds `address` (an address or a name), or None.

    >>> interface_of("127.0.0.1"), interface_of("192.0.2.1")
    ('lo', None)
    """
    import ipaddress

    import psutil

    try:
        wanted = {ipaddress.ip_address(info[4][0]) for info in socket.getaddrinfo(address, 0, type=socket.SOCK_STREAM)}
    except (OSError, ValueError):
        return None
    for name, addresses in psutil.net_if_addrs().items():
        for entry in addresses:
            with contextlib.suppress(ValueError):
                if ipaddress.ip_address(entry.address.split("%", 1)[0]) in wanted:
                    return name
    return None


def launch_interface(argv: list[str]) -> str | None:
    """The interface the processes of `accelerate launch ARGV` should talk over: loopback on one machine (its
    `--num_machines`, else its config file's, else 1), else the one this machine reaches `main_process_ip` through;
    None when that cannot be told (the backends' own choice stands). ARGV is read by accelerate's own parser."""
    from accelerate.commands.launch import launch_command_parser

    from .files import read_yaml

    try:
        args = launch_command_parser().parse_args(argv)
    except SystemExit:  # accelerate reports its own usage errors
        return None
    if any(word.split("=", 1)[0] == "--lighthouse" for word in args.training_script_args):
        return None  # a torchft replica: its own launch, whose gloo reaches the other replicas at replica_address
    settings = {}
    with contextlib.suppress(Exception):  # and a config file it cannot read
        settings = read_yaml(args.config_file, "accelerate config") if args.config_file else {}
    machines = args.num_machines if args.num_machines is not None else settings.get("num_machines", 1)
    main_address = args.main_process_ip or settings.get("main_process_ip")
    try:
        if int(machines or 1) <= 1:
            return interface_of("127.0.0.1")
    except (TypeError, ValueError):
        return None
    if not main_address:
        return None
    try:  # the local address a packet to the main machine leaves from (nothing is sent)
        family = socket.AF_INET6 if ":" in str(main_address) else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((str(main_address), 9))
            local = probe.getsockname()[0]
    except OSError:
        return None
    return interface_of(local)


def keep_sockets_on(interface: str | None) -> None:
    """GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME name `interface` for this process and those it starts, unless
    the user set them."""
    if interface:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)
