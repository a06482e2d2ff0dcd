"""A round's extra memory is a few buckets, whatever the model's size (the promise of `sync_bucket_mb`).

Every allocation and free torch makes during one outer round is recorded by the profiler; the peak of their
running sum is the round's extra memory. Measured in one process (the collectives' own buffers are gloo's and not
seen by the profiler; everything hf-diloco allocates is: pseudo-gradient, codec payloads, decoded averages,
error-feedback updates, the outer step).
"""

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from hf_diloco.codecs import ErrorFeedback, make_codec
from hf_diloco.comm import ReplicaComm
from hf_diloco.fragments import fragments_of, outer_round
from hf_diloco.outer import OuterState

BUCKET = 2**18  # values per bucket: 1 MiB of fp32
BUCKET_BYTES = 4 * BUCKET


def peak_extra_bytes(prof) -> int:
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start)
    current = peak = 0
    for event in events:
        current += event.self_cpu_memory_usage
        peak = max(peak, current)
    return peak


@pytest.mark.parametrize("codec_name,buckets_allowed,decoded", [
    ("none", 2, False), ("int8", 5, False), ("int4", 5, False), ("sparse", 3, False),
    ("int4", 6, True), ("sparse", 4, True)])
def test_a_round_holds_a_few_buckets_not_copies_of_the_model(codec_name, buckets_allowed, decoded):
    """16 MiB of parameters in 16 buckets: the round's peak is at most two buckets for fp32 (Δ_i and Δ), a few
    more for a codec's payloads and decoded copies, one more where the contribution checks measure what the others
    decoded of this replica (`decoded`), and never the two fp32 copies of the model (32 buckets) that forming every
    bucket at once would take."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(256, 1024)) for _ in range(16)]
    outer = OuterState(params, lr=0.7, momentum=0.9, nesterov=True, bucket_numel=BUCKET)
    assert len(outer.buckets) == 16
    codec = None if codec_name == "none" else make_codec(codec_name)
    fragments = fragments_of(outer, None if codec is None else lambda: ErrorFeedback(0.95))
    for _ in range(2):  # the first round creates the momentum buffers and the residuals
        with torch.no_grad():
            for p in params:
                p.add_(torch.randn_like(p) * 1e-3)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            outer_round(fragments, ReplicaComm(), codec=codec, decoded=decoded)
    peak = peak_extra_bytes(prof)
    assert BUCKET_BYTES <= peak <= buckets_allowed * BUCKET_BYTES + 64 * 1024, f"peak {peak / 2**20:.2f} MiB"
