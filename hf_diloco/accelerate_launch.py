"""`accelerate launch`, with torchrun's rendezvous store on the address the launch's processes meet at.

`python -m hf_diloco.accelerate_launch ARGS` takes exactly the arguments of `accelerate launch ARGS` and runs it;
the only difference is where the store that torchrun's agent serves on `main_process_port` listens: on
`main_process_ip` (127.0.0.1 on one machine) instead of every interface (compat.rendezvous_store_on_its_address).
Its processes' gloo and NCCL sockets stay on the interface the run meets on (hf_diloco.network: loopback on one
machine). `hf-diloco launch` and the app start every run through it.
"""

from __future__ import annotations

import sys

from . import compat, network


def main() -> None:
    from accelerate.commands.launch import main as accelerate_main

    network.keep_sockets_on(network.launch_interface(sys.argv[1:]))  # (its processes inherit the environment)
    with compat.rendezvous_store_on_its_address():
        accelerate_main()


if __name__ == "__main__":
    main()
