"""`outer_backend: torchft`: replicas that come, go and lag (Decoupled DiLoCo, arXiv 2604.21428, on torchft).

With the default backend (`torch`) a round is a barrier over a fixed set of processes. Here every replica is its
own launch and joins the run through a torchft Lighthouse; membership, quorum, commit/rollback and healing are
torchft's (its Manager), and this module puts the DiLoCo round on top of them:

    at the end of each round (H steps, or `round_seconds` of inner steps), each replica i:
        quorum          ← Lighthouse: the replicas that arrived (at least min_replicas, then the grace window)
        if i is behind: θ_global, outer optimizer state, round counter, step ← a live peer (torchft heals it)
        w_i             ← tokens_i / (1 + s_i)          (s_i: rounds the replica's base is behind; 0 normally)
        Δ               ← Σ_i w_i Δ_i / Σ_i w_i          (over the participants only; one allreduce per bucket)
        if the quorum commits (no participant failed):  θ_global ← OuterOpt(θ_global, Δ);  θ_i ← θ_global
        else: nothing moves; the replica keeps its local progress and brings it to the next round

Design choices:
- The staleness rule 1/(1 + s): a pseudo-gradient taken against a base that is s rounds old partly repeats
  steps the global model already took from the others' updates, so it counts less the older its base is; it is
  the simplest weight that is 1 for a fresh update, never drops it entirely, and needs no tuning (Async Local-SGD,
  arXiv 2401.09135, shows stale updates at full weight hurt). With equal tokens and no staleness the weighted
  mean is the plain mean, so a fault-free run matches the `torch` backend.
- The grace window is the Lighthouse's join timeout: once min_replicas have arrived it waits at most that long for
  the others it still hears heartbeats from. A replica that misses it keeps training and joins a later round.
- A (re)started replica asks for a quorum before its first inner step, heals from a live peer and takes part in
  that round with weight 0, so it applies the same outer step as everyone and starts from the same θ_global.
- The run ends after ceil(max_steps / inner_steps) committed rounds (the round counter is healed with the
  rest), so a replica that joined late stops with the others.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from datetime import timedelta
from pathlib import Path

import torch

from .comm import ring_all_reduce_bytes
from .errors import ConfigError, first_line
from .outer import is_finite

logger = logging.getLogger(__name__)

# One row per participant, summed across replicas (each writes only its own row). A stop request rides along, so
# every participant of the round stops after it, whichever of them saw the request first.
MEMBER_FIELDS = ("replica", "steps", "tokens", "weight", "healed", "staleness", "loss_sum", "compute_seconds",
                 "quorum_seconds", "stop_requested", "non_finite")
NO_LIGHTHOUSE = ("outer_backend torchft needs a Lighthouse: pass --lighthouse http://HOST:PORT (start one with "
                 "`hf-diloco lighthouse`) or set TORCHFT_LIGHTHOUSE.")
INSTALL_HINT = "outer_backend torchft needs torchft: pip install -e '.[ft]' (or pip install torchft==0.2.0)."


def require_torchft():
    """The torchft module, or one sentence telling how to install it."""
    try:
        import torchft
    except ImportError:
        raise ConfigError(INSTALL_HINT) from None
    return torchft


def staleness_weight(tokens: int, staleness: int) -> float:
    """A participant's weight in the merge: its tokens, divided by 1 + the rounds its base is behind.

    >>> staleness_weight(4096, 0), staleness_weight(4096, 1)
    (4096.0, 2048.0)
    """
    return float(tokens) / (1 + max(0, staleness))


def start_lighthouse(bind: str, min_replicas: int, grace_seconds: float, heartbeat_timeout_seconds: float = 5.0):
    """torchft's Lighthouse, serving in this process until `.shutdown()`; its address is `.address()`."""
    torchft = require_torchft()
    from torchft._torchft import LighthouseServer

    del torchft
    return LighthouseServer(bind=bind, min_replicas=min_replicas, join_timeout_ms=int(grace_seconds * 1000),
                            quorum_tick_ms=50, heartbeat_timeout_ms=int(heartbeat_timeout_seconds * 1000))


class ElasticRounds:
    """One replica's side of the torchft rounds: its Manager, its process group and the round protocol.

    `callback` is the trainer's outer-loop callback (it owns θ_global, the trainer and the round counters).
    """

    def __init__(self, callback, args):
        require_torchft()
        from torch.distributed import TCPStore
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo

        self.callback = callback
        self.args = args
        self.global_round = 0  # committed rounds that moved θ_global (healed with the rest)
        self.stash: list[torch.Tensor] | None = None  # Δ_i against the base this replica had before it healed
        self.healed_from_round: int | None = None
        self.known: set[int] = set()  # replica ids seen in any quorum, to list the absent ones
        self.cumulative_bytes = 0
        timeout = timedelta(seconds=args.sync_timeout)
        host = args.replica_address or socket.gethostname()
        # The Manager's own store: a replica here is one process, so it is the master of a store of one.
        self.store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
        lighthouse = args.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
        if not lighthouse:
            raise ConfigError(NO_LIGHTHOUSE)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout),
            load_state_dict=self._load_healed,
            state_dict=self._state_for_peer,
            min_replica_size=args.min_replicas,
            use_async_quorum=False,  # heal before the round's collectives: a healed replica takes part at once
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timedelta(seconds=min(60.0, args.sync_timeout)),
            rank=0,
            world_size=1,
            store_addr=host,
            store_port=self.store.port,
            lighthouse_addr=lighthouse,
            replica_id=f"replica_{args.replica_id}",
            hostname=host,
            init_sync=True,  # the first quorum gives every replica the primary's θ (the `torch` backend broadcasts)
        )

    # --- what a peer sends a healing replica, and how it is taken ---

    def _state_for_peer(self) -> dict:
        trainer = self.callback.trainer
        return {"outer": self.callback.outer.state_dict(), "global_round": self.global_round,
                "global_step": trainer.state.global_step}

    @torch.no_grad()
    def _load_healed(self, state: dict) -> None:
        callback = self.callback
        outer = callback.outer
        if callback.round_steps > 0 and self.stash is None:
            # Local progress made against the old base: kept, and brought to this round with a staleness weight.
            self.stash = [outer.pseudo_gradient(bucket) for bucket in outer.buckets]
        self.healed_from_round = self.global_round
        outer.load_state_dict(state["outer"])
        self.global_round = int(state["global_round"])
        trainer = callback.trainer
        step = int(state["global_step"])
        if callback.round_steps == 0 and trainer.state.global_step == 0 and step > 0:
            # A replica that starts late continues at the others' step, so its schedule and its end match theirs.
            trainer.state.global_step = step
            scheduler = trainer.lr_scheduler
            if scheduler is not None:
                import warnings

                scheduler.last_epoch = step - 1
                with warnings.catch_warnings():  # "step() before optimizer.step()": on purpose, to jump ahead
                    warnings.simplefilter("ignore", UserWarning)
                    scheduler.step()

    # --- one round ---

    def round(self, joining: bool = False) -> dict:
        """Quorum, (heal,) weighted merge, commit, outer step. Returns the round's record fields."""
        callback, outer = self.callback, self.callback.outer
        started = time.perf_counter()
        self.healed_from_round = None
        self.manager.start_quorum()
        quorum_seconds = time.perf_counter() - started
        error = self.manager.errored()
        participants = self.manager.num_participants()
        rank = self.manager.participating_rank()
        healed = self.healed_from_round is not None
        staleness = max(0, self.global_round - self.healed_from_round) if healed and self.stash is not None else 0
        tokens = 0 if joining else callback.round_tokens + callback.carried_tokens
        # θ_global is finite, so Δ_i = θ_global − θ_i is finite exactly when this replica's parameters are: a
        # replica that diverged sits the round out with weight 0 (it sends zeros) and takes θ_global after it.
        finite = joining or self.stash is not None or is_finite(outer.params)
        weight = staleness_weight(tokens, staleness) if finite else 0.0
        mine = [float(self.args.replica_id), callback.round_steps, tokens, weight, float(healed), staleness,
                float(callback.round_loss.item()), callback.round_compute, quorum_seconds,
                float(callback.stop_requested), float(not finite)]
        members = torch.zeros(max(participants, 1), len(MEMBER_FIELDS), dtype=torch.float64)
        if rank is not None and error is None:
            members[rank] = torch.tensor(mine, dtype=torch.float64)
        synced = time.perf_counter()
        self.manager.allreduce(members, reduce_op=torch.distributed.ReduceOp.SUM).wait()
        total_weight = float(members[:, MEMBER_FIELDS.index("weight")].sum())
        averaged, bytes_sent, collectives = [], ring_all_reduce_bytes(members.numel() * 8, participants), 1
        average_norm_sq = 0.0
        for index, bucket in enumerate(outer.buckets if total_weight > 0 else []):
            delta_i = self.stash[index] if self.stash is not None else outer.pseudo_gradient(bucket)
            payload = delta_i.mul_(weight / total_weight) if weight > 0 else delta_i.zero_()
            self.manager.allreduce(payload, reduce_op=torch.distributed.ReduceOp.SUM).wait()
            averaged.append(payload)
            average_norm_sq += float(torch.linalg.vector_norm(payload)) ** 2
            bytes_sent += ring_all_reduce_bytes(payload.numel() * 4, participants)
            collectives += 1
        committed = self.manager.should_commit()
        sync_seconds = time.perf_counter() - synced
        if committed:
            for bucket, delta in zip(outer.buckets, averaged, strict=False):
                outer.step(bucket, delta)                               # θ_global ← OuterOpt(θ_global, Δ)
            outer.copy_global_to_replica()                              # θ_i ← θ_global
            if averaged:
                self.global_round += 1
            self.stash = None
            callback.carried_tokens = 0
        elif healed or not finite:
            # The base moved under this replica and the round did not land, or its own progress is not finite:
            # start over from θ_global.
            outer.copy_global_to_replica()
            self.stash = None
            callback.carried_tokens = 0
        else:
            callback.carried_tokens += 0 if joining else callback.round_tokens  # progress kept for the next round
        self.cumulative_bytes += bytes_sent
        rows = members[: participants].tolist() if participants else []
        present = {int(row[0]) for row in rows}
        self.known |= present
        listed = [dict(zip(MEMBER_FIELDS, row, strict=True)) for row in rows]
        for member in listed:
            member["replica"] = int(member["replica"])
            member["participated"] = True
            member["healed"] = bool(member["healed"])
            member["steps"], member["tokens"] = int(member["steps"]), int(member["tokens"])
            member["staleness"] = int(member["staleness"])
            member["stop_requested"] = bool(member["stop_requested"])
            member["non_finite"] = bool(member["non_finite"])
        listed += [{"replica": r, "participated": False} for r in sorted(self.known - present)]
        return {"members": sorted(listed, key=lambda m: m["replica"]), "committed": committed,
                "participants": participants, "quorum_seconds": quorum_seconds, "sync_seconds": sync_seconds,
                "bytes": bytes_sent, "collectives": collectives, "total_weight": total_weight,
                "pseudo_grad_norm": math.sqrt(average_norm_sq),
                "stop_requested": any(m.get("stop_requested") for m in listed),
                "global_round": self.global_round, "error": None if error is None else first_line(error),
                "finite": finite}

    def shutdown(self) -> None:
        try:
            self.manager.shutdown(wait=False)
        except Exception as error:  # noqa: BLE001 (leaving: nothing to recover)
            logger.debug("torchft manager shutdown: %s", error)


def check_elastic(config) -> None:
    """What outer_backend torchft does not combine with, in one sentence each."""
    if config.outer_backend != "torchft":
        return
    if config.replica_group_size != 1:
        raise ConfigError("outer_backend torchft runs one process per replica; set replica_group_size 1.")
    unsupported = [name for name, on in (("compression", config.compression != "none"),
                                         ("num_fragments", config.num_fragments != 1),
                                         ("sync_delay", config.sync_delay != 0)) if on]
    if unsupported:
        raise ConfigError(f"outer_backend torchft does not support {', '.join(unsupported)} yet; use the torch "
                          f"backend for compressed or streamed syncs.")
    if config.min_replicas < 1:
        raise ConfigError(f"min_replicas must be at least 1, got {config.min_replicas!r}.")
    if not 0 <= config.replica_id < max(config.num_replicas, 1):
        raise ConfigError(f"replica_id must be in [0, num_replicas={config.num_replicas}), got {config.replica_id}.")
    if not config.sync_grace_seconds >= 0:
        raise ConfigError(f"sync_grace_seconds must be 0 or more, got {config.sync_grace_seconds!r}.")
    if config.round_seconds < 0 or not math.isfinite(config.round_seconds):
        raise ConfigError(f"round_seconds must be 0 (off) or a positive number, got {config.round_seconds!r}.")


def require_lighthouse(config) -> None:
    """A replica about to train needs a Lighthouse address (`hf-diloco launch --replicas` passes its own)."""
    if config.outer_backend == "torchft" and not (config.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")):
        raise ConfigError(NO_LIGHTHOUSE)


# --- starting replicas ----------------------------------------------------------------------------------------------


def replica_folder(output_dir: str | os.PathLike, replica: int) -> str:
    """Where replica `replica` of a run started by `hf-diloco launch --replicas N` writes."""
    return os.path.join(str(output_dir), f"replica-{replica}")


def replica_overrides(overrides: list[str], replica: int, replicas: int, lighthouse: str, output_dir: str) -> list[str]:
    """The recipe overrides of one replica (later flags win, so these come last)."""
    return [*overrides, "--outer_backend", "torchft", "--replica_id", str(replica), "--num_replicas", str(replicas),
            "--lighthouse", lighthouse, "--output_dir", replica_folder(output_dir, replica)]


class ReplicaSupervisor:
    """Runs N replica launches on this machine, starting a replica that failed again (it heals from the live
    ones) up to `max_restarts` times each; hands a stop request in `output_dir` to every replica and reports the
    stop back where one-folder runs report it."""

    def __init__(self, commands: list[list[str]], output_dir: str, max_restarts: int, linger_seconds: float = 15.0):
        self.linger_seconds = linger_seconds  # how long a restarted replica may outlive the finished others
        self.commands = commands
        self.output_dir = Path(output_dir)
        self.max_restarts = max_restarts
        self.restarts = [0] * len(commands)
        self.stopping = False
        self.finished_at: float | None = None  # when the first replica completed the run

    def _end_latecomers(self, processes, codes: list[int | None]) -> None:
        """A replica started again near the end finds no one left to form a round with: once every replica that
        never restarted has finished, the restarted ones get `linger_seconds` to finish too, then are ended (they
        hold nothing the finished replicas do not)."""
        if self.finished_at is None or time.monotonic() - self.finished_at < self.linger_seconds:
            return
        running = [r for r, code in enumerate(codes) if code is None]
        if running and all(self.restarts[r] > 0 for r in running):
            for r in running:
                processes[r].kill()
                processes[r].wait()
                codes[r] = 0
                print(f"[diloco] replica {r} was started again too late to rejoin: the run had finished; ended it",
                      flush=True)

    def run(self) -> int:
        import signal
        import subprocess

        from .runs import STOP_FILE, STOPPED_FILE

        def note_stop(signum, _frame) -> None:  # the replicas got it too when it came from the terminal
            self.stopping = True
            for process in processes:
                if process.poll() is None:
                    process.send_signal(signum)

        previous = {s: signal.signal(s, note_stop) for s in (signal.SIGTERM, signal.SIGINT)}
        processes = [subprocess.Popen(command) for command in self.commands]
        codes: list[int | None] = [None] * len(processes)
        try:
            while any(code is None for code in codes):
                time.sleep(0.5)
                request = self.output_dir / STOP_FILE
                if request.exists():
                    for r in range(len(processes)):
                        folder = Path(replica_folder(self.output_dir, r))
                        folder.mkdir(parents=True, exist_ok=True)
                        (folder / STOP_FILE).write_text(request.read_text())
                    request.unlink(missing_ok=True)
                    self.stopping = True
                self._end_latecomers(processes, codes)
                for r, process in enumerate(processes):
                    if codes[r] is not None or (code := process.poll()) is None:
                        continue
                    if code != 0 and not self.stopping and self.restarts[r] < self.max_restarts:
                        self.restarts[r] += 1
                        print(f"[diloco] replica {r} exited with status {code}; starting it again (restart "
                              f"{self.restarts[r]} of {self.max_restarts}); it heals from a live replica", flush=True)
                        processes[r] = subprocess.Popen(self.commands[r])
                        continue
                    codes[r] = code
                    if code == 0 and self.finished_at is None:
                        self.finished_at = time.monotonic()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        stopped = [Path(replica_folder(self.output_dir, r)) / STOPPED_FILE for r in range(len(processes))]
        if any(path.exists() for path in stopped):
            first = next(path for path in stopped if path.exists())
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / STOPPED_FILE).write_text(first.read_text())
        return next((code for code in codes if code), 0)
