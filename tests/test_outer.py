"""The outer step on hand-set tiny models, where the expected numbers are written down by hand."""

import json

import pytest
import torch
from helpers import ACCELERATE_CPU_2PROC, ACCELERATE_CPU_4PROC, REPO, accelerate_launch
from torch import nn

from hf_diloco.comm import ReplicaComm, ring_all_gather_bytes, ring_all_reduce_bytes
from hf_diloco.fragments import fragments_of, outer_round
from hf_diloco.outer import OuterState, is_finite, partition_into_buckets


def sync_alone(outer: OuterState) -> None:
    """One blocking outer round of a single replica (Δ = Δ_i)."""
    outer_round(fragments_of(outer), ReplicaComm())


def move_replica(param: nn.Parameter, to: list[float]) -> None:
    with torch.no_grad():
        param.copy_(torch.tensor(to))


def test_nesterov_outer_steps_match_hand_computation():
    """Two rounds of Nesterov SGD (lr 0.5, momentum 0.9) on θ = [1, 2].

    Round 1: θ_i = [0.8, 2.4] -> Δ = [0.2, -0.4]; v = Δ; update = Δ + 0.9 v = [0.38, -0.76];
             θ = [1, 2] - 0.5 [0.38, -0.76] = [0.81, 2.38].
    Round 2: θ_i = [0.71, 2.38] -> Δ = [0.1, 0]; v = 0.9 [0.2, -0.4] + [0.1, 0] = [0.28, -0.36];
             update = [0.1, 0] + 0.9 [0.28, -0.36] = [0.352, -0.324]; θ = [0.81 - 0.176, 2.38 + 0.162].
    """
    replica = nn.Parameter(torch.tensor([1.0, 2.0]))
    outer = OuterState([replica], lr=0.5, momentum=0.9, nesterov=True)

    move_replica(replica, [0.8, 2.4])
    assert fragments_of(outer)[0].pseudo_gradient(0).tolist() == pytest.approx([0.2, -0.4], abs=1e-6)
    sync_alone(outer)
    assert replica.tolist() == pytest.approx([0.81, 2.38], abs=1e-6)

    move_replica(replica, [0.71, 2.38])
    sync_alone(outer)
    assert replica.tolist() == pytest.approx([0.634, 2.542], abs=1e-6)


def outer_steps(deltas: list[torch.Tensor], synced: list[list[bool]], **settings) -> list[float]:
    """θ_global after the outer Nesterov SGD (lr 0.7, β 0.9, and `settings`) of two buckets (θ of 3 and 2 values)
    stepped with `deltas`, bucket b at sync s where synced[s][b], with a checkpoint taken after sync 3 and loaded
    into a new state that continues."""
    replica = [nn.Parameter(torch.tensor([1.0, 2.0, 3.0])), nn.Parameter(torch.tensor([4.0, 5.0]))]
    outer = OuterState(replica, lr=0.7, momentum=0.9, nesterov=True, bucket_numel=3, **settings)
    assert outer.buckets == [[0], [1]]
    (fragment,) = fragments_of(outer)
    for s, delta in enumerate(deltas):
        for b, part in ((0, delta[:3]), (1, delta[3:])):
            if synced[s][b]:
                fragment.outer_step(b, part.clone())
        if s == 3:
            saved = outer.state_dict()
            outer = OuterState(replica, lr=0.7, momentum=0.9, nesterov=True, bucket_numel=3, **settings)
            outer.load_state_dict(saved)
            (fragment,) = fragments_of(outer)
    return torch.cat([p.detach().reshape(-1) for p in outer.global_params]).tolist()


def test_delayed_nesterov_matches_a_hand_loop_and_is_nesterov_sgd_at_delay_1():
    """outer_momentum_delay: over 7 syncs with pseudo-gradients from a seeded generator, two buckets (θ of 3 and 2
    values, the second synced only at every other sync, as a second fragment would be), DelayedNesterov (lr 0.7,
    β 0.9, N = 3, c = 0.5) matches a plain-Python loop of its rule, value by value within 1e-6; its state survives
    a state_dict round trip; with N = 1 and c = 1 it gives torch's Nesterov SGD within 1e-6."""
    torch.manual_seed(0)
    deltas = [torch.randn(5) for _ in range(7)]
    synced = [[True, s % 2 == 0] for s in range(7)]  # bucket 1 syncs at syncs 0, 2, 4, 6

    # the rule, value by value: θ −= η·c·g every sync; every N-th sync of a value, m = β·m + mean(g), θ −= η·β·m
    theta, m, acc, count = [1.0, 2.0, 3.0, 4.0, 5.0], [0.0] * 5, [0.0] * 5, [0] * 5
    for s, delta in enumerate(deltas):
        for j in range(5):
            if not synced[s][j // 3]:
                continue
            g = float(delta[j])
            theta[j] -= 0.7 * 0.5 * g
            acc[j] += g
            count[j] += 1
            if count[j] == 3:
                m[j] = 0.9 * m[j] + acc[j] / 3
                theta[j] -= 0.7 * 0.9 * m[j]
                acc[j], count[j] = 0.0, 0
    assert outer_steps(deltas, synced, momentum_delay=3, delayed_scale=0.5) == pytest.approx(theta, abs=1e-6)
    from hf_diloco.outer import DelayedNesterov

    plain = [nn.Parameter(torch.zeros(5)) for _ in range(2)]
    sgd, delayed = torch.optim.SGD([plain[0]], lr=0.7, momentum=0.9, nesterov=True), DelayedNesterov(
        [plain[1]], lr=0.7, momentum=0.9, delay=1)
    for delta in deltas:
        for param, optimizer in zip(plain, (sgd, delayed), strict=True):
            param.grad = delta.clone()
            optimizer.step()
    assert plain[1].tolist() == pytest.approx(plain[0].tolist(), abs=1e-6)


def test_outer_momentum_restarts_match_a_hand_loop_and_survive_a_checkpoint():
    """outer_momentum_restart: over 7 syncs with seeded pseudo-gradients, two buckets (the second synced at every
    other sync, as a second fragment would be), Nesterov SGD (lr 0.7, β 0.9) restarted every 3 syncs of a value
    matches a plain-Python loop of Nesterov's rule whose momentum is set to 0 every 3 of that value's syncs, within
    1e-6, across a checkpoint taken and loaded between syncs 3 and 4; with a restart after more syncs than the run
    has, it is torch's Nesterov SGD."""
    torch.manual_seed(1)
    deltas = [torch.randn(5) for _ in range(7)]
    synced = [[True, s % 2 == 0] for s in range(7)]

    theta, m, count = [1.0, 2.0, 3.0, 4.0, 5.0], [0.0] * 5, [0] * 5
    for s, delta in enumerate(deltas):
        for j in range(5):
            if not synced[s][j // 3]:
                continue
            if count[j] == 3:
                m[j], count[j] = 0.0, 0
            g = float(delta[j])
            m[j] = 0.9 * m[j] + g  # from 0, the first step's momentum is g, as torch's first step makes it
            theta[j] -= 0.7 * (g + 0.9 * m[j])
            count[j] += 1
    restarted, plain = outer_steps(deltas, synced, momentum_restart=3), outer_steps(deltas, synced)
    assert restarted == pytest.approx(theta, abs=1e-6)
    assert restarted != pytest.approx(plain, abs=1e-3)  # the restarts changed the steps
    assert outer_steps(deltas, synced, momentum_restart=100) == pytest.approx(plain, abs=1e-6)


def test_plain_momentum_differs_from_nesterov():
    """Heavy-ball momentum on the same two rounds: round 2 update is v = [0.28, -0.36] itself."""
    replica = nn.Parameter(torch.tensor([1.0, 2.0]))
    outer = OuterState([replica], lr=0.5, momentum=0.9, nesterov=False)
    move_replica(replica, [0.8, 2.4])
    sync_alone(outer)
    assert replica.tolist() == pytest.approx([0.9, 2.2], abs=1e-6)  # θ - 0.5 Δ
    move_replica(replica, [0.8, 2.2])
    sync_alone(outer)
    # Δ = [0.1, 0]; v = 0.9 [0.2, -0.4] + [0.1, 0] = [0.28, -0.36]; θ = [0.9, 2.2] - 0.5 v
    assert replica.tolist() == pytest.approx([0.76, 2.38], abs=1e-6)


def test_outer_state_keeps_fp32_precision_for_a_bf16_model():
    """A bf16 replica whose outer state is fp32 on CPU: steps too small for bf16 still accumulate in θ_global.

    Outer SGD lr 0.1, no momentum. Every round the replica moves from where the sync left it to r = 1 − 2^-8
    (a bf16 number), so θ_global ← θ_global − 0.1 (θ_global − r), i.e. θ_global_k = r + 0.9^k (1 − r). In bf16
    (spacing 2^-8 below 1) θ_global would stay 1.0 forever, since the first step (0.1 · 2^-8) rounds away. The
    replica receives bf16(θ_global_k): 1.0 while 0.9^k > 1/2 (k ≤ 6), r afterwards.
    """
    r = 1 - 2**-8
    replica = nn.Parameter(torch.tensor([1.0], dtype=torch.bfloat16))
    outer = OuterState([replica], lr=0.1, momentum=0.0, nesterov=False, offload=True)
    assert outer.global_params[0].device.type == "cpu"
    for k in range(1, 11):
        move_replica(replica, [r])
        sync_alone(outer)
        expected = r + 0.9**k * (1 - r)
        assert outer.global_params[0].item() == pytest.approx(expected, abs=1e-7), k
        assert replica.dtype == torch.bfloat16
        assert replica.item() == (1.0 if k <= 6 else r), k
    assert outer.global_params[0].item() == pytest.approx(0.997455775, abs=1e-7)


def test_adamw_outer_steps_match_hand_computation():
    """outer_optimizer adamw: torch's AdamW with beta1 = outer_momentum (0.9), beta2 0.999, eps 1e-8, no weight
    decay, lr 0.1, on θ = [1, 2].

    Round 1: θ_i = [0.8, 2.4] -> Δ = [0.2, -0.4]; bias-corrected m̂ = Δ, v̂ = Δ², so the step is
             lr · Δ / |Δ| = [0.1, -0.1] (up to eps): θ = [0.9, 2.1].
    Round 2: θ_i = [0.8, 2.1] -> Δ = [0.1, 0]; m = 0.9 · 0.1 [0.2, -0.4] + 0.1 [0.1, 0] = [0.028, -0.036];
             v = 0.999 · 0.001 [0.04, 0.16] + 0.001 [0.01, 0] = [4.996e-5, 1.5984e-4];
             m̂ = m / 0.19, v̂ = v / 0.001999; step = 0.1 m̂ / √v̂ = [0.0932179, -0.0670058];
             θ = [0.8067821, 2.1670058].
    """
    replica = nn.Parameter(torch.tensor([1.0, 2.0]))
    outer = OuterState([replica], lr=0.1, momentum=0.9, nesterov=True, optimizer="adamw")
    move_replica(replica, [0.8, 2.4])
    sync_alone(outer)
    assert replica.tolist() == pytest.approx([0.9, 2.1], abs=1e-6)
    move_replica(replica, [0.8, 2.1])
    sync_alone(outer)
    assert replica.tolist() == pytest.approx([0.8067821, 2.1670058], abs=1e-6)
    # Nesterov SGD with the same lr and momentum would give 2 - 0.1 * 1.9 * (-0.4) = 2.076 after round 1.


def test_state_dict_round_trip_continues_identically():
    """Saving and loading the outer state mid-run gives the same next step as never stopping."""
    a = nn.Parameter(torch.tensor([1.0, -1.0]))
    b = nn.Parameter(torch.tensor([1.0, -1.0]))
    first, second = (OuterState([p], lr=0.7, momentum=0.9, nesterov=True) for p in (a, b))
    for outer, p in ((first, a), (second, b)):
        move_replica(p, [0.5, -0.5])
        sync_alone(outer)
    restored = OuterState([b], lr=0.7, momentum=0.9, nesterov=True)
    restored.load_state_dict(second.state_dict())
    for outer, p in ((first, a), (restored, b)):
        move_replica(p, [0.2, 0.1])
        sync_alone(outer)
    assert torch.equal(a, b)


@pytest.mark.parametrize(("spoil", "clause"), [
    (lambda s: s["global_params"].pop(), "it holds 1 parameters where the model has 2 trainable ones"),
    (lambda s: s["global_params"].__setitem__(0, torch.tensor(0.5)),
     "parameter 0 is torch.float32 () where this replica's is torch.float32 (2,)"),
    (lambda s: s["global_params"].__setitem__(1, torch.zeros(3, dtype=torch.float64)),
     "parameter 1 is torch.float64 (3,) where this replica's is torch.float32 (3,)"),
    (lambda s: s["global_params"][1].fill_(float("inf")), "parameter 1 holds NaN or infinite values"),
    (lambda s: s["optimizer"]["state"][0]["momentum_buffer"].fill_(float("nan")),
     "the optimizer's momentum_buffer of parameter 0 holds NaN or infinite values"),
    (lambda s: s["optimizer"]["state"][1].__setitem__("momentum_buffer", torch.zeros(2)),
     "the optimizer's momentum_buffer of parameter 1 is torch.float32 (2,) where the parameter is torch.float32 (3,)"),
    (lambda s: s["optimizer"]["param_groups"][0].__setitem__("lr", float("nan")), "its optimizer setting lr is nan"),
    (lambda s: s["optimizer"]["state"].__setitem__(5, {}), "its optimizer state names parameters this replica does"),
])
def test_an_outer_state_that_does_not_fit_is_refused_whole(spoil, clause):
    """A saved or received outer state is checked against the replica's own (count, shape, dtype, finite values,
    optimizer groups and state) before anything is copied: each spoiled state is refused naming what is wrong, and
    θ_global and the optimizer are left as they were (a scalar is not broadcast, a NaN not taken)."""
    params = [nn.Parameter(torch.tensor([1.0, -1.0])), nn.Parameter(torch.tensor([0.5, 0.25, 2.0]))]
    outer = OuterState(params, lr=0.7, momentum=0.9, nesterov=True)
    move_replica(params[0], [0.5, -0.5])
    sync_alone(outer)
    def copied() -> dict:  # state_dict hands out the live tensors: copies, to spoil one and compare with another
        state = outer.state_dict()
        state["global_params"] = [p.clone() for p in state["global_params"]]
        entries = state["optimizer"]["state"]
        state["optimizer"]["state"] = {i: {k: v.clone() for k, v in e.items()} for i, e in entries.items()}
        return state

    before, state = copied(), copied()
    assert outer.mismatch(state) is None
    spoil(state)
    assert outer.mismatch(state).startswith(clause)
    with pytest.raises(ValueError, match="the outer state does not fit this model: "):
        outer.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(outer.global_params, before["global_params"], strict=True))
    assert torch.equal(outer.optimizer.state_dict()["state"][0]["momentum_buffer"],
                       before["optimizer"]["state"][0]["momentum_buffer"])


def test_buckets_cover_every_parameter_once_and_respect_the_limit():
    numels = [5, 1, 7, 2, 2, 9, 1]
    buckets = partition_into_buckets(numels, bucket_numel=8)
    assert [i for bucket in buckets for i in bucket] == list(range(len(numels)))
    for bucket in buckets:
        assert len(bucket) == 1 or sum(numels[i] for i in bucket) <= 8


def test_bucketed_pseudo_gradient_equals_unbucketed():
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(n)) for n in (3, 4, 5)]
    small = OuterState(params, lr=1.0, momentum=0.0, nesterov=False, bucket_numel=4)
    assert len(small.buckets) == 3
    with torch.no_grad():
        for p in params:
            p.mul_(0.5)
    flat = torch.cat(fragments_of(small)[0].pseudo_gradients())
    expected = torch.cat([(g - p).reshape(-1) for g, p in zip(small.global_params, params, strict=True)])
    assert torch.equal(flat, expected)


def test_single_replica_comm_is_free_and_returns_own_stats():
    comm = ReplicaComm()
    stats = torch.tensor([1.5, 2.0])
    average, gathered, cost = comm.sum_replicas(torch.ones(3), stats=stats)
    assert average.tolist() == [1.0, 1.0, 1.0]
    assert gathered.tolist() == [[[1.5, 2.0]]]  # [member, replica, value]
    assert cost.bytes_sent == 0 and cost.collectives == 0


@pytest.mark.process
@pytest.mark.parametrize("config", [ACCELERATE_CPU_2PROC, ACCELERATE_CPU_4PROC], ids=["M=2", "M=4"])
def test_ring_byte_model_matches_the_bytes_gloo_sends(tmp_path, config):
    """ring_all_reduce_bytes and ring_all_gather_bytes against what gloo really writes to its sockets.

    Real processes, one gloo all-reduce and one all-gather each; bytes measured by the kernel (see
    tests/scripts/wire_bytes.py). gloo adds a small header per message: tolerance 0.5% plus 8 kB.
    """
    result = accelerate_launch([str(REPO / "tests" / "scripts" / "wire_bytes.py"), str(tmp_path)], config=config)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("wire*.json"))]
    world = ranks[0]["world"]
    assert len(ranks) == world == (2 if config == ACCELERATE_CPU_2PROC else 4)
    for rank in ranks:
        for r in rank["results"]:
            for measured, model in ((r["all_reduce"], ring_all_reduce_bytes(r["payload_bytes"], world)),
                                    (r["all_gather"], ring_all_gather_bytes(r["payload_bytes"] * world, world))):
                assert model <= measured <= model * 1.005 + 8192, (world, r)


def test_a_lone_replica_sums_on_its_own_device_and_reads_finiteness_once_per_device():
    """With nobody to reduce with, the fp32 sum stays on the device Δ_i was formed on (a GPU replica's sync never
    passes through the host). `is_finite` finds a NaN or an infinity in any of several tensors."""
    comm = ReplicaComm()
    total, rows, cost = comm.sum_replicas(torch.empty(5, device="meta"))
    assert total.device.type == "meta" and total.shape == (5,) and rows is None and cost.bytes_sent == 0
    assert is_finite([torch.ones(3), torch.zeros(2, 2)])
    assert not is_finite([torch.ones(3), torch.tensor([1.0, float("nan")])])
    assert not is_finite([torch.tensor([float("-inf")]), torch.ones(1)])
