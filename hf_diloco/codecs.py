"""Pseudo-gradient codecs: what a replica puts on the wire instead of fp32 values.

Every codec turns a flat fp32 tensor into a flat uint8 payload and back. The payload's size depends only on the
number of values, so every process knows the size of every other process's payload before it arrives (collectives
need equal sizes) and the byte accounting is exact arithmetic, not an estimate.

    none    fp32, 4 bytes a value (the paper's baseline; sent with a plain all-reduce, no codec involved)
    bf16    bfloat16, 2 bytes a value
    fp16    float16, 2 bytes a value (values beyond ±65504 are clamped to it, so a sum never turns into inf)
    int8    symmetric 8-bit integers (levels −127..127), one fp32 scale (the chunk's largest magnitude) per `chunk`
            values (1024 by default): 1.004 bytes a value
    int4    symmetric 4-bit integers (levels −7..7), two a byte, one fp32 scale per `chunk` values: 0.504 bytes
    sparse  the `k` largest-magnitude values of every `chunk` values (SparseLoCo, arXiv 2508.15706): their
            positions packed in ceil(log2(chunk)) bits each, their values in `bits` bits each (one sign bit,
            bits − 1 bits of magnitude on an even grid between the chunk's smallest and largest kept magnitude,
            two fp32 numbers per chunk); everything not kept is sent as zero

Design choices:
- Rounding is to nearest, deterministic: every process decodes the same bytes to the same fp32 values, which is
  what keeps replicas bit-identical after the outer step.
- Decoded values are always fp32; nothing is summed in reduced precision.
- Error feedback (`ErrorFeedback`) is separate from the codecs: it keeps, per replica, what the codec did not send
  and adds it (decayed) to the next pseudo-gradient, e ← β·e + Δ_i; send C(e); e ← e − decode(C(e)).

>>> codec = make_codec("int8", chunk=4)
>>> x = torch.tensor([1.0, -0.5, 0.25, 0.0, 2.0, 2.0, -2.0, 1.0])
>>> payload = codec.encode(x)
>>> payload.dtype, payload.numel() == codec.encoded_bytes(8) == 2 * 4 + 8   # two fp32 scales, eight codes
(torch.uint8, True)
>>> codec.decode(payload, 8).tolist()[:4] == [1.0, -0.5039370059967041, 0.25196850299835205, 0.0]
True
"""

from __future__ import annotations

import math

import torch

CODECS = ("none", "bf16", "fp16", "int8", "int4", "sparse")
FP16_MAX = 65504.0


# --- bit packing ----------------------------------------------------------------------------------------------


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack non-negative integers below 2**bits into ceil(n·bits/8) bytes, least significant bit first.

    >>> pack_bits(torch.tensor([1, 2, 3]), 2).tolist()   # 01 10 11 -> 0b111001
    [57]
    """
    shifts = torch.arange(bits, dtype=torch.int64, device=values.device)
    bit_rows = ((values.reshape(-1, 1).to(torch.int64) >> shifts) & 1).to(torch.uint8).reshape(-1)
    pad = -bit_rows.numel() % 8
    if pad:
        bit_rows = torch.cat([bit_rows, bit_rows.new_zeros(pad)])
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=values.device)
    return (bit_rows.view(-1, 8) * weights).sum(dim=1, dtype=torch.int32).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of `pack_bits`: the first `count` integers, as int64.

    >>> unpack_bits(pack_bits(torch.tensor([5, 0, 4095, 7]), 12), 12, 4).tolist()
    [5, 0, 4095, 7]
    """
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bit_rows = ((packed.reshape(-1, 1) >> shifts) & 1).reshape(-1)[: count * bits].view(count, bits)
    return (bit_rows.to(torch.int64) << torch.arange(bits, dtype=torch.int64, device=packed.device)).sum(dim=1)


def packed_bytes(count: int, bits: int) -> int:
    return (count * bits + 7) // 8


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8).reshape(-1)


def from_bytes(payload: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret a uint8 slice as `dtype` values (copied first when the slice is not aligned for them: its start,
    or the stride of a row, which PyTorch leaves as it was for a slice of one row that it calls contiguous).

    >>> rows = torch.zeros(1, 7, dtype=torch.uint8)   # one replica's gathered bytes: 3 of body, then a float32
    >>> from_bytes(rows[:, 3:].contiguous(), torch.float32).shape
    torch.Size([1, 1])
    """
    size = torch.empty((), dtype=dtype).element_size()
    if not payload.is_contiguous() or payload.storage_offset() % size or \
            any(payload.stride(d) % size for d in range(payload.dim() - 1)):
        payload = payload.clone(memory_format=torch.contiguous_format)
    return payload.view(dtype)


def _chunked(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """x as rows of `chunk` values, the last row padded with zeros."""
    pad = -x.numel() % chunk
    flat = x.reshape(-1)
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, chunk)


# --- codecs ---------------------------------------------------------------------------------------------------


class Codec:
    """Flat fp32 tensor <-> flat uint8 payload of `encoded_bytes(numel)` bytes."""

    name = "none"

    def encoded_bytes(self, numel: int) -> int:
        return 4 * numel

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return _as_bytes(x.to(torch.float32))

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        return from_bytes(payload, torch.float32)[:numel].clone()


class CastCodec(Codec):
    """bf16 or fp16: each value cast to 16 bits."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.name = "bf16" if dtype == torch.bfloat16 else "fp16"

    def encoded_bytes(self, numel: int) -> int:
        return 2 * numel

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        if self.dtype == torch.float16:
            x = x.clamp(-FP16_MAX, FP16_MAX)
        return _as_bytes(x.to(self.dtype))

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        return from_bytes(payload, self.dtype)[:numel].to(torch.float32)


class IntCodec(Codec):
    """Symmetric integers with one fp32 absmax scale per chunk: int8 (levels ±127) or int4 (±7, two a byte)."""

    def __init__(self, bits: int, chunk: int):
        assert bits in (4, 8), "integer codecs are 8 or 4 bits"
        self.bits, self.chunk = bits, chunk
        self.levels = 2 ** (bits - 1) - 1
        self.name = f"int{bits}"

    def encoded_bytes(self, numel: int) -> int:
        return 4 * math.ceil(numel / self.chunk) + packed_bytes(numel, self.bits)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        rows = _chunked(x.to(torch.float32), self.chunk)
        scale = torch.maximum(rows.amax(dim=1, keepdim=True), -rows.amin(dim=1, keepdim=True))
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        scaled = rows / safe  # the only full-size fp32 temporary; rounded and clamped in place
        codes = scaled.mul_(self.levels).round_().clamp_(-self.levels, self.levels).to(torch.int8)
        del scaled
        codes = codes.reshape(-1)[: x.numel()]  # the padding of the last chunk is not sent
        if self.bits == 8:
            body = codes.view(torch.uint8)
        else:
            nibbles = (codes + 8).to(torch.uint8)  # 1..15; two share a byte
            if nibbles.numel() % 2:
                nibbles = torch.cat([nibbles, nibbles.new_full((1,), 8)])
            pairs = nibbles.view(-1, 2)
            body = pairs[:, 0] | (pairs[:, 1] << 4)
        return torch.cat([_as_bytes(scale), body])

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        chunks = math.ceil(numel / self.chunk)
        scale = from_bytes(payload[: 4 * chunks], torch.float32).view(-1, 1)
        body = payload[4 * chunks :]
        size = chunks * self.chunk if self.bits == 8 else max(chunks * self.chunk, 2 * body.numel())
        values = torch.zeros(size, dtype=torch.float32, device=payload.device)
        if self.bits == 8:
            values[:numel] = body.view(torch.int8)
        else:
            pairs = values[: 2 * body.numel()].view(-1, 2)
            pairs[:, 0] = (body & 0x0F).to(torch.int8) - 8
            pairs[:, 1] = (body >> 4).to(torch.int8) - 8
        values[: chunks * self.chunk].view(chunks, self.chunk).mul_(scale / self.levels)
        return values[:numel]


class SparseCodec(Codec):
    """Top-k of every chunk, positions packed, values quantized to `bits` bits (see the module docstring)."""

    name = "sparse"

    def __init__(self, k: int, chunk: int, bits: int):
        assert 1 <= k <= chunk and 1 <= bits <= 8, "sparse codec needs 1 <= k <= chunk and 1..8 bits"
        self.k, self.chunk, self.bits = k, chunk, bits
        self.index_bits = max(1, math.ceil(math.log2(chunk)))
        self.magnitude_levels = 2 ** (bits - 1)

    def encoded_bytes(self, numel: int) -> int:
        chunks = math.ceil(numel / self.chunk)
        kept = chunks * self.k
        return 8 * chunks + packed_bytes(kept, self.index_bits) + packed_bytes(kept, self.bits)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        rows = _chunked(x.to(torch.float32), self.chunk)
        _, index = rows.abs().topk(self.k, dim=1, sorted=False)
        kept = rows.gather(1, index)
        magnitude = kept.abs()
        if self.magnitude_levels == 1:
            low = high = magnitude.mean(dim=1, keepdim=True)
            level = torch.zeros_like(magnitude, dtype=torch.int64)
        else:
            low = magnitude.amin(dim=1, keepdim=True)
            high = magnitude.amax(dim=1, keepdim=True)
            span = torch.where(high > low, high - low, torch.ones_like(high))
            steps = self.magnitude_levels - 1
            level = torch.round((magnitude - low) / span * steps).clamp_(0, steps).to(torch.int64)
        sign = (kept < 0).to(torch.int64)
        codes = sign | (level << 1)
        return torch.cat([
            _as_bytes(torch.cat([low, high], dim=1)),
            pack_bits(index, self.index_bits),
            pack_bits(codes, self.bits),
        ])

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        chunks = math.ceil(numel / self.chunk)
        kept = chunks * self.k
        bounds = from_bytes(payload[: 8 * chunks], torch.float32).view(chunks, 2)
        offset = 8 * chunks
        index_size = packed_bytes(kept, self.index_bits)
        index = unpack_bits(payload[offset : offset + index_size], self.index_bits, kept).view(chunks, self.k)
        codes = unpack_bits(payload[offset + index_size :], self.bits, kept).view(chunks, self.k)
        low, high = bounds[:, :1], bounds[:, 1:]
        level = (codes >> 1).to(torch.float32)
        if self.magnitude_levels == 1:
            magnitude = high.expand(-1, self.k)
        else:
            magnitude = low + (high - low) * level / (self.magnitude_levels - 1)
        values = torch.where((codes & 1).bool(), -magnitude, magnitude)
        rows = torch.zeros(chunks, self.chunk, dtype=torch.float32, device=payload.device)
        rows.scatter_(1, index, values)
        return rows.reshape(-1)[:numel].contiguous()


def make_codec(name: str, *, chunk: int = 1024, sparse_k: int = 64, sparse_chunk: int = 4096,
               sparse_bits: int = 2) -> Codec:
    """The codec called `name` (one of CODECS)."""
    if name == "none":
        return Codec()
    if name == "bf16":
        return CastCodec(torch.bfloat16)
    if name == "fp16":
        return CastCodec(torch.float16)
    if name == "int8":
        return IntCodec(8, chunk)
    if name == "int4":
        return IntCodec(4, chunk)
    if name == "sparse":
        return SparseCodec(sparse_k, sparse_chunk, sparse_bits)
    raise ValueError(f"unknown compression {name!r}; choose one of {', '.join(CODECS)}")


class ErrorFeedback:
    """What a replica's codec failed to send, per bucket, added (decayed by β) to its next pseudo-gradient.

    The residual is updated in place: `accumulate` turns e into β·e + Δ and returns it; the caller encodes it and
    subtracts what was sent from it, which leaves the new residual. Error feedback costs one bucket-sized tensor
    per bucket (held between rounds) and no temporary.

    >>> feedback = ErrorFeedback(decay=1.0)
    >>> e = feedback.accumulate("b0", torch.tensor([1.0, 2.0]))   # no residual yet: e = Δ
    >>> _ = e.sub_(torch.tensor([1.0, 0.0]))                      # the codec sent [1, 0]
    >>> feedback.accumulate("b0", torch.tensor([0.5, 0.5])).tolist()  # Δ + β·e
    [0.5, 2.5]
    """

    def __init__(self, decay: float, device: torch.device | str = "cpu"):
        self.decay = decay
        self.device = torch.device(device)
        self.residuals: dict[str, torch.Tensor] = {}

    def accumulate(self, key: str, delta: torch.Tensor) -> torch.Tensor:
        """e ← β·e + Δ for bucket `key`, in place; returns e (subtract what is sent from it)."""
        residual = self.residuals.get(key)
        if residual is None:
            residual = self.residuals[key] = delta.to(self.device, torch.float32, copy=True)
            return residual
        return residual.mul_(self.decay).add_(delta.to(residual.device))

    def copy(self, keys: list[str]) -> dict[str, torch.Tensor | None]:
        """The residuals of `keys` as they are now (copies), for `restore` after a round that was rolled back."""
        return {key: None if key not in self.residuals else self.residuals[key].clone() for key in keys}

    def restore(self, kept: dict[str, torch.Tensor | None]) -> None:
        for key, value in kept.items():
            if value is None:
                self.residuals.pop(key, None)
            else:
                self.residuals[key] = value

    def clear(self) -> None:
        """Forget every residual (a replica that healed: what it did not send belonged to a base it left)."""
        self.residuals.clear()

    def state_dict(self) -> dict:
        return {"decay": self.decay, "residuals": dict(self.residuals)}

    def load_state_dict(self, state: dict) -> None:
        self.residuals = {key: value.to(self.device) for key, value in state["residuals"].items()}
