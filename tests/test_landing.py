"""Every sync kind lands with the same arithmetic: α, the weight sent and the outer step are the same whether the sync
blocks (τ = 0: fragments.outer_round, Algorithm 1 one bucket at a time) or overlaps τ inner steps
(fragments.exchange, then fragments.land), for one fragment or several.

The model has known gradients: its loss is Σ g·w with a fixed g per weight, so inner SGD moves each weight by −η·g
every step whatever the weights are, and the whole trajectory is arithmetic. The reference below replays the syncs
the run recorded (the step each was launched at and landed at, the fragments it carried) on plain float64 numbers:

    launch at step s:  Δ_f = base_f − θ_f(s)                      (an overlapped sync snapshots it here)
    land at step t:    base_f ← base_f − λ·Δ_f                     (outer SGD, lr λ, no momentum; M = 1: Δ is Δ_1)
                       θ_f(t) ← α·θ_f(t) + (1 − α)·base_f      (α = 0 at the last step: the final model is global)
                       θ_f(t) ← base_f + (θ_f(t) − θ_f(s))     (overlap_landing eager, before the last step)

and the run's parameters after every inner step must match it to 1e-5 (fp32 rounding over a few dozen steps of
values of order 1). The schedule is the run's (tests/test_schedule.py checks it); the landing arithmetic is what is
checked here.
"""

import json

import pytest
import torch
from torch import nn
from transformers import TrainerCallback, default_data_collator

from hf_diloco import DiLoCoConfig, DiLoCoTrainer, engine
from hf_diloco.backends import SyncStart
from hf_diloco.codecs import ErrorFeedback, make_codec
from hf_diloco.comm import ReplicaComm
from hf_diloco.fragments import Fragment, exchange, fragments_of, land, outer_round
from hf_diloco.outer import OuterState

ETA, LAMBDA, H, STEPS = 0.1, 0.7, 4, 12
GRADIENTS = {"head.w": [0.5, -1.0, 0.25], "layers.0.w": [1.0, -0.5], "layers.1.w": [-0.75, 2.0]}


class KnownGradients(nn.Module):
    """loss = Σ g·w: the gradient of every weight is its fixed g."""

    def __init__(self):
        super().__init__()
        self.head = nn.Module()
        self.head.w = nn.Parameter(torch.tensor([0.3, -0.2, 0.1]))
        self.layers = nn.ModuleList([nn.Module(), nn.Module()])
        self.layers[0].w = nn.Parameter(torch.tensor([1.0, 2.0]))
        self.layers[1].w = nn.Parameter(torch.tensor([-1.0, 0.5]))
        self.g = {name: torch.tensor(g) for name, g in GRADIENTS.items()}

    def forward(self, x):
        loss = sum((param * self.g[name]).sum() for name, param in self.named_parameters())
        return {"loss": loss + 0.0 * x.sum()}


class Trajectory(TrainerCallback):
    """The replica's parameters after every inner step (after the DiLoCo callback's sync of that step)."""

    def __init__(self, model):
        self.model, self.steps = model, {}

    def on_step_end(self, args, state, control, **kwargs):
        self.steps[state.global_step] = {n: p.detach().double().clone() for n, p in self.model.named_parameters()}


def run(tmp_path, fragments: int, delay: int, alpha: float, landings: list | None = None, landing: str = "mix"):
    model = KnownGradients()
    start = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    args = DiLoCoConfig(
        output_dir=str(tmp_path), inner_steps=H, num_fragments=fragments, sync_delay=delay, fragment_alpha=alpha,
        overlap_landing=landing,
        final_sync="blocking", outer_lr=LAMBDA, outer_momentum=0.0, outer_nesterov=False, optim="sgd",
        learning_rate=ETA, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0,
        max_steps=STEPS, per_device_train_batch_size=1, save_strategy="no", save_every_rounds=0, report_to="none",
        disable_tqdm=True, use_cpu=True, seed=0)
    data = [{"x": torch.zeros(1)} for _ in range(STEPS)]
    trainer = DiLoCoTrainer(model=model, args=args, train_dataset=data, data_collator=default_data_collator)
    trajectory = Trajectory(model)
    trainer.add_callback(trajectory)
    with pytest.MonkeyPatch.context() as patch:  # every landing goes through outer_round or land: count them
        patch.setattr(engine, "land", lambda *a: landings.append((a[1], a[2] is not None)) or land(*a))
        patch.setattr(engine, "outer_round",
                      lambda *a, **k: landings.append((k["alpha"], False)) or outer_round(*a, **k))
        trainer.train()
    records = [json.loads(line) for line in (tmp_path / "syncs.jsonl").read_text().splitlines()]
    return start, trajectory.steps, records


def fragment_of(name: str, fragments: int) -> int:
    """hf_diloco.outer.assign_fragments on this model: the head is fragment 0, the layers share the others."""
    if fragments == 1:
        return 0
    return 0 if name.startswith("head") else 1 + int(name.split(".")[1]) % (fragments - 1)


def reference(start: dict, records: list[dict], fragments: int, alpha: float, eager: bool = False) -> dict[int, dict]:
    theta = {n: v.clone() for n, v in start.items()}
    base = {n: v.clone() for n, v in start.items()}
    launches = {r.get("launch_step", r["step"]): r for r in records}
    landings = {}
    for r in records:
        landings.setdefault(r["step"], []).append(r)
    in_flight: dict[int, dict] = {}  # id(record) -> its Δ per parameter
    expected = {}
    for step in range(1, STEPS + 1):
        for name in theta:
            theta[name] = theta[name] - ETA * torch.tensor(GRADIENTS[name], dtype=torch.float64)
        order = [r for r in landings.get(step, []) if r.get("launch_step", step) < step]  # overlapped ones first
        if step in launches:
            order.append(launches[step])
        for r in order:
            names = [n for n in theta if fragment_of(n, fragments) in r["fragments"]]
            if id(r) not in in_flight:  # launch: Δ_f = base_f − θ_f, and θ_f as it is now
                in_flight[id(r)] = {n: (base[n] - theta[n], theta[n].clone()) for n in names}
            if r["step"] != step:
                continue
            launched = in_flight.pop(id(r))
            kept = alpha if step < STEPS else 0.0  # the last step's landings make the final model global
            for n in names:                                                  # land
                delta, at_launch = launched[n]
                base[n] = base[n] - LAMBDA * delta
                if eager and step < STEPS:
                    theta[n] = base[n] + (theta[n] - at_launch)
                else:
                    theta[n] = kept * theta[n] + (1 - kept) * base[n]
        expected[step] = {n: v.clone() for n, v in theta.items()}
    return expected


CASES = [  # (fragments, τ, α, landing): blocking and overlapped, one fragment and two, mixed and eager
    (1, 0, 0.5, "mix"), (1, 2, 0.5, "mix"), (2, 0, 0.5, "mix"), (2, 1, 0.5, "mix"), (1, 0, 0.0, "mix"),
    (2, 1, 0.0, "mix"), (1, 2, 0.0, "eager"), (2, 1, 0.0, "eager"),
]


@pytest.mark.parametrize(("fragments", "delay", "alpha", "landing"), CASES,
                         ids=[f"F{f}-tau{t}-alpha{a}-{x}" for f, t, a, x in CASES])
def test_the_trajectory_is_the_arithmetic_for_every_sync_kind(tmp_path, fragments, delay, alpha, landing):
    landings = []
    eager = landing == "eager"
    start, steps, records = run(tmp_path, fragments, delay, alpha, landings, landing)
    assert len(records) >= 3 * fragments, f"expected a sync per fragment per round, got {len(records)}"
    overlapped = [r.get("launch_step", r["step"]) != r["step"] for r in records]
    assert landings == [(alpha if r["step"] < STEPS else 0.0, eager and o and r["step"] < STEPS)
                        for r, o in zip(records, overlapped, strict=True)], \
        "every sync, blocking or overlapped, lands through outer_round or land with α (0 at the last step)"
    assert any(overlapped) == (delay > 0)
    assert all(r["in_flight_steps"] == r["step"] - r["launch_step"] == delay
               for r, o in zip(records, overlapped, strict=True) if o), "the steps each overlapped sync was in flight"
    expected = reference(start, records, fragments, alpha, eager)
    worst = max((steps[s][n] - expected[s][n]).abs().max().item() for s in expected for n in expected[s])
    assert worst <= 1e-5, f"largest difference from the arithmetic {worst:.2e}"
    if alpha > 0 or eager:  # α or the eager landing did something: the same syncs mixed with α = 0 pass elsewhere
        without = reference(start, records, fragments, 0.0)
        moved = max((without[s][n] - expected[s][n]).abs().max().item() for s in range(1, STEPS) for n in expected[s])
        assert moved > 1e-2, f"{landing} α = {alpha} and mix α = 0 give the same trajectory (difference {moved:.2e})"
    # The final model is the global one: the last step's blocking sync carries every fragment, and lands with α = 0.
    assert any(r["step"] == STEPS and len(r["fragments"]) == fragments for r in records)
    assert all(r["inner_lr"] == ETA and r["outer_lr"] == LAMBDA for r in records), "the learning rates of each sync"


class LayersOnly(KnownGradients):
    """Every parameter inside a layer (as a LoRA model's adapters are): no fragment of parameters outside them."""

    def __init__(self, layers: int = 2):
        nn.Module.__init__(self)
        self.layers = nn.ModuleList([nn.Module() for _ in range(layers)])
        for number, layer in enumerate(self.layers):
            layer.w = nn.Parameter(torch.full((2,), float(number)))
        self.g = {f"layers.{n}.w": torch.tensor([1.0, -1.0]) for n in range(layers)}


def diloco_args(tmp_path, **settings) -> DiLoCoConfig:
    settings = {"inner_steps": H, **settings}
    return DiLoCoConfig(output_dir=str(tmp_path), optim="sgd", learning_rate=ETA, max_steps=STEPS,
                        per_device_train_batch_size=1, save_strategy="no", save_every_rounds=0, report_to="none",
                        disable_tqdm=True, use_cpu=True, **settings)


class FragmentStates(TrainerCallback):
    """Each fragment's (in_flight, last_synced) after every inner step, read from the engine's own objects."""

    def __init__(self):
        self.engine, self.steps = None, {}

    def on_step_end(self, args, state, control, **kwargs):
        self.steps[state.global_step] = [(f.in_flight, f.last_synced) for f in self.engine.fragments]


def test_each_fragment_owns_its_base_residual_sync_in_flight_and_last_sync(tmp_path):
    """Two fragments, τ = 1, int8 with error feedback: a fragment's `in_flight` is the step its sync was launched at
    from that step until it lands, then None, and `last_synced` the step it landed at, as the records say; its
    `base` is θ_global's own tensors of its parameters (the final model, α = 0 at the end), its `residual` the
    error-feedback residuals of its buckets and no other's."""
    model = KnownGradients()
    args = diloco_args(tmp_path, inner_steps=H, num_fragments=2, sync_delay=1, outer_lr=LAMBDA, outer_momentum=0.0,
                       outer_nesterov=False, compression="int8", error_feedback=True, lr_scheduler_type="constant",
                       warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0)
    trainer = DiLoCoTrainer(model=model, args=args, train_dataset=[{"x": torch.zeros(1)}] * STEPS,
                            data_collator=default_data_collator)
    states = FragmentStates()
    states.engine = next(c for c in trainer.callback_handler.callbacks if hasattr(c, "engine")).engine
    trainer.add_callback(states)
    trainer.train()
    records = [json.loads(line) for line in (tmp_path / "syncs.jsonl").read_text().splitlines()]
    expected = {step: [(None, None), (None, None)] for step in range(1, STEPS + 1)}
    for r in sorted(records, key=lambda r: r["step"]):
        launched, landed = r.get("launch_step", r["step"]), r["step"]
        for f in r["fragments"]:
            for step in range(launched, STEPS + 1):
                in_flight = launched if step < landed else expected[step][f][0] if step > landed else None
                expected[step][f] = (in_flight, landed if step >= landed else expected[step][f][1])
    assert any(r.get("launch_step", r["step"]) < r["step"] for r in records), "some syncs overlapped"
    assert states.steps == expected
    engine = states.engine
    outer = engine.outer
    for fragment in engine.fragments:  # its θ_global is the outer optimizer's own tensors; its residuals its own
        for b in fragment.buckets:
            held = [outer.global_params[i] for i in outer.buckets[b]]
            assert all(a is b for a, b in zip(fragment.theta_global[b], held, strict=True))
        assert sorted(fragment.feedback.residuals) == sorted(str(b) for b in fragment.buckets)
    final = torch.cat([p.detach().flatten() for p in model.parameters()])
    bases = torch.cat([t.detach().flatten() for f in engine.fragments for b in f.buckets for t in f.theta_global[b]])
    assert torch.equal(final.sort().values, bases.sort().values), "the final model is every fragment's base"


def test_a_model_whose_parameters_are_all_in_layers_syncs_something_in_every_sync(tmp_path):
    """Fragment 0 holds the parameters outside the layers; with none, the layers are spread over every fragment
    instead of leaving fragment 0 empty (every other sync would exchange nothing)."""
    model = LayersOnly()
    trainer = DiLoCoTrainer(model=model, args=diloco_args(tmp_path, num_fragments=2),
                            train_dataset=[{"x": torch.zeros(1)}] * STEPS, data_collator=default_data_collator)
    trainer.train()
    records = [json.loads(line) for line in (tmp_path / "syncs.jsonl").read_text().splitlines()]
    assert {tuple(r["fragments"]) for r in records} >= {(0,), (1,)}
    assert all(r["synced_parameters"] == 2 for r in records if len(r["fragments"]) == 1), \
        [(r["fragments"], r["synced_parameters"]) for r in records]


def test_more_fragments_than_layers_is_refused_in_one_sentence_naming_the_parameters(tmp_path):
    model = LayersOnly(layers=2)
    trainer = DiLoCoTrainer(model=model, args=diloco_args(tmp_path, num_fragments=3, inner_steps=3),
                            train_dataset=[{"x": torch.zeros(1)}] * STEPS, data_collator=default_data_collator)
    with pytest.raises(Exception) as raised:
        trainer.train()
    message = str(raised.value)
    assert type(raised.value).__name__ == "ConfigError", message
    assert "num_fragments=3" in message and "layers.0.w" in message and "use at most 2 fragments" in message
    assert not (tmp_path / "syncs.jsonl").exists() or not (tmp_path / "syncs.jsonl").read_text()


class Voting(ReplicaComm):
    """One process whose syncs are voted on, as torchft's are, with the answer given."""

    votes = True

    def __init__(self, commit: bool):
        super().__init__()
        self.commit = commit

    def vote(self) -> bool:
        return self.commit


@pytest.mark.parametrize("commit", [True, False], ids=["committed", "rolled back"])
def test_a_voted_sync_lands_through_the_same_call_or_rolls_back(commit):
    """A sync that votes averages every bucket before the vote, then lands through land as any other:
    committed, with the outer step and α; rolled back, touching neither θ_global, θ_i nor the error-feedback residual
    (the replica sends the same progress again). One replica: Δ = Δ_1, exact arithmetic (outer SGD lr 0.5, α 0.25)
    with int8 + error feedback, whose decoded Δ is compared to the outer step it made."""
    theta = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5, 4.0]))
    outer = OuterState([theta], lr=0.5, momentum=0.0, nesterov=False)
    with torch.no_grad():
        theta.sub_(torch.tensor([0.1, -0.3, 0.2, 0.05]))  # the round's inner steps
    before_global, before_local = outer.global_params[0].detach().clone(), theta.detach().clone()
    feedback = ErrorFeedback(0.9, "cpu")
    comm = Voting(commit)
    fragment = Fragment(0, [0], outer, feedback)
    landed = exchange(comm, [fragment], [fragment.pseudo_gradient(0)], codec=make_codec("int8"), finite=True)
    assert isinstance(landed.averaged, list)
    # committed: the residual holds what int8 did not send; rolled back: as before the sync (none yet)
    assert ("0" in feedback.residuals) is commit
    result = land(landed, alpha=0.25)
    assert result.committed is commit
    if commit:
        delta = landed.averaged[0][2]  # what the others decoded: the codec's Δ, not the exact one
        expected_global = before_global - 0.5 * delta
        assert torch.allclose(outer.global_params[0].detach(), expected_global, atol=1e-6)
        assert torch.allclose(theta.detach(), 0.25 * before_local + 0.75 * expected_global, atol=1e-6)
        exact = before_global - before_local
        assert torch.allclose(feedback.residuals["0"], exact - delta, atol=1e-6)  # Δ_i − what was sent
    else:
        assert torch.equal(outer.global_params[0].detach(), before_global)
        assert torch.equal(theta.detach(), before_local)


def engine_with_flight(round_seconds: float, together: bool = False):
    """A SyncEngine whose backend, landing and launch are stand-ins, with an overlapped sync in flight launched at
    step 10 with τ 2 whose exchange is running (its future unset); `together`: the backend lands windows together
    and this sync's start, known in the background, says it lands together (a save falls at it). Returns (engine,
    the flight, the calls it records: ("land", launched at, step), ("launch", step))."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    calls = []
    sync_engine = object.__new__(engine.SyncEngine)
    sync_engine.args = SimpleNamespace(round_seconds=round_seconds, sync_timeout=5.0)
    sync_engine.backend = SimpleNamespace(run_over=lambda: False, due=lambda step, max_steps, progress: True,
                                          take_window=lambda: (0, 10, 1) if together else None,
                                          agrees_windows=together,
                                          comm=SimpleNamespace(control=SimpleNamespace(members_any=bool)))
    sync_engine.schedule, sync_engine.progress = SimpleNamespace(end=None), engine.Progress()
    sync_engine.tuner, sync_engine.continue_at = SimpleNamespace(syncs_landed=0), None
    flight = engine.Flight(launched_at=10, lands_at=12, outer_lr=0.7, measured=[], began=0.0, future=Future())
    if together:
        flight.started = SyncStart(fragments=[0], lands_together=True)
        flight.agreed.set()
    sync_engine.in_flight = flight

    def land(landing, step, max_steps):
        calls.append(("land", landing.launched_at, step))
        sync_engine.in_flight = None
        return False

    def launch(step, max_steps):
        calls.append(("launch", step))
        sync_engine.in_flight = engine.Flight(launched_at=step, lands_at=step + 2, outer_lr=0.7, measured=[],
                                              began=0.0, future=Future())
        return sync_engine.in_flight

    sync_engine.land, sync_engine.launch = land, launch
    return sync_engine, flight, calls


def test_under_time_budgets_a_sync_due_while_the_one_in_flight_still_exchanges_waits_and_the_loop_trains_on():
    """SyncEngine.sync at the end of inner steps, its backend and its sync kinds replaced by stand-ins: an
    overlapped time-budget sync launched at step 10 with τ 2 whose exchange is still running (a slow link) when
    the next budget is spent at step 30: nothing lands and nothing is launched (the replica takes step 31), and at
    step 31, once the exchange is done, it lands and the next sync is launched at once, the steps since the last
    launch in it. At max_steps the sync in flight lands whatever its exchange (the last sync waits for it); and with
    rounds of H steps the next sync lands the one in flight as before."""
    budgets, flight, calls = engine_with_flight(1.0)
    for step in (12, 20, 30):
        assert not budgets.sync(step, 100).synced and calls == [], step
    flight.future.set_result(None)
    outcome = budgets.sync(31, 100)
    assert outcome.synced and not outcome.stop and not outcome.at_boundary, "the new sync is in flight"
    assert calls == [("land", 10, 31), ("launch", 31)]

    at_end, _, calls = engine_with_flight(1.0)
    at_end.sync(100, 100)
    assert calls[0] == ("land", 10, 100), "the last step lands the sync in flight, waiting for its exchange"

    rounds, _, calls = engine_with_flight(0.0)
    rounds.sync(11, 100)
    assert calls == [("land", 10, 11), ("launch", 11)], "rounds of H steps: the sync that comes due lands it first"


def test_under_time_budgets_a_sync_where_a_save_falls_lands_at_tau_exchange_done_or_not_and_launches_nothing_there():
    """An overlapped time-budget sync launched at step 10 with τ 2 whose start says it lands together (a save
    falls at it: hf_diloco.backends.FixedGroup): at step 11, though the next budget is spent, nothing lands and
    nothing is launched (it lands at τ, not earlier); at step 12 it lands with its exchange still running (the
    landing waits for it) and no sync is launched at that step although the budget is spent, so the outcome is a
    boundary with nothing in flight, where the save falls; the next step launches the next sync."""
    sync_engine, flight, calls = engine_with_flight(1.0, together=True)
    assert not sync_engine.sync(11, 100).synced and calls == []
    outcome = sync_engine.sync(12, 100)
    assert calls == [("land", 10, 12)] and not flight.future.done(), "landed at τ, its exchange not done"
    assert outcome.synced and outcome.at_boundary and outcome.window == (0, 10, 1), outcome
    assert sync_engine.sync(13, 100).synced and calls[-1] == ("launch", 13)


def test_a_blocking_sync_is_algorithm_1_one_bucket_at_a_time_over_the_fragments_it_carries():
    """outer_round, the production path of every blocking sync, on numbers written down by hand: two parameters in
    two fragments (one bucket each), one replica (Δ = Δ_1), outer Nesterov SGD lr 0.5 momentum 0.5, α 0.25. A sync
    carrying fragment 1 only moves fragment 1's θ_global and θ_i; fragment 0 keeps its inner progress. A second sync
    of fragment 1 uses the momentum the first left: v ← 0.5·v + Δ; θ_global ← θ_global − 0.5·(Δ + 0.5·v)."""
    first, second = nn.Parameter(torch.tensor([1.0, 2.0])), nn.Parameter(torch.tensor([4.0]))
    outer = OuterState([first, second], lr=0.5, momentum=0.5, nesterov=True, fragments=[[0], [1]])
    assert outer.fragment_buckets == [[0], [1]]
    with torch.no_grad():
        first.sub_(torch.tensor([0.5, 0.5]))
        second.sub_(torch.tensor([1.0]))  # θ_i = 3: Δ = 4 − 3 = 1
    fragments = fragments_of(outer)
    result = outer_round([fragments[1]], ReplicaComm(), alpha=0.25)
    # v = 1; θ_global = 4 − 0.5·(1 + 0.5·1) = 3.25; θ_i = 0.25·3 + 0.75·3.25 = 3.1875
    assert result.participants == 1 and result.local_norm_sq == pytest.approx(1.0)
    assert outer.global_params[1].item() == pytest.approx(3.25) and second.item() == pytest.approx(3.1875)
    assert outer.global_params[0].tolist() == [1.0, 2.0] and first.tolist() == [0.5, 1.5], "fragment 0 untouched"
    with torch.no_grad():
        second.sub_(torch.tensor([0.1875]))  # θ_i = 3: Δ = 0.25
    outer_round([fragments[1]], ReplicaComm(), alpha=0.0)
    # v = 0.5·1 + 0.25 = 0.75; θ_global = 3.25 − 0.5·(0.25 + 0.375) = 2.9375; α 0: θ_i = θ_global
    assert outer.global_params[1].item() == pytest.approx(2.9375) and second.item() == pytest.approx(2.9375)


def test_a_blocking_sync_runs_each_buckets_verbs_before_it_forms_the_next_ones_delta():
    """outer_round through the fragments' own verbs, in Algorithm 1's order and one bucket at a time (bounded memory:
    a bucket's Δ_i is formed only after the one before was stepped and copied back): three parameters cut into
    three buckets over two fragments, a sync carrying both, each verb recorded as the fragment runs it. The result
    is checked against the rule by hand: one replica, outer SGD lr 1 without momentum, so θ_global ← θ_i and
    θ_i stays."""
    params = [nn.Parameter(torch.tensor([1.0, 2.0])), nn.Parameter(torch.tensor([3.0])),
              nn.Parameter(torch.tensor([4.0, 5.0]))]
    outer = OuterState(params, lr=1.0, momentum=0.0, nesterov=False, bucket_numel=2, fragments=[[0, 1], [2]])
    fragments = fragments_of(outer)
    assert [f.buckets for f in fragments] == [[0, 1], [2]]
    calls = []
    for fragment in fragments:
        for verb in ("pseudo_gradient", "outer_step", "copy_back"):
            original = getattr(fragment, verb)
            setattr(fragment, verb, lambda b, *a, _v=verb, _o=original, _f=fragment.index, **k:
                    calls.append((_f, b, _v)) or _o(b, *a, **k))
    with torch.no_grad():
        for p in params:
            p.sub_(0.25)
    moved = [p.detach().clone() for p in params]
    outer_round(fragments, ReplicaComm())
    assert calls == [(f, b, verb) for f, b in ((0, 0), (0, 1), (1, 2))
                     for verb in ("pseudo_gradient", "outer_step", "copy_back")]
    for p, g, m in zip(params, outer.global_params, moved, strict=True):
        assert torch.equal(g.detach(), m) and torch.equal(p.detach(), m)
