"""`outer_backend: torchft`: replicas that come, go and lag (Decoupled DiLoCo, arXiv 2604.21428, on torchft).

With the default backend (`torch`) a sync is a barrier over a fixed set of processes. Here every replica is its
own launch and joins the run through a torchft Lighthouse; membership, quorum, commit/rollback and healing are
torchft's (its Manager), and this module puts the DiLoCo sync on top of them:

    at the end of each sync (H/F inner steps, or `round_seconds`/F of them), each replica i:
        quorum          ← Lighthouse: the replicas that arrived (at least min_replicas, then the grace window)
        if i is behind: θ_global, outer optimizer state, sync counter, step ← a live peer (torchft heals it)
        w_i             ← tokens_i / (1 + s_i)          (s_i: syncs the replica's base is behind; 0 normally)
        Δ               ← Σ_i w_i Δ_i / Σ_i w_i          (over the participants only; one allreduce per bucket)
        if the quorum commits (no participant failed):  θ_global ← OuterOpt(θ_global, Δ);  θ_i ← θ_global
        else: nothing moves; the replica keeps its local progress and brings it to the next sync

Design choices:
- The staleness rule 1/(1 + s): a pseudo-gradient taken against a base that is s syncs old partly repeats
  steps the global model already took from the others' updates, so it counts less the older its base is; it is
  the simplest weight that is 1 for a fresh update, never drops it entirely, and needs no tuning (Async Local-SGD,
  arXiv 2401.09135, shows stale updates at full weight hurt). With equal tokens and no staleness the weighted
  mean is the plain mean, so a fault-free run matches the `torch` backend.
- The grace window is the Lighthouse's join timeout: once min_replicas have arrived it waits at most that long for
  the others it still hears heartbeats from. A replica that misses it keeps training and joins a later sync.
- A (re)started replica asks for a quorum before its first inner step, heals from a live peer and takes part in
  that sync with weight 0, so it applies the same outer step as everyone and starts from the same θ_global.
- The run's length is the `torch` backend's: after each committed sync every participant continues at the
  furthest participant's step, and the run ends with the sync that brings a participant to max_steps (the step
  every replica continued at is healed with the rest, so a replica that joined late stops with the others). With
  rounds of H steps that is ceil(max_steps / (H/F)) syncs, one fewer for each rolled-back sync (its steps ride
  with the next one).
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta

import torch

from . import compat
from .backends import Backend, SyncStart, Verdict, bounded_shares
from .checks import NO_LIGHTHOUSE, require_torchft
from .comm import ReplicaComm, Topology, Unwatched, copy_flat, gather_into, ring_all_reduce_bytes, tensor_digest
from .contributions import CHECK_FIELDS
from .errors import ConfigError, RunError, first_line
from .network import interface_of
from .records import membership
from .schedule import Schedule

logger = logging.getLogger(__name__)

# One row per participant, summed across replicas (each writes only its own row). A stop request rides along, so
# every participant of the sync stops after it, whichever of them saw the request first.
MEMBER_FIELDS = ("replica", "steps", "tokens", "weight", "healed", "staleness", "loss_sum", "compute_seconds",
                 "quorum_seconds", "stop_requested", "non_finite", "at_step", "digest", *CHECK_FIELDS)
# How long a lingering replica waits between quorums that brought no late replica (two that both finished would
# otherwise form thousands of empty quorums a second between themselves).
LINGER_PAUSE_SECONDS = 0.25
# The local numbers of a replica that brings no progress to a sync (it only hands over the final model).
NOTHING_TRAINED = {"steps": 0, "tokens": 0, "loss_sum": 0.0, "compute_seconds": 0.0, "stop_requested": False}


def staleness_weight(tokens: int, staleness: int) -> float:
    """A participant's weight in the merge: its tokens, divided by 1 + the syncs its base is behind.

    >>> staleness_weight(4096, 0), staleness_weight(4096, 1)
    (4096.0, 2048.0)
    """
    return float(tokens) / (1 + max(0, staleness))


def merge_weights(rows: list[list[float]]) -> list[float]:
    """The participants' merge weights from their rows of (tokens, staleness, weight), each never more than its own
    tokens and staleness give (staleness_weight), then bounded as on every backend (backends.bounded_shares: never
    negative, never more than WEIGHT_LIMIT times the median one).

    >>> merge_weights([[4096, 0, 4096.0], [4096, 1, 4096.0], [1e12, 0, 1e12], [100, -3, 50.0], [5, 0, 9.0]])
    [4096.0, 2048.0, 131072.0, 0.0, 5.0]
    """
    return bounded_shares([min(w, staleness_weight(t, s)) if t >= 0 and s >= 0 else 0.0 for t, s, w in rows])


def safe_checkpoint_transport(host: str, timeout: timedelta):
    """torchft's HTTP checkpoint transfer (what heals a joining replica), made safe to expose between sites.

    torchft's own (0.2.0) listens on every interface, advertises socket.gethostname() and loads what it receives
    with `weights_only=False`, i.e. unpickles it: whoever can reach a healing replica, or sit between two sites,
    could run code on it. This one:
    - listens on `host` only (replica_address, or the host name's address), from its first moment (torchft binds
      and serves in the constructor: compat.torchft_listeners_on), and advertises that address (a host
      name that resolves to 127.0.0.1, as in network namespaces and many containers, would send a healing peer
      to itself);
    - loads with `weights_only=True`: tensors and plain values (what the outer state is), nothing that runs code.
      Anything else is refused with HealRefused, naming the sender; the sync then fails on the healing replica,
      which votes it down and asks again next sync.
    """
    import urllib.request

    from torch.distributed._serialization import _streaming_load
    from torchft.checkpointing import HTTPTransport

    class SafeTransport(HTTPTransport):
        def address(self) -> str:
            port = self._server.socket.getsockname()[1]
            shown = f"[{host}]" if ":" in host else host
            return f"http://{shown}:{port}/checkpoint/"

        @classmethod
        def _load_from_address(cls, address: str, timeout: timedelta) -> object:
            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as response:
                try:
                    return _streaming_load(response, weights_only=True)
                except pickle.UnpicklingError as error:
                    raise HealRefused(f"refused the state sent by {address.rsplit('/checkpoint/', 1)[0]}: it holds "
                                      f"more than tensors and plain values ({first_line(error)[:200]}), so loading "
                                      f"it could run code; heal only from replicas of this run.") from None

    with compat.torchft_listeners_on(host):  # torchft's constructor binds and starts serving
        return SafeTransport(timeout=timeout, num_chunks=0)


class QuorumFailed(RunError):
    """No sync formed within sync_timeout (too few live replicas, or no Lighthouse), as one sentence."""


class HealRefused(RuntimeError):
    """A peer sent a healing replica something other than tensors and plain values."""


class ExchangeTimeout:
    """How long each collective of a torchft sync waits for the others once its group has formed: 4 times the
    longest time in flight of the last 8 syncs that committed (from the first collective to the vote), at least
    `floor` (group_timeout) and at most `cap` (sync_timeout), which also holds until a sync has committed. Each
    sync in a row that does not commit doubles it, so an exchange that a slower link made longer is given
    up at most a few times. A peer cut off inside an exchange (its link down, its process stopped) then costs the
    others a few exchanges' time, not sync_timeout: the sync rolls back and the next quorum forms without it.

    >>> clock = ExchangeTimeout(floor=3.0, cap=60.0)
    >>> clock.seconds()
    60.0
    >>> clock.landed(True, 0.5); clock.seconds()   # 4 x 0.5 s is below the floor
    3.0
    >>> clock.landed(True, 2.0); clock.seconds()
    8.0
    >>> clock.landed(False, 8.0); clock.landed(False, 16.0); clock.seconds()
    32.0
    """

    FACTOR, RECENT = 4.0, 8

    def __init__(self, floor: float, cap: float):
        self.floor, self.cap = min(floor, cap), cap
        self.recent: list[float] = []
        self.failed = 0

    def seconds(self) -> float:
        if not self.recent:
            return self.cap
        return min(self.cap, max(self.floor, self.FACTOR * max(self.recent) * 2 ** self.failed))

    def landed(self, committed: bool, seconds: float) -> None:
        if committed:
            self.recent = [*self.recent, seconds][-self.RECENT:]
            self.failed = 0
        else:
            self.failed += 1


class TorchftComm(ReplicaComm):
    """The sync's collectives on torchft's process group, over the replicas of the sync's quorum.

    Rank and size are the quorum's (`configure`, once per sync, after the quorum formed). A collective that
    fails (a peer died, the link dropped, the sync's `ExchangeTimeout`) is reported to the Manager, every later
    collective of the sync is skipped and its output zeroed, and the sync's vote (`should_commit`) then fails on
    every participant, so no replica applies a sync that did not fully arrive.
    """

    votes = True

    def __init__(self, manager, pg, replica: ReplicaComm, timeout: ExchangeTimeout | None = None):
        # `replica` is this launch's processes, which form one replica of g = replica_group_size processes: DDP
        # inside it, member j sums the j-th 1/g slice with member j of the other replicas (torchft's process group
        # for group rank j), then the slices are all-gathered inside the replica, as on the torch backend. There is
        # no torch.distributed between replicas, and no rendezvous across them (Unwatched).
        own = replica.topology
        topology = Topology(group_size=own.group_size, member=own.member, sharded=own.sharded, device=own.device,
                            timeout_seconds=own.timeout_seconds, replica_group=own.replica_group,
                            gather_group=own.gather_group)
        super().__init__(topology=topology, rendezvous=Unwatched(topology))
        self.manager, self.pg = manager, pg
        self.timeout = timeout or ExchangeTimeout(own.timeout_seconds or 1800.0, own.timeout_seconds or 1800.0)
        self.exchange_began = time.perf_counter()

    def arm(self) -> None:
        """The sync's quorum has formed and its collectives begin: from here each waits at most the timeout's
        seconds for the others."""
        self.exchange_began = time.perf_counter()
        if hasattr(self.pg, "collective_timeout"):
            self.pg.collective_timeout(self.timeout.seconds())

    def configure(self, participants: int, rank: int | None) -> None:
        """The sync's quorum: its participants, and this replica's rank among them."""
        self.topology.num_replicas, self.topology.replica_index = max(1, participants), rank or 0

    @property
    def active(self) -> bool:
        return self.num_replicas > 1

    refusal: str | None = None  # this sync's heal was refused: the replica votes the sync down (nothing to apply)

    def vote(self) -> bool:
        if self.refusal is not None and self.manager.errored() is None:
            self.manager.report_error(HealRefused(self.refusal))
        committed = bool(self.manager.should_commit())
        self.timeout.landed(committed, time.perf_counter() - self.exchange_began)
        return committed

    def _run(self, collective, *outputs: torch.Tensor) -> None:
        if self.manager.errored() is None:
            try:
                collective().wait()
                return
            except Exception as error:  # noqa: BLE001 (any failure of a peer or the link: the sync rolls back)
                self.manager.report_error(error)
        for output in outputs:
            output.zero_()

    def _all_reduce(self, buffer: torch.Tensor) -> None:
        from torch.distributed.distributed_c10d import AllreduceOptions, ReduceOp

        options = AllreduceOptions()
        options.reduceOp = ReduceOp.SUM
        self._run(lambda: self.pg.allreduce([buffer], options), buffer)

    def _all_to_all(self, received: torch.Tensor, send: torch.Tensor) -> None:
        from torch.distributed.distributed_c10d import AllToAllOptions

        self._run(lambda: self.pg.alltoall_base(received, send, [], [], AllToAllOptions()), received)

    def _all_gather(self, gathered: torch.Tensor, payload: torch.Tensor) -> None:
        from torch.distributed.distributed_c10d import AllgatherOptions

        rows = list(gathered.view(self.num_replicas, -1).unbind(0))
        self._run(lambda: self.pg.allgather([rows], [payload], AllgatherOptions()), gathered)


STORE_KEY = "torchft_store"  # under the training's number (Rendezvous.key)


def replica_store(replica: ReplicaComm, host: str):
    """The replica's store, which its Manager ranks meet in (and peers' process groups rendezvous through): served
    by member 0 on a free port of `host`; with g > 1 the other members learn its address through the launch's own
    rendezvous store. Returns (the store this process serves, or None; its (host, port))."""
    from torch.distributed import TCPStore

    if replica.member == 0:
        # TCPStore binds every interface unless handed a listening socket: one bound to `host` only.
        listener, port = compat.listening_socket(host)
        store = TCPStore(host, port, is_master=True, wait_for_workers=False, master_listen_fd=listener)
        if replica.group_size > 1:
            replica.rendezvous.store().set(replica.rendezvous.key(STORE_KEY), f"{host}:{store.port}")
        return store, (host, store.port)
    store_host, port = replica.rendezvous.store().get(replica.rendezvous.key(STORE_KEY)).decode().rsplit(":", 1)
    return None, (store_host, int(port))


class PeerHeal:
    """A torchft heal, on the replica that is behind: what it takes from a live peer in a sync's quorum, and what it
    keeps of its own progress. torchft's Manager hands `load` the peer's state while the quorum forms; the state is
    checked first (`mismatch`: it arrives over the network), this replica's progress against the base it leaves is
    kept as its Δ_i (`stash`), and the state waits until the quorum applies it (`take`, TorchftQuorum.start) before
    the sync's collectives. A state that does not fit is refused (`refused` says why): nothing is taken, and the
    replica sits the sync out and heals again at the next one, from whichever peer that quorum names.

    `outer` and the replica's `fragments` are read here, never written; `agreed` gives the quorum's step (torchft's
    count of commits)."""

    def __init__(self, outer, fragments, max_steps: int, agreed: Callable[[], int]):
        self.outer, self.fragments, self.max_steps, self.agreed = outer, fragments, max_steps, agreed
        self.stash: list[torch.Tensor] | None = None  # Δ_i against the base this replica had before it healed
        self.refused: str | None = None
        self.taken: dict | None = None
        self.global_sync = 0  # as the quorum forms: this replica's sync counter,
        self.local_steps = 0  # its inner steps since its last launch,
        self.overlapped = False  # and whether the sync runs in the background while it trains on

    def expect(self, global_sync: int, local_steps: int, overlapped: bool) -> None:
        """A sync's quorum is about to form, with this replica at `global_sync` after `local_steps` inner steps."""
        self.global_sync, self.local_steps, self.overlapped = global_sync, local_steps, overlapped
        self.refused = self.taken = None

    def mismatch(self, state: object) -> str | None:
        """Why a peer's state cannot heal this replica (a clause), or None. Its outer state must fit the replica's
        (names, shapes, dtypes, finite: OuterState.mismatch); its sync counter must lie between the replica's and
        the quorum's step (torchft's count of commits, which moves with every sync that moves θ_global and never less
        often); its steps must be whole numbers within the run's max_steps."""
        if not isinstance(state, dict) or not {"outer", "global_sync", "global_step", "agreed_step"} <= set(state):
            return "it is not a replica's state (outer, global_sync, global_step, agreed_step)"
        wrong = self.outer.mismatch(state["outer"])
        if wrong:
            return f"its outer state does not fit this model: {wrong}"
        numbers = {key: state[key] for key in ("global_sync", "global_step", "agreed_step")}
        for key, value in numbers.items():
            if isinstance(value, bool) or not isinstance(value, int):
                return f"its {key} is {value!r}, not a whole number"
        agreed = self.agreed()
        if not self.global_sync <= numbers["global_sync"] <= agreed:
            return (f"its sync counter {numbers['global_sync']} is outside {self.global_sync}..{agreed} (this "
                    f"replica's, and the quorum's step)")
        for key in ("global_step", "agreed_step"):
            if not 0 <= numbers[key] <= self.max_steps:
                return f"its {key} {numbers[key]} is outside the run's 0..{self.max_steps} steps"
        return None

    @torch.no_grad()
    def load(self, state: dict) -> None:
        """torchft's Manager: a peer's state, to heal this replica with (checked, then kept for `take`)."""
        wrong = self.mismatch(state)
        if wrong:
            sender = state.get("replica", "?") if isinstance(state, dict) else "?"
            self.refused = f"refused the state sent by replica {sender} to heal this one: {wrong}"
            logger.warning("DiLoCo/torchft: %s; this replica sits the sync out and heals again at the next one.",
                           self.refused)
            return
        if self.local_steps > 0 and self.stash is None and not self.overlapped:
            # Local progress made against the old base: kept, and brought to this sync with a staleness weight.
            # (Not in an overlapped sync's background start: the replica is training meanwhile; that sync's
            # snapshot is against the old base, so it takes part with weight 0 and the replica restarts from the
            # healed θ_global.)
            self.stash = [f.pseudo_gradient(bucket) for f in self.fragments for bucket in f.buckets]
        self.taken = state

    def take(self) -> dict | None:
        """The peer's state this quorum healed the replica with, once (None: no heal, or a refused one)."""
        state, self.taken = self.taken, None
        return state

    def settle(self) -> None:
        """The sync that brought the stash landed or was given up: the replica starts from θ_global."""
        self.stash = None


def replica_group(sync_timeout: float, group_timeout: float):
    """The process group across replicas: torchft's gloo group, formed again at every new quorum, whose members get
    `group_timeout` seconds to connect (a member that died after joining the quorum never does: the sync is given
    up then, not after `sync_timeout`) and `sync_timeout` for each collective once it has formed, or what
    `collective_timeout` sets for the sync's collectives (ExchangeTimeout)."""
    from torchft.process_group import ProcessGroupGloo

    class FormingGroup(ProcessGroupGloo):
        def configure(self, *args, **kwargs) -> None:
            collectives, self._timeout = self._timeout, timedelta(seconds=min(group_timeout, sync_timeout))
            try:  # the store client and gloo's full-mesh connection wait this long for the other members
                super().configure(*args, **kwargs)
            finally:
                self._timeout = collectives
            self._pg._get_backend(torch.device("cpu"))._set_default_timeout(collectives)

        def collective_timeout(self, seconds: float) -> None:
            if getattr(self, "_pg", None) is not None:
                self._pg._get_backend(torch.device("cpu"))._set_default_timeout(timedelta(seconds=seconds))

    return FormingGroup(timeout=timedelta(seconds=sync_timeout))


class TorchftQuorum(Backend):
    """One replica's side of the torchft syncs: its Manager and process group, and who takes part in each sync
    with what weight. The sync itself (codec, fragments, overlap, outer step) is hf_diloco.engine's and
    hf_diloco.fragments', as on the `torch` backend; this class answers `start` (quorum, heal, weights, which
    fragments) and `finish` (commit bookkeeping, membership for the record). See hf_diloco.backends. It holds the
    outer state `outer` (which a heal replaces and a peer is sent), the `fragments` (a heal clears their residuals)
    and the run's `schedule`; a late replica's new step is an answer (`SyncStart.continue_at`), not a call."""

    def __init__(self, args, replica: ReplicaComm, outer, fragments, schedule: Schedule, max_steps: int, *,
                 resumed: bool):
        require_torchft()
        super().__init__(replica, outer, schedule, max_steps)
        self.args = args
        self.fragments = fragments
        self.agreed_step = 0  # the step every participant continued at after the last commit (healed with the rest)
        self.heal = PeerHeal(outer, fragments, max_steps, agreed=lambda: self.manager.current_step())
        self.carried_tokens = 0  # tokens of local progress that a rolled-back sync did not merge yet
        self.known: set[int] = set()  # replica ids seen in any quorum, to list the absent ones
        self.last_participants: set[int] = set()  # the participants of the last sync that moved θ_global
        self.sync_step = 0  # the step the sync being formed started at (what a healing peer is given)
        self.sync_local_steps = 0  # this replica's inner steps since its last launch, as the sync started
        self.continued_at: int | None = None  # the step a late replica continued at, taken from its peer
        self.healed_to_step: int | None = None  # this sync's heal moved a late replica to the peer's step
        self.check_identical = not resumed  # a fresh run: compare θ by digest at the start
        host = args.replica_address or socket.gethostname()
        lighthouse = args.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
        if not lighthouse:
            raise ConfigError(NO_LIGHTHOUSE)
        self.store, store_address = replica_store(replica, host)  # `replica`: its Manager ranks 0 .. g-1
        if args.replica_address and not os.environ.get("GLOO_SOCKET_IFNAME"):
            # gloo listens on the interface GLOO_SOCKET_IFNAME names, else on the host name's address: the one
            # that holds replica_address, unless the user named another.
            interface = interface_of(args.replica_address)
            if interface:
                os.environ["GLOO_SOCKET_IFNAME"] = interface
        pg = replica_group(args.sync_timeout, args.group_timeout)
        # A fresh run's replicas at step 0 do not heal from each other (the whole state, every time): like the torch
        # backend, they compare a digest of θ in the first sync's table and send it only if they differ (start).
        # Resumed replicas heal from the primary, so they agree on θ, the outer state and the sync.
        self.manager = self._manager(replica, pg, host, store_address, lighthouse)
        self.comm = TorchftComm(self.manager, pg, replica, ExchangeTimeout(args.group_timeout, args.sync_timeout))

    def _manager(self, replica: ReplicaComm, pg, host: str, store: tuple[str, int], lighthouse: str):
        """torchft's Manager for this process: rank `replica.member` of the replica's `replica.group_size`, meeting
        its other ranks in the replica's `store`, the quorum at `lighthouse`; a peer's state heals this replica
        through `PeerHeal.load` (checked first: it arrives over the network), and this replica's is sent from
        `_state_for_peer`. Its gRPC server (rank 0 of the replica) and the healing transport listen on `host` only."""
        from torchft import Manager

        args = self.args
        timeout = timedelta(seconds=args.sync_timeout)
        with compat.torchft_listeners_on(host):
            return Manager(
                checkpoint_transport=safe_checkpoint_transport(host, timeout), pg=pg, load_state_dict=self.heal.load,
                state_dict=self._state_for_peer, min_replica_size=args.min_replicas,
                use_async_quorum=False,  # heal before the sync's collectives: a healed replica takes part at once
                timeout=timeout, quorum_timeout=timeout,
                connect_timeout=timedelta(seconds=min(60.0, args.sync_timeout)), rank=replica.member,
                world_size=replica.group_size, store_addr=store[0], store_port=store[1], lighthouse_addr=lighthouse,
                replica_id=f"replica_{args.replica_id}", hostname=host, init_sync=not self.check_identical)

    # --- what a peer sends a healing replica, and how it is taken ---

    def _state_for_peer(self) -> dict:
        # The step the sync being formed started at, not the trainer's step: an overlapped sync's quorum runs in
        # the background while the inner loop moves on, and a healer given a later step would run its syncs that
        # many steps ahead of everyone's, and end one sync early.
        return {"outer": self.outer.state_dict(), "global_sync": self.syncs,
                "global_step": self.sync_step, "agreed_step": self.agreed_step, "replica": self.args.replica_id}

    @torch.no_grad()
    def _heal_with(self, state: dict | None) -> None:
        """Apply the state a peer healed this replica with while the quorum formed, if any: θ_global, the outer
        optimizer, the sync counter and the agreed step are the peer's; the residuals go (they were what this
        replica did not send against the base it left); a replica that starts late continues at the peer's step, so
        its schedule and its end match theirs."""
        if state is None:
            return
        self.outer.load_state_dict(state["outer"])
        self.syncs = int(state["global_sync"])
        self.agreed_step = int(state["agreed_step"])
        for fragment in self.fragments:
            if fragment.feedback is not None:
                fragment.feedback.clear()
        step = int(state["global_step"])
        if self.sync_local_steps == 0 and self.sync_step == 0 and step > 0:
            self.healed_to_step = self.continued_at = self.sync_step = step

    def _heals_refused(self, rows: torch.Tensor, state: dict | None) -> list[int]:
        """The participants (ranks in this quorum) whose heal must be refused, the same on every participant: where
        a participant healed, each sends the digest of its θ_global (a healed one: of the θ_global it received) in
        one small all-reduce, and a healed θ_global that is not the one more than half of the others hold is not
        taken, since the peer that sent it sent something its own quorum does not hold (the members of a replica,
        each with its own shard, refuse together). Sets this replica's refusal if it is among them. (The state's own
        checks ran as it arrived: PeerHeal.mismatch.)"""
        rank = self.manager.participating_rank()
        healed = rows[:, MEMBER_FIELDS.index("healed")] > 0
        digests = torch.zeros(len(rows), dtype=torch.float64)
        if rank is not None:
            digests[rank] = self._digest(state["outer"]["global_params"] if state is not None else None)
        self.manager.allreduce(digests, reduce_op=torch.distributed.ReduceOp.SUM).wait()
        others = [float(d) for d, h in zip(digests, healed, strict=True) if not h]
        held_most, count = Counter(others).most_common(1)[0] if others else (None, 0)
        majority = held_most if 2 * count > len(others) else None
        wrong = [0.0] * len(rows) if self.manager.errored() is not None else \
            [float(bool(healed[r]) and float(digests[r]) != majority) for r in range(len(rows))]
        # The members of a replica (each compares its own shard) refuse together: any member's refusal counts.
        refused = [r for r, n in enumerate(self.comm.control.members_total(wrong)) if n > 0]
        if rank in refused:
            sender = state.get("replica", "?") if state is not None else "?"
            self.heal.refused = (
                f"refused the state sent by replica {sender} to heal this one: its θ_global is not the one "
                + ("the quorum's other replicas hold" if majority is not None else
                   "the quorum's other replicas hold, since they hold no θ_global in common"))
            logger.warning("DiLoCo/torchft: %s; this replica sits the sync out and heals again at the next one.",
                           self.heal.refused)
        return refused

    def _whole_replica(self, local: dict) -> dict:
        """A replica's numbers from its g processes' own (an all-gather inside the replica, on the sync's group): its
        tokens are theirs summed, its loss their mean, its compute time the slowest's; it asks to stop if any of
        them does and is finite only if all are. Every member then writes the same row, so every slice of the sync
        is averaged with the same weights."""
        comm = self.comm
        mine = torch.tensor([local["steps"], local["tokens"], local["loss_sum"], local["compute_seconds"],
                             float(local["stop_requested"]), float(not local.get("finite", True))],
                            dtype=torch.float64)
        every = torch.empty(comm.group_size * mine.numel(), dtype=torch.float64)
        gather_into(every, mine, group=comm.gather_group)
        every = every.view(comm.group_size, -1)
        return {**local, "steps": int(every[:, 0].max()), "tokens": int(every[:, 1].sum()),
                "loss_sum": float(every[:, 2].mean()), "compute_seconds": float(every[:, 3].max()),
                "stop_requested": bool(every[:, 4].any()), "finite": not bool(every[:, 5].any())}

    def _digest(self, params: list[torch.Tensor] | None = None) -> float:
        """48 bits of the SHA-256 of θ_global's bytes (or of `params`, a peer's θ_global), exact in a float64 cell
        of the membership table."""
        held = self.outer.global_params if params is None else list(params)
        return float(int.from_bytes(tensor_digest(held)[:6], "big"))

    @torch.no_grad()
    def _start_identical(self, digests: torch.Tensor) -> int:
        """A fresh run's first sync: if the participants' θ differ (replicas built from different seeds), the first
        participant's θ_global goes to the others (an all-reduce where the others send zeros); the engine then
        copies it into the replica (a joining SyncStart with startup_bytes). Returns the bytes this process sent (0
        when every digest agrees, as with one seed or one checkpoint)."""
        if bool((digests == digests[0]).all()):
            return 0
        manager, outer = self.manager, self.outer
        flat = torch.cat([p.detach().reshape(-1).cpu() for p in outer.global_params])
        if manager.participating_rank() != 0:
            flat.zero_()
        manager.allreduce(flat, reduce_op=torch.distributed.ReduceOp.SUM).wait()
        if manager.errored() is not None:
            raise RunError(f"the replicas started from different parameters and sending the first one's to the "
                           f"others failed ({first_line(manager.errored())}); start them again.")
        copy_flat(flat, outer.global_params)
        if self._digest() != float(digests[0]):
            raise RunError("the replicas started from different parameters, and those the first participant sent "
                           "are not the ones its digest names (a replica sent something other than zeros, or the "
                           "sender something other than its parameters); start them again from one seed or "
                           "checkpoint.")
        logger.warning("DiLoCo/torchft: the replicas started from different parameters; the first participant's "
                       "(%.2f MB) were sent to the others. Give every replica the same seed or checkpoint to skip "
                       "this.", flat.numel() * 4 / 1e6)
        return ring_all_reduce_bytes(flat.numel() * 4, len(digests))

    # --- one sync: who takes part, and what happens after the vote ---

    @property
    def replica(self) -> int:
        """This replica's id as records and verdicts name it: its replica_id (not its rank in a sync's quorum)."""
        return self.args.replica_id

    @property
    def num_replicas(self) -> int:
        return self.args.num_replicas

    continues_record = True  # a restarted replica continues its record

    def due(self, step: int, max_steps: int, progress) -> bool:
        """A sync is due after H/F inner steps of local progress (or round_seconds/F of them), and at the last
        step, unless a sync that landed ended the run (an overlapped one launched before a peer's last step);
        which fragments it syncs is agreed after the quorum (`start`)."""
        if step >= max_steps:
            return not self.run_over()
        if self.args.round_seconds > 0:
            return self.budget_due(progress)
        return progress.steps >= self.schedule.sync_every

    def run_over(self, agreed_step: int | None = None) -> bool:
        """The run's last sync has committed: the one that brought a participant to max_steps (the agreed step is
        healed with the rest, so a replica that was behind learns it from the peer it heals from; `agreed_step`:
        the one a heal brings, before it is taken)."""
        return (self.agreed_step if agreed_step is None else agreed_step) >= self.max_steps

    def expected_fragments(self, step: int, max_steps: int, local: dict | None = None) -> list[int]:
        """The fragments the next sync carries by this replica's sync counter; the same on every participant unless
        this replica heals in the quorum (see SyncEngine._in_background)."""
        return self.schedule.fragments_of_sync(self.syncs + 1, None, step >= max_steps)

    def start(self, step: int, max_steps: int, local: dict, expected: list[int] | None = None, joining: bool = False,
              timeout: float | None = None, overlapped: bool = False) -> SyncStart:
        """Quorum (a replica behind heals here), then one small all-reduce of every participant's row (who, tokens,
        weight, staleness, loss, ...) so that every participant knows every weight before the first bucket.

        `overlapped`: the sync's start runs in the background while the replica trains on; a replica that heals
        there takes part with weight 0 (its snapshot was taken against the base it left) and restarts from the
        healed θ_global after the sync."""
        local = {**local, "tokens": local["tokens"] + self.carried_tokens}
        self.sync_local_steps = local["steps"]
        if not joining and self.comm.group_size > 1:
            local = self._whole_replica(local)
        started = time.perf_counter()
        self.healed_to_step = None
        self.heal.expect(self.syncs, self.sync_local_steps, overlapped)
        self.sync_step = step
        try:
            self.manager.start_quorum(timeout=None if timeout is None else timedelta(seconds=timeout))
        except (RuntimeError, TimeoutError) as error:
            raise QuorumFailed(
                f"the torchft sync failed ({first_line(error)}): no sync formed within sync_timeout="
                f"{self.args.sync_timeout:g} s; fewer than min_replicas={self.args.min_replicas} replicas are live, "
                f"the others have finished the run, or the Lighthouse "
                f"({self.args.lighthouse or 'TORCHFT_LIGHTHOUSE'}) cannot be reached.") from None
        quorum_seconds = time.perf_counter() - started
        # A peer's state that healed this replica is applied only once the quorum's digests show it is the
        # θ_global the others hold (after the table below); what the table needs of it is read from it here.
        state = self.heal.take()
        error = self.manager.errored()
        participants = self.manager.num_participants()
        rank = self.manager.participating_rank()
        healed = state is not None
        stash = self.heal.stash
        staleness = max(0, int(state["global_sync"]) - self.syncs) if healed and stash is not None else 0
        # The run is over (this replica healed from one that finished it, or is handing the final model to a late
        # one): nobody's progress is merged any more, so every participant comes with weight 0.
        over = self.run_over(int(state["agreed_step"]) if healed else None)
        tokens = 0 if joining or over else local["tokens"]
        # θ_global is finite, so Δ_i = θ_global − θ_i is finite exactly when this replica's parameters are: a
        # replica that diverged sits the sync out with weight 0 (it sends zeros) and takes θ_global after it.
        # (An overlapped sync's exchange checks its snapshot again; here the parameters have not moved yet.)
        finite = joining or over or stash is not None or local.get("finite", True)
        refused = self.heal.refused is not None  # behind, and not healed: what it would send is against an old base
        weight = staleness_weight(tokens, staleness) if finite and not (healed and overlapped) and not refused \
            else 0.0
        self.comm.refusal = self.heal.refused
        checking = joining and self.check_identical and not healed and not refused
        mine = [float(self.args.replica_id), local["steps"], tokens, weight, float(healed), staleness,
                local["loss_sum"], local["compute_seconds"], quorum_seconds, float(local["stop_requested"]),
                float(not finite), float(step), self._digest() if checking else 0.0,
                *local.get("checks", [float("nan")] * len(CHECK_FIELDS))]
        table = torch.zeros(max(participants, 1), len(MEMBER_FIELDS), dtype=torch.float64)
        if rank is not None and error is None:
            table[rank] = torch.tensor(mine, dtype=torch.float64)
        self.comm.arm()
        self.manager.allreduce(table, reduce_op=torch.distributed.ReduceOp.SUM).wait()
        self.comm.configure(participants, rank)
        if joining:
            self.check_identical = False  # once, before the first inner step
        startup_bytes = None
        if checking and participants > 1 and error is None:
            digests = table[:participants, MEMBER_FIELDS.index("digest")]
            startup_bytes = self._start_identical(digests)
        if error is None and bool(table[:participants, MEMBER_FIELDS.index("healed")].any()):
            for healer in self._heals_refused(table[:participants], state):
                table[healer, MEMBER_FIELDS.index("weight")] = table[healer, MEMBER_FIELDS.index("healed")] = 0.0
                if healer == rank:
                    healed, state, stash, weight, finite = False, None, None, 0.0, local.get("finite", True)
                    self.heal.settle()
                    self.comm.refusal = self.heal.refused
        self._heal_with(state)
        table[:participants, MEMBER_FIELDS.index("weight")] = torch.tensor(merge_weights(
            table[:participants, [MEMBER_FIELDS.index(f) for f in ("tokens", "staleness", "weight")]].tolist()),
            dtype=torch.float64)
        weight = float(table[rank, MEMBER_FIELDS.index("weight")]) if rank is not None and error is None else weight
        weights = table[:, MEMBER_FIELDS.index("weight")]
        largest = float(weights.max()) if participants else 0.0
        # A participant at its last step: every fragment syncs, so the final model is global.
        last = bool((table[:participants, MEMBER_FIELDS.index("at_step")] >= max_steps).any())
        fragments = self.schedule.fragments_of_sync(self.syncs + 1, None, last)
        rows = [dict(zip(MEMBER_FIELDS, row, strict=True)) for row in table[:participants].tolist()]
        return SyncStart(
            weight=self.relative_weight(weight, largest, when_nobody=0.0), fragments=fragments, empty=largest == 0,
            stash=stash, healed=healed, finite=finite, joining=joining,
            stop_requested=any(row["stop_requested"] for row in rows), participants=rows, quorum_seconds=quorum_seconds,
            extra_bytes=ring_all_reduce_bytes(table.numel() * 8, participants),
            error=None if error is None else first_line(error), startup_bytes=startup_bytes,
            continue_at=self.healed_to_step)

    def finish(self, start: SyncStart, result, tokens: int = 0, step: int = 0) -> Verdict:
        """After the vote: move the sync counter on a commit, decide what a replica keeps after a rollback
        (`restart`: it starts again from θ_global), and give the sync's membership for its record: a row per
        replica (participants with their rows, absent ones), the vote, and loss and tokens from the participants'
        rows (known even when the sync rolled back). `tokens`: what this replica trained in the sync."""
        restart, continue_at = False, None
        if result.committed:
            if result.total_weight > 0:
                self.syncs += 1
                self.last_participants = {int(row["replica"]) for row in start.participants}
                # Every participant continues at the furthest one's step (the run's progress, as on torch), plus
                # the steps it took while an overlapped sync was in flight, unless this sync ended the run.
                self.agreed_step = max(self.agreed_step, *(int(row["at_step"]) for row in start.participants))
                moved = self.continued_step(self.agreed_step, self.sync_step, step, over=self.run_over())
                if moved > step:
                    step = continue_at = moved
            # A healed replica's training against the old base went into this sync: it starts from θ_global, as
            # every replica does from the sync that ended the run (the final model), whatever it trained since.
            restart = start.healed or self.run_over()
            self.heal.settle()
            self.carried_tokens = 0
        elif start.healed or not start.finite:
            # The base moved under this replica and the sync did not land, or its own progress is not finite:
            # start over from θ_global.
            restart = True
            self.heal.settle()
            self.carried_tokens = 0
        elif not start.joining:
            self.carried_tokens += tokens  # progress kept for the next sync
        replicas, present = membership(start.participants, self.known)
        self.known |= present
        reason = None if result.committed else start.error or first_line(self.manager.errored() or "a peer failed")
        if reason:  # said here for a sync that failed before anything was exchanged too (it has no record)
            logger.warning("DiLoCo/torchft: the sync at step %d did not commit (%s); this replica keeps its local "
                           "progress for the next sync.", step, reason)
        return Verdict(restart, continue_at, sync=self.syncs, step=step, membership=dict(
            replicas=replicas, committed=result.committed, quorum_seconds=start.quorum_seconds,
            replica=self.args.replica_id, tokens_trained=tokens, heal_refused=self.heal.refused, error=reason))

    def joined(self, start: SyncStart, step: int) -> None:
        """Say, on the replica's main process, where it joined the run."""
        if self.comm.member == 0:
            where = self.schedule.name_sync(self.syncs)
            print(f"[diloco] replica {self.args.replica_id} joined at {where} (step "
                  f"{step if self.continued_at is None else self.continued_at})"
                  f"{', healed from a live peer' if start.healed else ''}; {len(start.participants)} replica(s) in the "
                  f"quorum", flush=True)

    def linger(self, step: int, max_steps: int) -> list[int]:
        """After the run's last sync: stay up to end_linger_seconds for the replicas that missed it.

        A replica that is behind (restarted, or waiting for a sync that can no longer form without the finished
        ones) meets this one in a quorum, heals from it (θ_global, the sync counter), sees that the run is over,
        takes part with weight 0 and ends with the final model. Rounds here exchange nothing: every participant is
        over, so every weight is 0 and only the vote runs. Returns the replicas that got the final model this way.
        """
        if self.args.replica_id not in self.last_participants:  # it missed the last sync itself: nothing to hand over
            return []
        waiting = self.known - self.last_participants
        served: list[int] = []
        deadline = time.monotonic() + self.args.end_linger_seconds
        while waiting and time.monotonic() < deadline:
            try:
                start = self.start(step, max_steps, NOTHING_TRAINED, joining=True,
                                   timeout=max(0.1, deadline - time.monotonic()))
            except (RuntimeError, TimeoutError) as error:  # no quorum before the deadline: nobody is coming
                logger.debug("torchft: no late replica came: %s", first_line(error))
                break
            if not start.empty:  # someone brings progress against a live sync: this replica has nothing to add
                break
            self.comm.vote()
            arrived = {int(row["replica"]) for row in start.participants} & waiting
            served += sorted(arrived)
            waiting -= arrived
            if not arrived:  # only replicas that finished met here: give the late ones time to arrive, not a spin
                time.sleep(min(LINGER_PAUSE_SECONDS, max(0.0, deadline - time.monotonic())))
        if served and self.comm.member == 0:
            print(f"[diloco] replica {self.args.replica_id} handed the final model to replica(s) "
                  f"{', '.join(map(str, served))}, which missed the last sync", flush=True)
        return served

    def shutdown(self) -> None:
        try:
            self.manager.shutdown(wait=False)
        except Exception as error:  # noqa: BLE001 (leaving: nothing to recover)
            logger.debug("torchft manager shutdown: %s", error)
