"""Plan a run across sites before renting the GPUs: `hf-diloco plan`.

    hf-diloco plan recipes/paper-150m-c4.yaml --model llama-3.1-70b --replicas 14 --gpus-per-replica 8 --sharded \\
        --gpu h100 --link 1gbit --latency-ms 40 [--json]

For a model, M replicas (one per site, its G GPUs behind one link) and a link, per round of H inner steps: compute
seconds, bytes per replica and wire seconds for every codec, blocked seconds with and without streaming, the
utilisation, the memory per device (the dry run's figures), and the (H, codec, F, τ) that meets a target
utilisation with the fewest bytes. Arithmetic only: nothing is trained, nothing is downloaded.

The model of a round (the symbols docs/guides/planning.md uses):
- compute   C = H · t, t = tokens per inner step of a replica ÷ its tokens/s; tokens/s is measured
            (--tokens-per-second) or G · MFU · peak ÷ FLOPs per token, FLOPs per token = 6 N + 12 · layers · hidden ·
            sequence (weights, forward and backward, plus attention; Chowdhery et al., PaLM, arXiv 2204.02311,
            appendix B; N counts every parameter, the input embedding too).
- bytes     B = what this project's collectives put on a site's link per round: each of the G members sums its
            1/G slice with its counterparts (comm.sync_bytes, bucket by bucket as outer.partition_into_buckets cuts
            the model): fp32 ring all-reduce 2 (M − 1)/M · 4n, a dense codec's reduce-scatter + all-gather
            2 (M − 1)/M · S, the sparse codec's all-gather (M − 1) · S.
- wire      W = hops · L · buckets + B · 8 · framing ÷ rate: the alpha-beta cost of a collective (Thakur, Rabenseifner
            and Gropp, "Optimization of Collective Communication Operations in MPICH", 2005). A ring takes 2 (M − 1)
            steps, the sparse all-gather M − 1, a tree (fp32 only, in the scale table) 2 ⌈log2 M⌉; each bucket is
            one collective, one after the other (outer.py), so each pays its hops. framing = 1514 / 1448: the bytes
            an Ethernet frame of MTU 1500 carries for each byte of TCP payload (IPv4, TCP timestamps).
- blocked   a blocking sync: W. Streaming (F fragments, each overlapped with τ_f inner steps, τ_f < H/F):
            Σ_f max(0, W_f − τ_f · t), τ auto choosing τ_f as the run does (schedule.choose_sync_delay).
            DDP: every step all-reduces the fp32 gradients; the all-reduce overlaps the backward pass (2/3 of a step's
            FLOPs), so a step waits max(0, W_step − 2/3 · t).
- utilisation  C ÷ (C + blocked).

Not modelled, each said in the output: activations in memory; the outer step's and the codecs' compute (measured at
under 1% of a round on CPU); replicas of unequal speed (a round waits for the slowest); TCP below the link's rate
(on this project's shaped links TCP delivered 56-92% of it: benchmarks/results/plan-measured.md).

Design choices:
- Every figure a run also reports comes from the code that produces it there: bytes from comm.sync_bytes and the
  codecs, buckets and fragments from outer.py, τ auto from schedule.py, memory from train.memory_per_process (the
  dry run's sentence; its numbers are read back from it), the model from train.shape_only_model on the meta device.
- Importing this module is light (no torch, no transformers): they load when a plan is made.
- Bad input (a rate of 0, τ ≥ H/F, a model that does not fit the device) is a ConfigError in one sentence.
"""

from __future__ import annotations

import json
import math
import re
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

from .errors import ConfigError

# Bytes an Ethernet frame (MTU 1500) takes on the wire per byte of TCP payload: 1448 payload bytes (1500 less 20 of
# IPv4 and 32 of TCP with timestamps) in 1514 bytes (with the 14-byte Ethernet header), which tc shaping counts.
FRAMING = 1514 / 1448
DEFAULT_LATENCY_MS = 25.0  # one way between sites on one continent (a 50 ms round trip)
DEFAULT_MFU = 0.40  # INTELLECT-1 reports 36.2-41.4% model FLOPs utilisation on H100s (arXiv 2412.01152)
DEFAULT_TARGET = 0.95
DDP_OVERLAP = 2 / 3  # share of a step's FLOPs in the backward pass, which DDP's gradient all-reduce overlaps
MAX_SEARCHED_DELAY = 4  # the search keeps τ < 5, where Streaming DiLoCo finds the overlap robust (arXiv 2501.18512)
H_LADDER = (25, 50, 100, 250, 500, 1000)  # H tried, from the recipe's up to --max-inner-steps, when H must grow
SCALE_REPLICAS = tuple(2**k for k in range(1, 11))  # 2 .. 1,024
AUTO = "auto"


@dataclass(frozen=True)
class Gpu:
    name: str
    peak_flops: float  # dense bf16 FLOP/s
    memory_bytes: float


# Peak dense bf16 tensor FLOP/s and memory, from the vendors' data sheets (B200: glennklockwood.com/garden/processors
# /B200, the HGX part at 1,000 W). A measured --tokens-per-second replaces all of this.
GPUS: dict[str, Gpu] = {
    "h100": Gpu("NVIDIA H100 SXM", 989e12, 80e9),
    "h200": Gpu("NVIDIA H200 SXM", 989e12, 141e9),
    "a100": Gpu("NVIDIA A100 SXM 80GB", 312e12, 80e9),
    "b200": Gpu("NVIDIA B200 (HGX)", 2250e12, 192e9),
    "mi300x": Gpu("AMD Instinct MI300X", 1307e12, 192e9),
    "l40s": Gpu("NVIDIA L40S", 362e12, 48e9),
    "rtx4090": Gpu("NVIDIA GeForce RTX 4090", 165e12, 24e9),
}

# Shapes of published models that are not presets (their config.json values), to plan with `--model NAME`.
MODEL_SHAPES: dict[str, dict] = {
    # meta-llama/Llama-3.2-1B
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    # meta-llama/Llama-2-7b-hf
    "llama-2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=32, vocab_size=32000, tie_word_embeddings=False),
    # meta-llama/Llama-3.1-70B
    "llama-3.1-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                          num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
    # INTELLECT-1 (arXiv 2412.01152): PrimeIntellect-ai/prime, zeroband llama3 "10B" (ffn 1.3 x, multiple of 1024)
    "intellect-1-10b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=42, num_attention_heads=32,
                            num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
    # Covenant-72B (arXiv 2603.08163): 80 layers, hidden 8192, 64 heads, 8 KV heads, vocabulary 262,144
    "covenant-72b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                         num_key_value_heads=8, vocab_size=262144, tie_word_embeddings=False),
}


# --- the link -------------------------------------------------------------------------------------------------------


_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_rate(text: str) -> float:
    """Bits per second from a rate as tc writes it (`100kbit`, `10mbit`, `1gbit`, `2.5gbit`; `mbps` is accepted
    for `mbit`) or a plain number of bits per second.

    >>> parse_rate("100mbit"), parse_rate("1gbit"), parse_rate("2.5Gbps"), parse_rate("1e6")
    (100000000.0, 1000000000.0, 2500000000.0, 1000000.0)
    >>> parse_rate("0")
    Traceback (most recent call last):
    ...
    hf_diloco.errors.ConfigError: --link must be a positive rate such as 100mbit or 1gbit, got '0'.
    """
    found = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kmgt]?)(?:bit|bps|b/s)?\s*", str(text).lower())
    rate = float(found.group(1)) * _UNITS[found.group(2)] if found else 0.0
    if not 0 < rate < math.inf:
        raise ConfigError(f"--link must be a positive rate such as 100mbit or 1gbit, got {text!r}.")
    return rate


def format_rate(bits_per_second: float) -> str:
    """A rate as people write it.

    >>> format_rate(1e8), format_rate(2.5e9), format_rate(1e5)
    ('100 Mbit/s', '2.5 Gbit/s', '100 kbit/s')
    """
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits_per_second >= scale:
            return f"{bits_per_second / scale:.3g} {unit}"
    return f"{bits_per_second:.3g} bit/s"


@dataclass(frozen=True)
class Link:
    """A site's link: `bits_per_second` each way, `latency_seconds` one way per hop of a collective."""

    bits_per_second: float
    latency_seconds: float = DEFAULT_LATENCY_MS / 1000
    framing: float = FRAMING

    def __post_init__(self):
        if not 0 < self.bits_per_second < math.inf:
            raise ConfigError(f"a link needs a positive rate, got {self.bits_per_second!r} bit/s.")
        if not 0 <= self.latency_seconds < math.inf:
            raise ConfigError(f"--latency-ms must be 0 or more, got {1000 * self.latency_seconds!r}.")

    def seconds(self, payload_bytes: float, hops: int) -> float:
        """Alpha-beta time of a collective whose steps wait `hops` latencies and that puts `payload_bytes` on this
        link. 1 MB at 8 Mbit/s with no latency: 1.046 s (the framing); 10 hops of 25 ms add 0.25 s.

        >>> round(Link(8e6, 0.0).seconds(1e6, 0), 3), round(Link(8e6, 0.025).seconds(1e6, 10), 3)
        (1.046, 1.296)
        """
        return hops * self.latency_seconds + payload_bytes * 8 * self.framing / self.bits_per_second


# --- the model ------------------------------------------------------------------------------------------------------


@dataclass
class ModelShape:
    """What the plan needs of a model: its synced (trainable) parameters by name, in order, its size and
    shape, and the dry run's memory per device."""

    name: str
    parameters: int
    synced: list[tuple[str, int]]
    layers: int
    hidden: int
    memory: str = ""  # the dry run's sentence (train.memory_per_process)
    memory_parts: dict[str, float] = field(default_factory=dict)  # its figures, in bytes

    @property
    def synced_values(self) -> int:
        return sum(numel for _, numel in self.synced)

    @property
    def most_fragments(self) -> int:
        """The most fragments a run may cut the synced parameters into (outer.assign_fragments): one per layer, and
        one more for what is outside the layers where anything is (a LoRA model's adapters are all inside).

        >>> ModelShape("m", 10, [("embed.weight", 4), ("layers.0.w", 3), ("layers.1.w", 3)], 2, 8).most_fragments
        3
        >>> ModelShape("m", 10, [("layers.0.lora_A", 4), ("layers.1.lora_A", 4)], 2, 8).most_fragments
        2
        """
        from .outer import layer_of

        return self.layers + any(layer_of(name) is None for name, _ in self.synced)

    def flops_per_token(self, sequence: int) -> float:
        """6 N + 12 · layers · hidden · sequence (PaLM, appendix B).

        >>> ModelShape("m", 1000, [], layers=2, hidden=8).flops_per_token(sequence=10)
        7920
        """
        return 6 * self.parameters + 12 * self.layers * self.hidden * sequence

    def fragment_buckets(self, fragments: int, pattern: str = "strided", bucket_numel: int = 64 * 2**20
                         ) -> list[list[int]]:
        """Values of each bucket of each fragment, as the run cuts them (outer.assign_fragments, then
        outer.partition_into_buckets); ConfigError when the model has too few layers for `fragments`."""
        from .outer import assign_fragments, partition_into_buckets

        try:
            assigned = assign_fragments([name for name, _ in self.synced], fragments, pattern)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        numels = [numel for _, numel in self.synced]
        return [[sum(numels[members[i]] for i in group)
                 for group in partition_into_buckets([numels[i] for i in members], bucket_numel)]
                for members in assigned]

    def device_bytes(self, offload_outer_state: bool = True) -> float:
        """What the dry run counts on each device: parameters, gradients, inner optimizer state, and the outer state
        unless it is offloaded to CPU (the default). Activations are not counted."""
        parts = ["parameters", "gradients", "inner optimizer"] + ([] if offload_outer_state else ["outer state"])
        return sum(self.memory_parts.get(part, 0.0) for part in parts)


def parse_bytes(text: str) -> float:
    """The inverse of metrics.format_bytes.

    >>> parse_bytes("3.50 MB"), parse_bytes("999 B"), parse_bytes("1.25 GB")
    (3500000.0, 999.0, 1250000000.0)
    """
    number, unit = text.split()
    return float(number) * {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}[unit]


def memory_parts(sentence: str) -> dict[str, float]:
    """The figures of train.memory_per_process's sentence, in bytes.

    >>> memory_parts("4.00 GB: parameters 1.00 GB, gradients 1.00 GB, inner optimizer 2.00 GB, outer state 8.00 GB")
    {'total': 4000000000.0, 'parameters': 1000000000.0, 'gradients': 1000000000.0, 'inner optimizer': 2000000000.0, \
'outer state': 8000000000.0}
    """
    size = r"([0-9.]+ (?:B|kB|MB|GB))"
    parts = {"total": parse_bytes(re.match(size, sentence).group(1))}
    for name in ("parameters", "gradients", "inner optimizer", "outer state"):
        found = re.search(rf"{name} {size}", sentence)
        if found:
            parts[name] = parse_bytes(found.group(1))
    return parts


# --- collectives ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CodecSettings:
    """The recipe's codec fields (DiLoCoConfig's compression_chunk, sparse_k, sparse_chunk, sparse_bits)."""

    chunk: int = 1024
    sparse_k: int = 64
    sparse_chunk: int = 4096
    sparse_bits: int = 2

    def make(self, name: str):
        from .codecs import make_codec

        return make_codec(name, chunk=self.chunk, sparse_k=self.sparse_k, sparse_chunk=self.sparse_chunk,
                          sparse_bits=self.sparse_bits)


def codec_names() -> tuple[str, ...]:
    from .codecs import CODECS

    return CODECS


def hops(codec: str, replicas: int, algorithm: str = "ring") -> int:
    """Steps of one collective that each wait a latency: a ring all-reduce or a reduce-scatter + all-gather
    2 (M − 1), the sparse codec's all-gather M − 1, a tree all-reduce (reduce, then broadcast) 2 ⌈log2 M⌉.

    >>> hops("none", 8), hops("int8", 8), hops("sparse", 8), hops("none", 8, "tree"), hops("none", 1)
    (14, 14, 7, 6, 0)
    """
    if replicas <= 1:
        return 0
    if algorithm == "tree":
        return 2 * math.ceil(math.log2(replicas))
    return replicas - 1 if codec == "sparse" else 2 * (replicas - 1)


def bucket_bytes(numel: int, replicas: int, group: int, codec: str, settings: CodecSettings = CodecSettings(),
                 algorithm: str = "ring") -> int:
    """Bytes that cross a site's link to sum one bucket of `numel` values: each of its `group` members sends what
    comm.sync_bytes says for its slice. A tree all-reduce (fp32; NCCL's double binary trees) sends about what a
    ring sends and differs in its latency only (`hops`).

    >>> bucket_bytes(1000, 2, 1, "none"), bucket_bytes(1000, 8, 1, "none"), bucket_bytes(1000, 8, 2, "none")
    (4000, 7000, 7000)
    >>> bucket_bytes(4096, 2, 1, "sparse"), bucket_bytes(4096, 8, 1, "sparse")    # 64 kept: 120 bytes, to M − 1
    (120, 840)
    """
    from .comm import sync_bytes

    assert algorithm == "ring" or codec == "none", "a tree all-reduce sums fp32 values; codecs reduce-scatter"
    return group * sync_bytes(numel, replicas, group, settings.make(codec)) if replicas > 1 else 0


@dataclass(frozen=True)
class Exchange:
    """One fragment's sync (all of its buckets): bytes on a site's link, and seconds."""

    bytes: int
    seconds: float
    buckets: int


def exchange(buckets: list[int], replicas: int, group: int, codec: str, link: Link,
             settings: CodecSettings = CodecSettings(), algorithm: str = "ring") -> Exchange:
    """The buckets of one sync, one collective after the other (outer.py syncs a bucket before the next).

    >>> e = exchange([1000, 1000], replicas=2, group=1, codec="none", link=Link(8e6, 0.01))
    >>> e.bytes, round(e.seconds, 4)           # 2 buckets x 4,000 bytes; 2 x 2 hops of 10 ms
    (8000, 0.0484)
    """
    sent = [bucket_bytes(n, replicas, group, codec, settings, algorithm) for n in buckets]
    steps = hops(codec, replicas, algorithm) * len(buckets)
    return Exchange(sum(sent), link.seconds(sum(sent), steps), len(buckets))


# --- a round --------------------------------------------------------------------------------------------------------


@dataclass
class Setting:
    """Everything a round's prediction depends on."""

    shape: ModelShape
    replicas: int
    link: Link
    step_seconds: float  # one inner step of a replica
    tokens_per_step: int = 0  # per replica (shown, and for bytes per token)
    group: int = 1  # GPUs (processes) per replica, all behind the site's link
    inner_steps: int = 500
    codec: str = "none"  # the recipe's
    fragments: int = 1  # the recipe's
    sync_delay: int | str = 0  # the recipe's τ: 0 (blocking), a number of steps, or "auto"
    pattern: str = "strided"
    bucket_numel: int = 64 * 2**20
    codecs: CodecSettings = CodecSettings()
    target: float = DEFAULT_TARGET

    def __post_init__(self):
        if self.replicas < 1:
            raise ConfigError(f"--replicas must be at least 1, got {self.replicas}.")
        if not 0 < self.step_seconds < math.inf:
            raise ConfigError(f"an inner step must take a positive time, got {self.step_seconds!r} s; give a "
                              f"positive --tokens-per-second.")


@dataclass
class Row:
    """The prediction for one way of syncing, per round of H inner steps of one replica."""

    method: str  # "ddp" or "diloco"
    codec: str
    streaming: bool
    inner_steps: int
    fragments: int
    sync_delay: int | None  # τ (the largest over the fragments with τ auto); None when blocking
    compute_seconds: float
    bytes_per_replica_per_round: int
    wire_seconds: float
    blocked_seconds: float
    utilisation: float
    bytes_per_replica_per_day: float
    sync_delays: list[int] | None = None  # τ of each fragment

    def label(self) -> str:
        if self.method == "ddp":
            return "ddp (fp32 gradients every step)"
        if not self.streaming:
            return f"diloco {self.codec}, " + ("blocking" if self.fragments == 1 else f"F={self.fragments} blocking")
        uniform = not self.sync_delays or len(set(self.sync_delays)) == 1
        return f"diloco {self.codec}, F={self.fragments} τ{'=' if uniform else '≤'}{self.sync_delay}"


def check_schedule(inner_steps: int, fragments: int, sync_delay: int | str) -> None:
    """The rules DiLoCoConfig holds a run to, in its sentences.

    >>> check_schedule(50, 5, 10)
    Traceback (most recent call last):
    ...
    hf_diloco.errors.ConfigError: sync_delay=10 must be below inner_steps/num_fragments=10, so a fragment's sync \
lands before the next one starts.
    """
    if inner_steps < 1 or fragments < 1:
        raise ConfigError(f"inner_steps (H) and num_fragments must be at least 1, got {inner_steps} and {fragments}.")
    if inner_steps % fragments:
        raise ConfigError(f"inner_steps={inner_steps} must be a multiple of num_fragments={fragments}, so that one "
                          f"fragment syncs every inner_steps/num_fragments steps.")
    if sync_delay != AUTO and not 0 <= sync_delay < inner_steps // fragments:
        raise ConfigError(f"sync_delay={sync_delay} must be below inner_steps/num_fragments="
                          f"{inner_steps // fragments}, so a fragment's sync lands before the next one starts.")


def fragment_exchanges(s: Setting, codec: str, fragments: int) -> list[Exchange]:
    """Each fragment's sync with `codec`."""
    return [exchange(buckets, s.replicas, s.group, codec, s.link, s.codecs)
            for buckets in s.shape.fragment_buckets(fragments, s.pattern, s.bucket_numel)]


def delays_for(exchanges: list[Exchange], step_seconds: float, most: int, sync_delay: int | str) -> list[int]:
    """τ of each fragment: the recipe's, or what sync_delay auto settles on once every fragment was measured."""
    from .schedule import choose_sync_delay

    if sync_delay != AUTO:
        return [int(sync_delay)] * len(exchanges)
    return [choose_sync_delay(e.seconds, step_seconds, most=most) for e in exchanges]


def diloco_row(s: Setting, codec: str, inner_steps: int, fragments: int = 1, sync_delay: int | str = 0,
               most_delay: int | None = None) -> Row:
    """A DiLoCo round at steady state: blocking (sync_delay 0) or streamed (F fragments, each overlapped with τ
    inner steps; τ auto up to H/F − 1 as a run chooses it, or up to `most_delay`).

    >>> shape = ModelShape("m", 1000, [("w", 1000)], layers=1, hidden=8)
    >>> s = Setting(shape, replicas=2, link=Link(8e6, 0.0), step_seconds=0.001)
    >>> row = diloco_row(s, "none", inner_steps=50)             # 4,000 bytes: 4 ms at 8 Mbit/s (and framing)
    >>> row.bytes_per_replica_per_round, round(row.wire_seconds, 5), round(row.utilisation, 4)
    (4000, 0.00418, 0.9228)
    >>> row = diloco_row(s, "none", inner_steps=50, sync_delay=AUTO)   # 5 steps of compute cover it
    >>> row.sync_delay, row.blocked_seconds, row.utilisation
    (5, 0.0, 1.0)
    """
    check_schedule(inner_steps, fragments, sync_delay)
    exchanges = fragment_exchanges(s, codec, fragments)
    t, compute = s.step_seconds, inner_steps * s.step_seconds
    wire = sum(e.seconds for e in exchanges)
    streaming = sync_delay != 0
    most = min(inner_steps // fragments - 1, most_delay or inner_steps)
    taus = delays_for(exchanges, t, most, sync_delay) if streaming else None
    blocked = sum(max(0.0, e.seconds - tau * t) for e, tau in zip(exchanges, taus, strict=True)) if taus else wire
    sent = sum(e.bytes for e in exchanges)
    return _row("diloco", codec, streaming, inner_steps, fragments, taus, compute, sent, wire, blocked)


def ddp_row(s: Setting, inner_steps: int) -> Row:
    """Data-parallel across sites for H steps: every step all-reduces the fp32 gradients in a ring over the sites
    (reduced inside each site first), overlapped with the backward pass.

    >>> shape = ModelShape("m", 1000, [("w", 1000)], layers=1, hidden=8)
    >>> row = ddp_row(Setting(shape, replicas=2, link=Link(8e6, 0.0), step_seconds=0.003), inner_steps=50)
    >>> row.bytes_per_replica_per_round, round(row.blocked_seconds, 4), round(row.utilisation, 3)
    (200000, 0.1091, 0.579)
    """
    from .comm import ring_all_reduce_bytes

    per_step = ring_all_reduce_bytes(4 * s.shape.synced_values, s.replicas)
    wire = s.link.seconds(per_step, hops("none", s.replicas))
    waits = max(0.0, wire - DDP_OVERLAP * s.step_seconds)
    return _row("ddp", "none", False, inner_steps, 1, None, inner_steps * s.step_seconds, inner_steps * per_step,
                inner_steps * wire, inner_steps * waits)


def _row(method, codec, streaming, inner_steps, fragments, taus, compute, sent, wire, blocked) -> Row:
    round_seconds = compute + blocked
    return Row(method=method, codec=codec, streaming=streaming, inner_steps=inner_steps, fragments=fragments,
               sync_delay=max(taus) if taus else None, compute_seconds=compute, bytes_per_replica_per_round=sent,
               wire_seconds=wire, blocked_seconds=blocked, utilisation=compute / round_seconds,
               bytes_per_replica_per_day=sent * 86400 / round_seconds, sync_delays=taus)


def fragment_choices(s: Setting, inner_steps: int) -> list[int]:
    """F that a streamed round may use: divisors of H from 1 up to the model's layers, + 1 where parameters lie
    outside the layers (fragment 0 holds them; ModelShape.most_fragments)."""
    return [f for f in range(1, min(inner_steps, s.shape.most_fragments) + 1) if inner_steps % f == 0]


def streamed_row(s: Setting, codec: str, inner_steps: int) -> Row:
    """The streamed round for `codec` at H: the recipe's F and τ when it streams, else the fewest fragments whose
    τ auto, kept below 5, meets the target (or, failing that, the best utilisation)."""
    if s.fragments > 1 or s.sync_delay != 0:
        return diloco_row(s, codec, inner_steps, s.fragments, s.sync_delay or AUTO)
    best = None
    for fragments in fragment_choices(s, inner_steps):
        if inner_steps // fragments < 2:  # τ ≥ 1 needs H/F ≥ 2
            continue
        row = diloco_row(s, codec, inner_steps, fragments, AUTO, most_delay=MAX_SEARCHED_DELAY)
        if row.utilisation >= s.target:
            return row
        if best is None or row.utilisation > best.utilisation + 1e-9:
            best = row
    return best


def plan_rows(s: Setting) -> list[Row]:
    """DDP, then every codec blocking and streamed, at the recipe's H."""
    rows = [ddp_row(s, s.inner_steps)]
    for codec in codec_names():
        rows.append(diloco_row(s, codec, s.inner_steps))
        streamed = streamed_row(s, codec, s.inner_steps)
        if streamed is not None:
            rows.append(streamed)
    return rows


def recipe_row(s: Setting) -> Row:
    """The prediction for the recipe as it stands (its codec, H, F and τ; τ auto as the run settles it)."""
    return diloco_row(s, s.codec, s.inner_steps, s.fragments, s.sync_delay)


@dataclass
class Recommendation:
    inner_steps: int
    codec: str
    fragments: int
    sync_delay: int | None
    utilisation: float
    bytes_per_replica_per_round: int
    meets_target: bool
    reason: str


def recommend(s: Setting, codecs: tuple[str, ...] | None = None, max_inner_steps: int | None = None
              ) -> Recommendation:
    """The (H, codec, F, τ) that meets the target utilisation with the fewest bytes: at the recipe's H if any
    codec and schedule meets it there, else at the smallest larger H of H_LADDER up to `max_inner_steps`. At that
    H: the codec with the fewest bytes per round that meets the target, blocking if it does so, else streamed with
    the fewest fragments. Where nothing meets it, the best utilisation found, saying so."""
    codecs = codecs or codec_names()
    top = max(s.inner_steps, max_inner_steps or 500)
    ladder = [s.inner_steps] + [h for h in H_LADDER if s.inner_steps < h <= top]
    best: Row | None = None
    plain = replace(s, fragments=1, sync_delay=0)  # the search chooses F and τ itself
    for inner_steps in ladder:
        meeting = []
        for codec in codecs:
            for row in (diloco_row(plain, codec, inner_steps), streamed_row(plain, codec, inner_steps)):
                if row is None:
                    continue
                if row.utilisation >= s.target:
                    meeting.append(row)
                    break  # blocking first: streaming only where blocking misses
                if best is None or row.utilisation > best.utilisation + 1e-9:
                    best = row
        if meeting:
            row = min(meeting, key=lambda r: (r.bytes_per_replica_per_round, r.fragments, r.sync_delay or 0))
            moved = "" if inner_steps == s.inner_steps else f" (the recipe's H = {s.inner_steps} cannot)"
            return _recommendation(row, True, f"the fewest bytes per round that reach {s.target:.0%} utilisation "
                                              f"at H = {inner_steps}{moved}")
    return _recommendation(best, False, f"nothing tried reaches {s.target:.0%} (H up to {ladder[-1]}, every codec, "
                                        f"F up to {s.shape.most_fragments}); this is the best utilisation found")


def _recommendation(row: Row, meets: bool, reason: str) -> Recommendation:
    return Recommendation(row.inner_steps, row.codec, row.fragments, row.sync_delay, row.utilisation,
                          row.bytes_per_replica_per_round, meets, reason)


# --- a run, step by step ---------------------------------------------------------------------------------------------


@dataclass
class Timeline:
    loop_seconds: float
    compute_seconds: float
    blocked_seconds: list[float]  # per sync, in launch order
    delays: list[int]  # τ each sync was launched with (0: blocking)


def simulate_run(steps: int, inner_steps: int, step_seconds: float, exchange_seconds: Callable[[list[int]], float],
                 fragments: int = 1, sync_delay: int | str = 0, staggered: bool | None = None,
                 sizes: list[int] | None = None) -> Timeline:
    """The wall time of a run of `steps` inner steps, sync by sync, with the run's own Schedule (schedule.py):
    which fragments are due when, τ auto chosen at each landing from the exchange before (a fragment not measured
    yet gets that exchange scaled by its size), and the end blocking (every fragment at the last step) or
    staggered. `exchange_seconds(fragments)` is a sync's time on the link. A sync launched with τ lands τ steps
    later and waits for the rest of its exchange then; a blocking one waits at once.

    >>> t = simulate_run(100, 50, 0.1, lambda f: 1.0)           # syncs at 50 and 100, each blocking 1 s
    >>> round(t.loop_seconds, 6), t.blocked_seconds
    (12.0, [1.0, 1.0])

    τ auto starts at 1 and chooses at a sync's landing from the exchange before it, so the first two syncs wait
    (0.25 s of exchange, 0.1 s a step); the end is staggered (no sync at the last step):

    >>> t = simulate_run(200, 50, 0.1, lambda f: 0.25, sync_delay=AUTO)
    >>> [round(b, 2) for b in t.blocked_seconds], t.delays, round(t.loop_seconds, 6)
    ([0.15, 0.15, 0.0, 0.0], [1, 1, 3, 3], 20.3)
    """
    from .config import AUTO_DELAY_START
    from .schedule import Schedule

    auto = sync_delay == AUTO
    schedule = Schedule(inner_steps, fragments, sync_delay=AUTO_DELAY_START if auto else int(sync_delay))
    overlapped = schedule.sync_delay > 0
    if overlapped if staggered is None else staggered:
        schedule.place_end(steps)
    sizes = sizes or [1] * fragments
    clock = 0.0
    flight: dict | None = None
    exchanged: tuple[list[int], float] = ([], 0.0)  # the last sync's fragments and seconds (what the next carries)
    blocked: list[float] = []
    delays: list[int] = []
    for step in range(1, steps + 1):
        clock += step_seconds
        if flight is not None and (step >= flight["lands_at"] or step >= steps):
            wait = max(0.0, flight["done_at"] - clock)
            clock += wait
            blocked.append(wait)
            if auto and flight["measured"] and step < steps:
                schedule.choose_delays(flight["measured"], exchange_seconds=flight["measured_seconds"],
                                       step_seconds=step_seconds, sizes=sizes)
                if schedule.end is not None:
                    schedule.place_end(steps, busy_until=step)
            flight = None
        due = schedule.due_fragments(step, steps)
        if not due:
            continue
        seconds = exchange_seconds(due)
        if overlapped and step < steps:
            tau = schedule.launch_delay(step, due)
            flight = {"lands_at": step + tau, "done_at": clock + seconds, "measured": exchanged[0],
                      "measured_seconds": exchanged[1]}
            delays.append(tau)
        else:
            clock += seconds
            blocked.append(seconds)
            delays.append(0)
        exchanged = (due, seconds)
    return Timeline(clock, steps * step_seconds, blocked, delays)


# --- the collective at scale -----------------------------------------------------------------------------------------

SCALE_COLLECTIVES = (("fp32 ring all-reduce", "none", "ring"), ("fp32 tree all-reduce", "none", "tree"),
                     ("int8 reduce-scatter + all-gather", "int8", "ring"),
                     ("int4 reduce-scatter + all-gather", "int4", "ring"), ("sparse all-gather", "sparse", "ring"))


def scale_rows(s: Setting, replicas: tuple[int, ...] = SCALE_REPLICAS) -> list[dict]:
    """Bytes per replica, seconds, and the blocking round's utilisation of each collective as M grows (the whole
    model, every bucket in turn; the tree is what an fp32 all-reduce could do, not what this project runs)."""
    buckets = s.shape.fragment_buckets(1, s.pattern, s.bucket_numel)[0]
    compute = s.inner_steps * s.step_seconds
    rows = []
    for m in replicas:
        for name, codec, algorithm in SCALE_COLLECTIVES:
            e = exchange(buckets, m, s.group, codec, s.link, s.codecs, algorithm)
            rows.append({"replicas": m, "collective": name, "codec": codec, "algorithm": algorithm,
                         "bytes_per_replica": e.bytes, "hops": hops(codec, m, algorithm) * e.buckets,
                         "seconds": e.seconds, "utilisation": compute / (compute + e.seconds)})
    return rows


# --- from a recipe ---------------------------------------------------------------------------------------------------


def load_shape(run, config, group: int, sharded: bool) -> ModelShape:
    """The model named by `run` (a preset, one of MODEL_SHAPES, a local folder or a Hub id), built on the meta device
    as a dry run builds it, with the dry run's memory per device for `group` processes per replica."""
    from .train import memory_per_process, parameter_shares, shape_only_model

    name = run.model_name_or_path
    with tempfile.TemporaryDirectory() as folder:
        if name in MODEL_SHAPES:  # a published shape: its config.json, read the way any local model is
            from transformers import LlamaConfig

            LlamaConfig(**MODEL_SHAPES[name], dtype="bfloat16").save_pretrained(folder)
            run = replace(run, model_name_or_path=folder)
        model = shape_only_model(run)
    shards = group // config.tp_size if sharded else 1
    memory = memory_per_process(model, config, shards, parameter_shares(model, shards, config.tp_size))
    settings = model.config
    return ModelShape(name=name, parameters=sum(p.numel() for p in model.parameters()),
                      synced=[(n, p.numel()) for n, p in model.named_parameters() if p.requires_grad],
                      layers=settings.num_hidden_layers, hidden=settings.hidden_size, memory=memory,
                      memory_parts=memory_parts(memory))


def check_fits(shape: ModelShape, gpu: Gpu, offload_outer_state: bool = True) -> None:
    """Refuse, in one sentence, a model whose training state does not fit one device.

    >>> shape = ModelShape("big", 10**9, [], 1, 8, memory_parts={"parameters": 50e9, "gradients": 50e9})
    >>> check_fits(shape, GPUS["h100"])
    Traceback (most recent call last):
    ...
    hf_diloco.errors.ConfigError: big needs 100.00 GB per device for its parameters, gradients and optimizer state \
(the dry run's figure, before activations), more than the 80.00 GB of an NVIDIA H100 SXM; shard each replica over \
more GPUs (--gpus-per-replica N --sharded) or plan for a larger GPU.
    """
    from .metrics import format_bytes

    need = shape.device_bytes(offload_outer_state)
    if need > gpu.memory_bytes:
        raise ConfigError(f"{shape.name} needs {format_bytes(need)} per device for its parameters, gradients and "
                          f"optimizer state (the dry run's figure, before activations), more than the "
                          f"{format_bytes(gpu.memory_bytes)} of an {gpu.name}; shard each replica over more GPUs "
                          f"(--gpus-per-replica N --sharded) or plan for a larger GPU.")


def setting_from_args(args) -> tuple[Setting, dict]:
    """The Setting of `hf-diloco plan`'s arguments, and what the output says about where its numbers come from."""
    from .recipes import parse_train_args
    from .train import tokens_per_step

    overrides = [item for flag, value in (("--inner_steps", args.inner_steps), ("--compression", args.codec),
                                          ("--num_fragments", args.fragments), ("--sync_delay", args.sync_delay))
                 if value is not None for item in (flag, str(value))]
    if args.model:
        overrides += ["--model_name_or_path", args.model]
    link = Link(parse_rate(args.link), args.latency_ms / 1000)  # what needs no recipe is checked first
    if args.replicas < 1:
        raise ConfigError(f"--replicas must be at least 1, got {args.replicas}.")
    if args.tokens_per_second is not None and not 0 < args.tokens_per_second < math.inf:
        raise ConfigError(f"--tokens-per-second must be positive, got {args.tokens_per_second}.")
    if not 0 < args.mfu <= 1:
        raise ConfigError(f"--mfu must be in (0, 1], got {args.mfu}.")
    run, config = parse_train_args(args.recipe, overrides, checking_only=True)
    group = config.replica_group_size if args.gpus_per_replica is None else args.gpus_per_replica
    if group < 1:
        raise ConfigError(f"--gpus-per-replica must be at least 1, got {group}.")
    sharded = args.sharded or config.sharded_replica
    shape = load_shape(run, config, group, sharded)
    tokens = tokens_per_step(run, config) * max(1, group // config.tp_size)
    gpu = None
    if args.gpu:
        gpu = GPUS[args.gpu]
        check_fits(shape, gpu, config.offload_outer_state)
        per_second = group * args.mfu * gpu.peak_flops / shape.flops_per_token(run.block_size)
        flops = shape.flops_per_token(run.block_size)
        speed = f"{group} x {gpu.name} at {args.mfu:.0%} MFU ({flops:.3g} FLOPs a token)"
    else:
        per_second = args.tokens_per_second
        speed = "measured (--tokens-per-second)"
    delay = AUTO if config.auto_sync_delay else config.sync_delay
    setting = Setting(shape=shape, replicas=args.replicas, link=link, step_seconds=tokens / per_second,
                      tokens_per_step=tokens, group=group, inner_steps=config.inner_steps, codec=config.compression,
                      fragments=config.num_fragments, sync_delay=delay, pattern=config.fragment_pattern,
                      bucket_numel=max(1, int(config.sync_bucket_mb * 2**20 / 4)),
                      codecs=CodecSettings(config.compression_chunk, config.sparse_k, config.sparse_chunk,
                                           config.sparse_bits), target=args.target)
    context = {"tokens_per_second_per_replica": per_second, "throughput": speed,
               "device": None if gpu is None else asdict(gpu), "sharded": sharded, "tp_size": config.tp_size}
    return setting, context


ASSUMPTIONS = (
    "one replica per site; its GPUs' syncs share the site's link, full duplex at the given rate",
    "TCP reaches the link's rate (on this project's shaped links it reached 56-92% of it: a slower link is the "
    "remedy, e.g. --link at the goodput iperf3 measures)",
    "sites of equal speed (a round waits for the slowest)",
    "the outer step, encoding and decoding take no time (under 1% of a round measured on CPU)",
    "memory per device: the dry run's parameters, gradients and optimizer state (outer state on CPU unless "
    "offload_outer_state is false), no activations",
    "tensor parallel inside a replica is not modelled in the bytes",
)


def plan(setting: Setting, context: dict | None = None, scale: bool = False, max_inner_steps: int = 500) -> dict:
    """The whole prediction as one JSON-ready object (what `hf-diloco plan --json` prints)."""
    s = setting
    rows = plan_rows(s)
    result = {
        "model": s.shape.name, "model_parameters": s.shape.parameters, "synced_values": s.shape.synced_values,
        "replicas": s.replicas, "gpus_per_replica": s.group,
        "link": {"bits_per_second": s.link.bits_per_second, "latency_seconds": s.link.latency_seconds,
                 "framing": s.link.framing},
        "inner_steps": s.inner_steps, "tokens_per_step_per_replica": s.tokens_per_step,
        "step_seconds": s.step_seconds, "compute_seconds_per_round": s.inner_steps * s.step_seconds,
        "memory_per_device": s.shape.memory, "memory_bytes_per_device": s.shape.memory_parts,
        "target_utilisation": s.target,
        "rows": [asdict(row) for row in rows],
        "recipe": asdict(recipe_row(s)),
        "recommendation": asdict(recommend(s, max_inner_steps=max_inner_steps)),
        "assumptions": list(ASSUMPTIONS),
        **(context or {}),
    }
    if scale:
        result["scale"] = scale_rows(s)
    return result


def predict(recipe: str, **options) -> dict:
    """What `hf-diloco plan RECIPE ... --json` prints, from Python (the app's Preview): `options` are the command's
    flags, spelt with underscores (`replicas=8, link="1gbit", gpu="h100", sync_delay="auto", sharded=True`).
    Loads torch and transformers, as the command does: a page that must stay light runs the command instead.

    Args:
        recipe: a recipe's path (recipes/*.yaml or one of the user's).
        **options (str | int | float | bool): the flags of `hf-diloco plan` (`hf-diloco plan --help` lists them);
            True for a switch.

    Returns:
        dict: the plan as `--json` prints it: the setting, one row per method (DDP, DiLoCo with each codec and
            schedule) with its bytes, seconds and utilisation, and the recommendation.

    Examples:
        >>> from pathlib import Path
        >>> recipe = Path(__file__).resolve().parents[1] / "recipes" / "tiny-pretrain.yaml"
        >>> planned = predict(str(recipe), replicas=2, link="10mbit", tokens_per_second=15000)
        >>> best, first = planned["recommendation"], planned["rows"][0]
        >>> first["method"], best["inner_steps"], best["meets_target"]
        ('ddp', 50, True)
    """
    from .recipes import Parser

    argv = ["plan", recipe]
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not None and value is not False:
            argv += [flag, str(value)]
    parser = Parser(prog="hf-diloco")
    add_subcommand(parser.add_subparsers(dest="command", required=True, parser_class=Parser))
    args = parser.parse_args(argv)
    setting, context = setting_from_args(args)
    return plan(setting, context, scale=args.scale, max_inner_steps=args.max_inner_steps)


# --- the command -----------------------------------------------------------------------------------------------------


def cmd_plan(args) -> int:
    setting, context = setting_from_args(args)
    result = plan(setting, context, scale=args.scale, max_inner_steps=args.max_inner_steps)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


def render(result: dict) -> str:
    """`hf-diloco plan`'s text: the setting, one line per way of syncing, the recommendation, the assumptions."""
    from .metrics import format_bytes

    link = result["link"]
    head = [
        "hf-diloco plan: nothing was downloaded or trained",
        f"  model                      {result['model']} ({result['model_parameters']:,} parameters, "
        f"{result['synced_values']:,} synced)",
        f"  replicas                   {result['replicas']} of {result['gpus_per_replica']} GPU(s) each, one per site",
        f"  link                       {format_rate(link['bits_per_second'])} each way, "
        f"{1000 * link['latency_seconds']:g} ms one way per hop",
        f"  compute                    {result['throughput']}: {result['tokens_per_second_per_replica']:,.0f} "
        f"tokens/s a replica, {result['step_seconds']:.3g} s a step of {result['tokens_per_step_per_replica']:,} "
        f"tokens, {result['compute_seconds_per_round']:,.1f} s a round of H = {result['inner_steps']}",
        f"  memory per device          {result['memory_per_device']}",
        "",
        f"  {'per round, per replica':<34} {'sent':>10} {'wire s':>10} {'blocked s':>10} {'utilisation':>11} "
        f"{'per day':>10}",
    ]
    lines = [f"  {Row(**row).label():<34} {format_bytes(row['bytes_per_replica_per_round']):>10} "
             f"{row['wire_seconds']:>10.3g} {row['blocked_seconds']:>10.3g} {row['utilisation']:>11.1%} "
             f"{format_bytes(row['bytes_per_replica_per_day']):>10}" for row in result["rows"]]
    mine, best = result["recipe"], result["recommendation"]
    tau = "blocking" if best["sync_delay"] is None else f"F = {best['fragments']}, τ auto (up to {best['sync_delay']})"
    tail = [
        "",
        f"  the recipe as it stands    {Row(**mine).label()}: {mine['utilisation']:.1%}, "
        f"{format_bytes(mine['bytes_per_replica_per_round'])} a round",
        f"  recommendation             H = {best['inner_steps']}, {best['codec']}, {tau}: {best['utilisation']:.1%} "
        f"utilisation, {format_bytes(best['bytes_per_replica_per_round'])} a round per replica ({best['reason']})",
    ]
    if "scale" in result:
        tail += ["", "  the collective as M grows (whole model, blocking)", f"  {'M':>5} {'collective':<34} "
                 f"{'sent':>10} {'seconds':>10} {'utilisation':>11}"]
        tail += [f"  {r['replicas']:>5} {r['collective']:<34} {format_bytes(r['bytes_per_replica']):>10} "
                 f"{r['seconds']:>10.3g} {r['utilisation']:>11.1%}" for r in result["scale"]]
    tail += ["", "  assumed: " + "; ".join(result["assumptions"]) + "."]
    return "\n".join(head + lines + tail)


def add_subcommand(sub) -> None:
    """Register `hf-diloco plan` on the CLI's sub-parsers."""
    plan_parser = sub.add_parser(
        "plan", help="predict utilisation, bytes and memory of a run across sites, and recommend H, codec, F and τ")
    plan_parser.add_argument("recipe", help="recipe YAML, e.g. recipes/paper-150m-c4.yaml (its batch, block size, "
                                            "H, codec, fragments and τ are the plan's)")
    plan_parser.add_argument("--model", help="a preset, a local model folder, a Hub id, or a published shape: "
                                             + ", ".join(MODEL_SHAPES) + " (default: the recipe's)")
    plan_parser.add_argument("--replicas", type=int, required=True, metavar="M", help="replicas, one per site")
    plan_parser.add_argument("--gpus-per-replica", type=int, metavar="G",
                             help="GPUs (processes) in each replica (default: the recipe's replica_group_size)")
    plan_parser.add_argument("--sharded", action="store_true",
                             help="each replica shards the model over its GPUs with FSDP2 (default: the recipe's)")
    plan_parser.add_argument("--link", required=True, metavar="RATE",
                             help="each site's link, each way: 100mbit, 1gbit, 10gbit (the goodput iperf3 measures, "
                                  "if you know it)")
    plan_parser.add_argument("--latency-ms", type=float, default=DEFAULT_LATENCY_MS, metavar="L",
                             help=f"one-way latency between sites, paid by every step of a collective (default "
                                  f"{DEFAULT_LATENCY_MS:g}: half a 50 ms ping)")
    speed = plan_parser.add_mutually_exclusive_group(required=True)
    speed.add_argument("--tokens-per-second", type=float, metavar="X",
                       help="measured tokens/s of one replica (all its GPUs) training this recipe")
    speed.add_argument("--gpu", choices=sorted(GPUS), help="GPU kind: tokens/s from its peak bf16 FLOP/s and --mfu, "
                                                           "and the memory check")
    plan_parser.add_argument("--mfu", type=float, default=DEFAULT_MFU,
                             help=f"model FLOPs utilisation with --gpu (default {DEFAULT_MFU:g}, INTELLECT-1's "
                                  f"36.2-41.4%% on H100s)")
    plan_parser.add_argument("--inner-steps", type=int, metavar="H", help="H instead of the recipe's")
    plan_parser.add_argument("--codec", help="compression instead of the recipe's (none, bf16, fp16, int8, int4, "
                                             "sparse)")
    plan_parser.add_argument("--fragments", type=int, metavar="F", help="streaming fragments instead of the recipe's")
    plan_parser.add_argument("--sync-delay", metavar="TAU", help="τ (steps a sync overlaps) or auto, instead of the "
                                                                 "recipe's")
    plan_parser.add_argument("--target", type=float, default=DEFAULT_TARGET,
                             help=f"utilisation the recommendation must reach (default {DEFAULT_TARGET:g})")
    plan_parser.add_argument("--max-inner-steps", type=int, default=500, metavar="H",
                             help="the largest H the recommendation may choose (default 500, the paper's)")
    plan_parser.add_argument("--scale", action="store_true",
                             help="also each collective's bytes and seconds as M grows from 2 to 1,024")
    plan_parser.add_argument("--json", action="store_true", help="print one JSON object (rows, recommendation, ...)")
    plan_parser.set_defaults(func=cmd_plan)
