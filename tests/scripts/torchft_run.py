"""One torchft replica of a FedAvg-style run on the tiny model (the torchft tests start several, and a Lighthouse).

Argument: a JSON object {"out": folder, "replica": r, "replicas": n, "lighthouse": url, "min_replicas": m,
"max_steps": s, "inner_steps": h, "round_seconds": t, "step_sleep": seconds, "backend": "torchft"|"torch", "group":
g, "round": {...}}. "group" is replica_group_size (torchft: start it under `accelerate launch` with g processes;
torch: num_replicas·g processes). "round" holds DiLoCoConfig fields of the round itself (compression,
error_feedback, num_fragments, sync_delay, fragment_alpha, ...), the same for either backend. `step_sleep` makes
this replica slower by sleeping after every inner step; "pause": [n, seconds] sleeps once, after this replica's own
n-th inner step (counted from its start: a replica that joined late jumps to the others' step when it heals);
"nan_at_step": s fills one weight of this replica with NaN after step s. "hold": [s, path] stops this replica after
global step s until the file `path` exists (at most 300 s; a list of such pairs holds it at each); "announce": path
writes that file when this replica begins training (the tests hold the survivors of a kill until the restarted
replica is up, so it finds them still running); "pause_while": [flag, path] holds this replica after any step while
the file `flag` exists and `path` does not (at most 300 s). "cgroup": folder moves this process into a cgroup v1
`cpu` folder the test made (a real CPU quota) once training begins. The replica writes its final trainable
parameters to `params<r>.pt` and, after every step, its step count to `step<r>.txt`. "die_in_all_gather": n SIGKILLs
this replica inside its n-th cross-replica all-gather (torchft), i.e. in the middle of a round whose other
collectives went through. "die_in_group_forming": n SIGKILLs it when its n-th quorum has been made and its process
group is to form, before it connects: its peers in that quorum wait for it in vain. "seed_by_replica": true builds
each replica's model from its own seed. "slow_sync_seconds": every cross-replica all-reduce of the round's buckets
first sleeps this long (a slow link). "stall_in_all_reduce": [n, seconds] stops this process (SIGSTOP) inside its
n-th cross-replica all-reduce of a sync's buckets, before it sends, for that long (a helper process lets it go): its
peers wait for it inside that collective, as when its link goes down mid-exchange. "bad_heals": ["shape" | "nan" |
"step" | "drift", ...]: the n-th state this replica sends a healing peer is spoiled the n-th way (its first parameter
a scalar, its first parameter NaN, its global_step past the run's end, its first parameter moved by 1e-3: a sound
state, but not the θ_global the replica holds); later ones are sound. "weights": "bfloat16"
trains the model's weights in bfloat16 with bf16 autocast (no use_cpu given: a GPU's settings on a machine without
one); the replica then also writes the dtypes of its outer state to `outer<r>.json`. "lie": [r, n, "nan" | weight]
makes replica r lie in its n-th sync: it reports finite values and sends a NaN, or reports that merge weight.
"claim_tokens": [r, n, tokens] makes replica r report that many tokens in its n-th sync's membership row
(torchft; its weight computed from them) or agreement (torch, time budgets). "nan_global_at_step": s fills one
value of θ_global with NaN after step s. "resume_by_rank": {rank: checkpoint} makes each process of a torch launch
resume from its own checkpoint, or from none. "noisy_start": true makes replica 1 send its own parameters instead
of zeros when replicas built apart take the first participant's. "globals": true writes θ_global after every step
that ends a round of H (`global<p>-<step>.pt`, p the process on torch, the replica on torchft).

The argument may also be a list of such objects: the process trains each in turn (a new model, Trainer and, on
torchft, Manager each time), so that one start-up serves several runs; "log": path then sends the run's output (this
process's stdout and stderr) to a file of its own.
"""

import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import pattern_dataset, tiny_llama  # noqa: E402
from transformers import TrainerCallback, default_data_collator  # noqa: E402

from hf_diloco import DiLoCoConfig, DiLoCoTrainer  # noqa: E402


class Pace(TrainerCallback):
    def __init__(self, settings: dict, out: Path, replica: int):
        self.settings, self.out, self.replica, self.taken = settings, out, replica, 0

    def on_train_begin(self, args, state, control, **kwargs):
        if self.settings.get("cgroup"):  # training, and every thread it starts, runs under the group's CPU quota
            Path(self.settings["cgroup"], "cgroup.procs").write_text(str(os.getpid()))
        if self.settings.get("announce"):
            Path(self.settings["announce"]).write_text("up")

    def on_step_end(self, args, state, control, model=None, **kwargs):
        settings = self.settings
        if settings.get("step_sleep"):
            time.sleep(settings["step_sleep"])
        self.taken += 1
        if settings.get("pause") and self.taken == settings["pause"][0]:
            time.sleep(settings["pause"][1])
        holds = settings.get("hold") or []
        if holds and not isinstance(holds[0], list):
            holds = [holds]
        for step, path in holds:
            deadline = time.monotonic() + 300
            while state.global_step == step and not Path(path).exists() and time.monotonic() < deadline:
                time.sleep(0.1)
        if settings.get("pause_while"):
            flag, until = (Path(p) for p in settings["pause_while"])
            deadline = time.monotonic() + 300
            while flag.exists() and not until.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
        if settings.get("nan_at_step") == state.global_step:
            with torch.no_grad():
                next(p for p in model.parameters() if p.requires_grad).view(-1)[0] = float("nan")
        (self.out / f"step{self.replica}.txt").write_text(str(state.global_step))


class GlobalsAfterSyncs(TrainerCallback):
    """Writes θ_global after every sync's step (`global<name>-<step>.pt`: after the DiLoCo callback has synced)."""

    def __init__(self, trainer, out: Path, name: int):
        self.trainer, self.out, self.name = trainer, out, name

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % args.inner_steps == 0:
            params = [p.detach().clone() for p in self.trainer.diloco.outer.global_params]
            torch.save(params, self.out / f"global{self.name}-{state.global_step}.pt")


class SpoilGlobal(TrainerCallback):
    """Fills one value of θ_global with NaN after step `step` (as no sync can now)."""

    def __init__(self, trainer, step: int):
        self.trainer, self.step = trainer, step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            with torch.no_grad():
                self.trainer.diloco.outer.global_params[0].view(-1)[0] = float("nan")


@contextlib.contextmanager
def faults(settings: dict):
    """The run's made-up faults, patched into hf_diloco's classes for the run and put back after it."""
    patched = []

    def patch(owner, name, replacement):
        patched.append((owner, name, getattr(owner, name)))
        setattr(owner, name, replacement)

    torch_backend = settings.get("backend") == "torch"
    # this process's replica: on torch, its rank's (replica_group_size consecutive ranks form one)
    me = int(os.environ.get("RANK", 0)) // settings.get("group", 1) if torch_backend else settings.get("replica", 0)
    if settings.get("die_in_all_gather"):
        import signal

        from hf_diloco.torchft_backend import TorchftComm

        calls = {"all_gather": 0}
        all_gather = TorchftComm._all_gather

        def dying_all_gather(self, gathered, payload):
            calls["all_gather"] += 1
            if calls["all_gather"] == settings["die_in_all_gather"]:
                os.kill(os.getpid(), signal.SIGKILL)
            return all_gather(self, gathered, payload)

        patch(TorchftComm, "_all_gather", dying_all_gather)
    if settings.get("die_in_group_forming"):
        import signal

        from torchft.process_group import ProcessGroupGloo

        formed = {"groups": 0}
        configure = ProcessGroupGloo.configure

        def dying_configure(self, *args, **kwargs):
            formed["groups"] += 1
            if formed["groups"] == settings["die_in_group_forming"]:
                os.kill(os.getpid(), signal.SIGKILL)
            return configure(self, *args, **kwargs)

        patch(ProcessGroupGloo, "configure", dying_configure)
    if settings.get("slow_sync_seconds"):
        from hf_diloco.torchft_backend import TorchftComm

        fast_all_reduce = TorchftComm._all_reduce

        def slow_all_reduce(self, buffer):
            time.sleep(settings["slow_sync_seconds"])
            return fast_all_reduce(self, buffer)

        patch(TorchftComm, "_all_reduce", slow_all_reduce)
    if settings.get("stall_in_all_reduce"):
        import signal
        import subprocess

        from hf_diloco.torchft_backend import TorchftComm

        stall_at, stall_seconds = settings["stall_in_all_reduce"]
        reduces = {"all_reduce": 0}
        running_all_reduce = TorchftComm._all_reduce

        def stalling_all_reduce(self, buffer):
            reduces["all_reduce"] += 1
            if reduces["all_reduce"] == stall_at:
                wake = f"import os, signal, time; time.sleep({stall_seconds}); os.kill({os.getpid()}, signal.SIGCONT)"
                subprocess.Popen([sys.executable, "-c", wake])
                os.kill(os.getpid(), signal.SIGSTOP)
            return running_all_reduce(self, buffer)

        patch(TorchftComm, "_all_reduce", stalling_all_reduce)
    if settings.get("bad_heals"):
        from hf_diloco.torchft_backend import TorchftQuorum

        sound_state = TorchftQuorum._state_for_peer
        spoiled = list(settings["bad_heals"])

        def spoiled_state(self):
            state = sound_state(self)
            if spoiled:
                kind, params = spoiled.pop(0), list(state["outer"]["global_params"])
                if kind == "shape":
                    params[0] = torch.tensor(0.5)
                elif kind == "nan":
                    params[0] = torch.full_like(params[0], float("nan"))
                elif kind == "drift":
                    params[0] = params[0] + 1e-3
                else:
                    state = {**state, "global_step": 10 * self.max_steps}
                state = {**state, "outer": {**state["outer"], "global_params": params}}
            return state

        patch(TorchftQuorum, "_state_for_peer", spoiled_state)
    if settings.get("lie"):
        from hf_diloco import fragments

        liar, at_sync, told = settings["lie"]
        honest_average, syncs = fragments._average_bucket, {"count": 0}

        def lying_average(comm, index, delta_i, result, weight, codec, feedback, riding, decoded=False):
            syncs["count"] += result.weights is None  # the first bucket of a sync
            if syncs["count"] == at_sync and told == "nan":  # reported finite, sends a NaN
                delta_i = delta_i.clone()
                delta_i.view(-1)[0] = float("nan")
            elif syncs["count"] == at_sync and riding is not None:  # reports a merge weight of `told`
                def riding(norm_sq, honest=riding):
                    values = honest(norm_sq).clone()
                    values[0] = float(told)
                    return values
            return honest_average(comm, index, delta_i, result, weight, codec, feedback, riding, decoded)

        if me == liar:
            patch(fragments, "_average_bucket", lying_average)
    if settings.get("noisy_start") and me == 1:  # sends its own parameters where the first participant's go round
        from hf_diloco.torchft_backend import TorchftQuorum

        honest_start_identical = TorchftQuorum._start_identical

        def noisy_start_identical(self, digests):
            rank = self.manager.participating_rank
            self.manager.participating_rank = lambda: 0  # (so it does not send zeros)
            try:
                return honest_start_identical(self, digests)
            finally:
                self.manager.participating_rank = rank

        patch(TorchftQuorum, "_start_identical", noisy_start_identical)
    if settings.get("claim_tokens") and settings["claim_tokens"][0] == me:
        _, at_sync, claimed = settings["claim_tokens"]
        starts = {"count": 0}
        if torch_backend:  # the tokens a replica reports in a time-budget sync's agreement
            from hf_diloco.backends import FixedGroup

            honest_agree = FixedGroup._agree

            def boasting_agree(self, step, tokens, at_end, stop):
                starts["count"] += 1
                return honest_agree(self, step, float(claimed) if starts["count"] == at_sync else tokens, at_end, stop)

            patch(FixedGroup, "_agree", boasting_agree)
        else:
            from hf_diloco.torchft_backend import TorchftQuorum

            honest_start = TorchftQuorum.start

            def boasting_start(self, step, max_steps, local, *args, **kwargs):
                starts["count"] += not kwargs.get("joining", False)  # (the joining start before step 1 is no sync)
                if starts["count"] == at_sync:
                    local = {**local, "tokens": int(claimed)}
                return honest_start(self, step, max_steps, local, *args, **kwargs)

            patch(TorchftQuorum, "start", boasting_start)
    try:
        yield
    finally:
        for owner, name, original in reversed(patched):
            setattr(owner, name, original)


@contextlib.contextmanager
def output_to(path: str | None):
    """This process's stdout and stderr (Python's and the native libraries') go to `path` within the block."""
    if path is None:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(path, "a") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in zip((1, 2), saved, strict=True):
            os.dup2(copy, fd)
            os.close(copy)


def run(settings: dict) -> None:
    out = Path(settings["out"])
    replica = settings.get("replica", 0)
    backend = settings.get("backend", "torchft")
    torchft_fields = {} if backend == "torch" else dict(
        outer_backend="torchft", lighthouse=settings["lighthouse"], replica_id=replica,
        num_replicas=settings.get("replicas", 1), min_replicas=settings.get("min_replicas", 1),
        round_seconds=settings.get("round_seconds", 0.0), sync_timeout=settings.get("sync_timeout", 60),
        replica_address="127.0.0.1",
    )
    config = DiLoCoConfig(
        output_dir=str(out / (f"replica-{replica}" if backend == "torchft" else "run")), per_device_train_batch_size=2,
        learning_rate=3e-3, lr_scheduler_type="constant", max_steps=settings.get("max_steps", 12),
        inner_steps=settings.get("inner_steps", 4), outer_lr=0.7, outer_momentum=0.9, save_strategy="no",
        eval_strategy="no", report_to="none", disable_tqdm=True, seed=0,
        replica_group_size=settings.get("group", 1), **torchft_fields,
        **({"bf16": True} if "weights" in settings else {}),
        **{"save_every_rounds": 0, **settings.get("round", {})},
    )
    # "seed_by_replica": each replica (torch: each process) builds its model from its own seed, so they start apart.
    seed = (replica if backend == "torchft" else int(os.environ.get("RANK", 0))) \
        if settings.get("seed_by_replica") else 0
    model = tiny_llama(seed=seed)
    if "weights" in settings:
        model = model.to(getattr(torch, settings["weights"]))
    trainer = DiLoCoTrainer(model=model, args=config, train_dataset=pattern_dataset(256),
                            data_collator=default_data_collator, callbacks=[Pace(settings, out, replica)])
    if settings.get("nan_global_at_step"):
        trainer.add_callback(SpoilGlobal(trainer, settings["nan_global_at_step"]))
    if settings.get("globals"):
        trainer.add_callback(GlobalsAfterSyncs(trainer, out, config.process_index if backend == "torch" else replica))
    # "resume_by_rank": {rank: checkpoint}: each process resumes from its own (or none), as machines that do not
    # share output_dir would.
    trainer.train(resume_from_checkpoint=settings.get("resume_by_rank", {}).get(os.environ.get("RANK", "0")))
    # Every process of the torch launch writes its own; on torchft, member 0 writes its replica's.
    if backend == "torch" or trainer.args.process_index == 0:
        rank = trainer.args.process_index if backend == "torch" else replica
        params = [p.detach().clone() for p in trainer.model.parameters() if p.requires_grad]
        torch.save(params, out / f"params{rank}.pt")
        if "weights" in settings:
            outer = trainer.diloco.outer
            states = [v for state in outer.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
            (out / f"outer{rank}.json").write_text(json.dumps({
                "global": sorted({str(p.dtype) for p in outer.global_params}),
                "optimizer": sorted({str(v.dtype) for v in states}), "optimizer_tensors": len(states)}))
    if backend == "torch":  # every process done with this run before any begins the next
        import torch.distributed as dist

        dist.barrier()


payload = json.loads(sys.argv[1])
for one in payload if isinstance(payload, list) else [payload]:
    Path(one["out"]).mkdir(parents=True, exist_ok=True)
    with output_to(one.get("log")), faults(one):
        run(one)
