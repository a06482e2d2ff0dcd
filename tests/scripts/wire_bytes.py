"""Bytes a gloo all-reduce and all-gather really write, for the byte model of hf_diloco.comm.

Run under `accelerate launch` (each process one rank). Argument: the output folder. Each rank writes
`wire<rank>.json`: for each payload size, the bytes the process passed to write-like system calls (the kernel's
/proc/self/io `wchar`, sockets included) during one all-reduce and one all-gather of that many fp32 values.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from hf_diloco import launch
from hf_diloco.comm import gather_into


def bytes_written() -> int:
    import psutil

    return psutil.Process().io_counters().write_chars  # /proc/self/io wchar


def measured(collective) -> int:
    before = bytes_written()
    collective()
    return bytes_written() - before


dist.init_process_group("gloo")
world = dist.get_world_size()
warm = torch.ones(1024)
dist.all_reduce(warm)  # connections are set up by the first collective, not counted below
dist.barrier()
results = []
for numel in (250_000, 1_000_000):
    values = torch.ones(numel)
    gathered = torch.empty(numel * world)
    results.append({
        "payload_bytes": numel * 4,
        "all_reduce": measured(lambda values=values: dist.all_reduce(values)),
        "all_gather": measured(lambda values=values, gathered=gathered: gather_into(gathered, values)),
    })
Path(sys.argv[1], f"wire{dist.get_rank()}.json").write_text(json.dumps({"world": world, "results": results}))
# Leave as a launched hf-diloco worker does: gloo and FSDP2 threads torn down at interpreter exit can abort a
# finished process (SIGABRT, "terminate called without an active exception").
launch.destroy_process_groups()
launch.exit_process(0)
