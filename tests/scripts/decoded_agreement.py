"""The contribution checks' agreement λ_i with a codec, against the vectors it stands for.

Run under `accelerate launch` with 4 processes. For each layout (4 replicas of one process; 2 replicas of 2
processes, not sharded) and each codec (sparse and int4, error feedback on), a few syncs of one bucket of made-up
pseudo-gradients Δ_i (a part all replicas share, plus a part of each replica's own) at unequal weights go through
hf_diloco.outer.exchange with `decoded=True`. Each rank writes `decoded<rank>.json` with, per sync:

- `from_terms`: λ_i as the round engine forms it, from the exchange's scalar terms (leave_one_out);
- `from_vectors`: cos(D_i, W·Δ − D_i), with D_i what the others decoded of replica i's contribution, taken
  independently of the codec path as what error feedback carried in plus the weighted Δ_i, less what it kept
  (x − e_after), gathered whole across the replica's members, and Δ the average the exchange returned;
- `before_codec`: cos(Δ_i, W·Δ − w_i Δ_i), the agreement measured on Δ_i as trained, for comparison.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from hf_diloco import launch
from hf_diloco.codecs import ErrorFeedback, make_codec
from hf_diloco.comm import ReplicaComm
from hf_diloco.contributions import leave_one_out
from hf_diloco.fragments import Fragment, exchange
from hf_diloco.outer import OuterState

NUMEL = 5003  # not a multiple of the replicas, the members or the codecs' chunks: every padding path runs
SYNCS = 4


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()))


def whole(comm: ReplicaComm, piece: torch.Tensor) -> torch.Tensor:
    """A replica's full vector from its members' equal slices (member order), cut to NUMEL."""
    if comm.group_size == 1:
        return piece[:NUMEL]
    parts = [torch.empty_like(piece) for _ in range(comm.group_size)]
    dist.all_gather(parts, piece, group=comm.replica_group)
    return torch.cat(parts)[:NUMEL]


def run(comm: ReplicaComm, codec_name: str) -> list[dict]:
    codec = make_codec(codec_name, chunk=256, sparse_k=32, sparse_chunk=512)
    feedback = ErrorFeedback(decay=0.9)
    # One bucket of NUMEL values (Δ_i below is handed in, not formed from these parameters)
    bucket = Fragment(0, [0], OuterState([torch.nn.Parameter(torch.zeros(NUMEL))], lr=1.0, momentum=0.0,
                                         nesterov=False), feedback)
    weight = 1.0 / (1 + comm.replica_index)  # unequal weights: 1, 1/2, 1/3, 1/4
    out = []
    for sync in range(SYNCS):
        shared = torch.randn(NUMEL, generator=torch.Generator().manual_seed(100 + sync))
        own = torch.randn(NUMEL, generator=torch.Generator().manual_seed(1000 * comm.replica_index + sync))
        delta_i = shared + 0.8 * own
        before = feedback.residuals.get("0")
        before = torch.zeros(0) if before is None else before.clone()
        landed = exchange(comm, [bucket], [delta_i.clone()], codec=codec,
                          stats=lambda _norm_sq: torch.zeros(1, dtype=torch.float64), weight=weight, decoded=True)
        (_, _, average), = landed.averaged
        result = landed.result
        result.sum_over_members(comm)
        norm_sq, dot = result.own_terms(weight, decoded=True)
        from_terms = leave_one_out(result.total_weight, weight, dot=dot, norm_sq=norm_sq,
                                   average_norm_sq=result.average_norm_sq)
        # Independently: what went out is x − e_after, x = β·e_before + (this member's slice of) w·Δ_i
        after = feedback.residuals["0"]
        g = comm.group_size
        slice_numel = after.numel()
        padded = torch.cat([weight * delta_i, delta_i.new_zeros(g * slice_numel - NUMEL)])
        mine = padded.view(g, -1)[comm.member]
        x = mine + (0.9 * before if before.numel() else 0.0)
        carried = whole(comm, (x - after).to(torch.float64))
        total = result.total_weight * average.to(torch.float64)
        out.append({
            "sync": sync,
            "from_terms": from_terms,
            "from_vectors": cosine(carried, total - carried),
            "before_codec": cosine(delta_i.double(), total - weight * delta_i.double()),
        })
    return out


dist.init_process_group("gloo")
results = {}
for group_size in (1, 2):
    comm = ReplicaComm(group_size=group_size)
    for codec_name in ("sparse", "int4"):
        results[f"g={group_size} {codec_name}"] = run(comm, codec_name)
Path(sys.argv[1], f"decoded{dist.get_rank()}.json").write_text(json.dumps(results))
launch.destroy_process_groups()
launch.exit_process(0)
