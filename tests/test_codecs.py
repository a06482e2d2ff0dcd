"""Codecs on random tensors: error bounds from each codec's step size, exact payload sizes, error feedback."""

import math

import pytest
import torch

from hf_diloco.codecs import ErrorFeedback, make_codec, pack_bits, unpack_bits
from hf_diloco.comm import ReplicaComm


def heavy_tailed(n: int, seed: int = 0) -> torch.Tensor:
    """Pseudo-gradient-like values: mostly small, a few large (Student-t with 3 degrees of freedom)."""
    generator = torch.Generator().manual_seed(seed)
    normal = torch.randn(n, generator=generator)
    chi = torch.randn(3, n, generator=generator).square().sum(0)
    return normal / (chi / 3).sqrt() * 1e-3


@pytest.mark.parametrize("name,levels", [("int8", 127), ("int4", 7)])
def test_integer_codecs_round_to_the_nearest_level_of_each_chunk(name, levels):
    """Every decoded value is within half a quantization step (chunk absmax / levels / 2) of the original."""
    chunk = 256
    x = heavy_tailed(10 * chunk + 37)
    codec = make_codec(name, chunk=chunk)
    decoded = codec.decode(codec.encode(x), x.numel())
    for start in range(0, x.numel(), chunk):
        part, back = x[start : start + chunk], decoded[start : start + chunk]
        half_step = part.abs().max() / levels / 2
        assert (part - back).abs().max() <= half_step * (1 + 1e-5)
    if name == "int8":
        # "int8 is within 1% per chunk": the worst error of a chunk relative to its largest value is 1/254.
        worst = max(float((x[s : s + chunk] - decoded[s : s + chunk]).abs().max() / x[s : s + chunk].abs().max())
                    for s in range(0, x.numel(), chunk))
        assert worst <= 0.01


@pytest.mark.parametrize("name,bytes_per_value", [("bf16", 2), ("fp16", 2)])
def test_half_precision_codecs_match_a_plain_cast(name, bytes_per_value):
    x = heavy_tailed(1000)
    codec = make_codec(name)
    payload = codec.encode(x)
    dtype = torch.bfloat16 if name == "bf16" else torch.float16
    assert payload.numel() == bytes_per_value * x.numel()
    assert torch.equal(codec.decode(payload, x.numel()), x.to(dtype).to(torch.float32))


def test_fp16_clamps_instead_of_overflowing():
    codec = make_codec("fp16")
    back = codec.decode(codec.encode(torch.tensor([1e6, -1e6, 1.0])), 3)
    assert back.tolist() == [65504.0, -65504.0, 1.0]


@pytest.mark.parametrize("numel", [1, 4095, 4096, 3 * 4096 + 100])
def test_sparse_keeps_exactly_k_largest_per_chunk_and_its_size_is_the_arithmetic(numel):
    """k = 64 of every 4096, 12-bit positions, 2-bit values, two fp32 bounds per chunk."""
    k, chunk, bits = 64, 4096, 2
    codec = make_codec("sparse", sparse_k=k, sparse_chunk=chunk, sparse_bits=bits)
    x = heavy_tailed(numel, seed=1)
    payload = codec.encode(x)
    chunks = math.ceil(numel / chunk)
    expected = chunks * 8 + math.ceil(chunks * k * 12 / 8) + math.ceil(chunks * k * bits / 8)
    assert payload.numel() == codec.encoded_bytes(numel) == expected
    decoded = codec.decode(payload, numel)
    for start in range(0, numel, chunk):
        part, back = x[start : start + chunk], decoded[start : start + chunk]
        kept = back != 0
        assert int(kept.sum()) == min(k, part.numel())
        # the kept positions are the largest magnitudes of the chunk
        threshold = part.abs().topk(min(k, part.numel())).values.min()
        assert bool((part[kept].abs() >= threshold).all())
        # 2 bits: the sign is exact, the magnitude is one of two levels: the chunk's smallest or largest kept
        assert bool((back[kept].sign() == part[kept].sign()).all())
        low, high = part[kept].abs().min(), part[kept].abs().max()
        levels = back[kept].abs()
        assert bool(((levels - low).abs() < 1e-7).logical_or((levels - high).abs() < 1e-7).all())


def test_sparse_at_default_settings_is_over_100_times_smaller_than_fp32():
    codec = make_codec("sparse")
    n = 1_082_880  # the tiny Llama preset
    assert 4 * n / codec.encoded_bytes(n) > 100


def test_bit_packing_round_trips_every_width():
    generator = torch.Generator().manual_seed(0)
    for bits in range(1, 17):
        values = torch.randint(0, 2**bits, (1001,), generator=generator)
        packed = pack_bits(values, bits)
        assert packed.numel() == math.ceil(1001 * bits / 8)
        assert torch.equal(unpack_bits(packed, bits, 1001), values)


@pytest.mark.parametrize("name", ["int4", "sparse"])
def test_error_feedback_sends_the_sum_of_the_pseudo_gradients_over_many_rounds(name):
    """Σ sent → Σ Δ: what is not sent now is sent later, so the running error stays bounded by one residual,
    while without feedback the same codec's error grows with the number of rounds."""
    codec = make_codec(name, chunk=64, sparse_k=8, sparse_chunk=128)
    comm = ReplicaComm()  # one replica: Δ = what this replica sent
    feedback = ErrorFeedback(decay=1.0)
    rounds, n = 200, 1024
    true_sum, with_feedback, without = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    generator = torch.Generator().manual_seed(3)
    drift = torch.randn(n, generator=generator) * 1e-3  # a consistent direction plus noise, like training
    for _ in range(rounds):
        delta = drift + 1e-3 * torch.randn(n, generator=generator)
        true_sum += delta
        with_feedback += comm.sum_replicas(delta, codec=codec, feedback=feedback, key="b")[0]
        without += comm.sum_replicas(delta, codec=codec)[0]
    residual = feedback.residuals["b"]
    assert torch.allclose(with_feedback + residual, true_sum, atol=1e-5)  # nothing is lost, only delayed
    error_with = float((with_feedback - true_sum).norm() / true_sum.norm())
    error_without = float((without - true_sum).norm() / true_sum.norm())
    assert error_with < 0.1
    assert error_with < error_without / 3


@pytest.mark.parametrize("name", ["bf16", "fp16", "int8", "int4", "sparse"])
def test_every_codec_works_on_its_input_s_device(name):
    """A codec makes each tensor it needs on the device of what it is given (NCCL exchanges encode and decode on the
    accelerator): on the meta device, which refuses to mix with CPU tensors, the payload and the decoded values
    stay there and have the sizes the codec states."""
    codec = make_codec(name)
    x = torch.empty(10_000, device="meta")
    payload = codec.encode(x)
    decoded = codec.decode(payload, x.numel())
    assert payload.device.type == decoded.device.type == "meta"
    assert payload.numel() == codec.encoded_bytes(x.numel()) and decoded.shape == x.shape
