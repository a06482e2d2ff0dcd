"""What a sync reports: the statistics each process sends with it, the sync's record and the run's summary.

A sync is one fragment's exchange and outer step, a round the H steps in which every fragment syncs once
(hf_diloco.schedule); syncs.jsonl holds one record per sync, with the round it belongs to.

The same functions serve both backends; a backend adds its membership fields (torchft: members, committed,
quorum time) to the record it gets from here.
"""

from __future__ import annotations

import math
import time
from dataclasses import astuple, dataclass, fields

import torch

from .comm import ring_all_reduce_bytes
from .contributions import CHECK_FIELDS
from .metrics import SyncWriter, format_sync, outer_rounds, read_syncs, write_summary


@dataclass
class ReplicaStats:
    """One process's numbers for a sync, sent with the sync's last collective (see comm.ReplicaComm): every
    process receives every process's, so decisions taken from them (stop now, the auto H) agree everywhere.

    `weight` is filled in by the sync (outer._riding); agreement and blocked time of a sync are only known after
    it, so they travel with the next one.

    >>> ReplicaStats(loss_sum=2.5, steps=5).tensor()[:3].tolist()
    [1.0, 2.5, 5.0]
    """

    weight: float = 1.0
    loss_sum: float = 0.0
    steps: int = 0
    tokens: int = 0
    compute_seconds: float = 0.0
    pseudo_grad_norm_sq: float = 0.0
    stop_requested: float = 0.0
    previous_agreement: float = float("nan")
    previous_blocked_seconds: float = 0.0
    previous_exchange_seconds: float = 0.0  # how long this replica's previous exchange took (sync_delay auto)
    arrived: float = 0.0  # when this replica launched the sync: the wall clock modulo ARRIVAL_PERIOD (see replica_rows)

    def tensor(self) -> torch.Tensor:
        return torch.tensor([float(x) for x in astuple(self)], dtype=torch.float64)


STAT_NAMES = tuple(f.name for f in fields(ReplicaStats))
# Statistics travel as float32: the wall clock is sent modulo 2^14 s (about 1 ms apart at most), and arrivals are
# compared within half that period.
ARRIVAL_PERIOD = 2.0**14


def arrival_clock() -> float:
    return time.time() % ARRIVAL_PERIOD


class SyncStats:
    """Every process's ReplicaStats of a sync, by name: `stats.steps` is a [g, M] tensor (member, replica).

    >>> rows = torch.stack([ReplicaStats(steps=4).tensor(), ReplicaStats(steps=6).tensor()]).view(1, 2, -1)
    >>> SyncStats(rows).steps.tolist()
    [[4.0, 6.0]]
    """

    def __init__(self, rows: torch.Tensor):
        self.rows = rows

    def __getattr__(self, name: str) -> torch.Tensor:
        if name not in STAT_NAMES:
            raise AttributeError(name)
        return self.rows[..., STAT_NAMES.index(name)]


def sync_record(*, stats: SyncStats, result, step: int, sync_number: int, round_number: int, fragments: list[int],
                 cumulative_bytes: int, sync_seconds: float, blocked: float, outer_lr: float, inner_lr: float,
                 num_replicas: int, group_size: int, ddp_payload: int, compression: str,
                 synced_parameters: int, sharded: bool = False) -> dict:
    """The record of one sync (sync number `sync_number`, of round `round_number`), as
    `<output_dir>/syncs.jsonl` holds it (the contract: docs/reference/outputs.md).

    A replica's loss is over all its members' micro-batches, its tokens are its members' sum, its compute time its
    slowest member's; members share one pseudo-gradient, which a sharded replica's members hold a shard each of
    (its norm² is the sum of theirs).
    """
    cost = result.cost
    steps = stats.steps.sum(0)
    replica_losses = (stats.loss_sum.sum(0) / steps.clamp(min=1)).tolist()
    replica_compute = stats.compute_seconds.amax(0).tolist()
    compute = max(replica_compute)
    tokens = int(stats.tokens.sum())
    sync_steps = int(stats.steps[0].max())
    record = {
        "sync": sync_number,
        "round": round_number,
        "step": step,
        "time": time.time(),
        "loss": sum(replica_losses) / len(replica_losses),
        "replica_losses": replica_losses,
        "pseudo_grad_norm": math.sqrt(result.average_norm_sq),
        "replica_pseudo_grad_norms": (stats.pseudo_grad_norm_sq.sum(0) if sharded else stats.pseudo_grad_norm_sq[0]
                                      ).clamp(min=0).sqrt().tolist(),
        "bytes_per_replica": cost.bytes_sent,
        "cumulative_bytes_per_replica": cumulative_bytes,
        "intra_replica_bytes": cost.intra_replica_bytes,
        "ddp_bytes_per_replica": sync_steps * ring_all_reduce_bytes(ddp_payload, num_replicas * group_size),
        "compression": compression,
        "compression_ratio": result.fp32_bytes_sent / cost.bytes_sent if cost.bytes_sent else None,
        "fragments": fragments,
        "sync_seconds": sync_seconds,
        "blocked_seconds": blocked,
        "compute_seconds": compute,
        "replica_compute_seconds": replica_compute,
        "tokens": tokens,
        "tokens_per_second": tokens / (compute + blocked) if compute + blocked > 0 else 0.0,
        "outer_lr": outer_lr,
        "inner_lr": inner_lr,
        "sync_steps": sync_steps,  # inner steps taken since the previous sync (H / F, except at the end)
        "num_replicas": num_replicas,
        "replica_group_size": group_size,
        "synced_parameters": synced_parameters,
        "collectives": cost.collectives,
    }
    record["replicas"] = replica_rows(stats, result.weights)
    if result.committed and result.participants < num_replicas:
        record["non_finite_replicas"] = [r for r, ok in enumerate(result.healthy) if not ok]
        record["participants"] = result.participants
        if not result.participants:
            record["outer_step_skipped"] = True
    if result.refused:  # what arrived broke a bound (hf_diloco.fragments.SyncResult.refuse): nothing was applied
        record.update(refused=result.refused, outer_step_skipped=True)
    previous = stats.previous_agreement[0].tolist()
    if all(math.isfinite(x) for x in previous):
        record["agreement_sync"] = sync_number - 1
        record["replica_agreement"] = previous  # cos(Δ_i, Δ) of sync `agreement_sync`, one per replica
    return record


def replica_rows(stats: SyncStats, weights: list[float] | None) -> list[dict]:
    """One row per replica, as the torchft backend's records hold them (one reader serves both): its steps since its
    last sync, its tokens (its members' sum), its weight in the average (tokens relative to the most with
    time-budget rounds, else 1; 0: it sat the sync out), its loss sum (its members' mean) and compute time (its
    slowest member's), and `waited_seconds`: how long before the last replica it arrived at the sync, by the wall
    clock (a blocking sync keeps it waiting that long; across machines the figure is off by their clocks' skew).

    >>> rows = torch.stack([ReplicaStats(steps=9, tokens=90, arrived=10.0).tensor(),
    ...                     ReplicaStats(steps=3, tokens=30, arrived=12.5).tensor()]).view(1, 2, -1)
    >>> [(m["steps"], m["tokens"], m["waited_seconds"]) for m in replica_rows(SyncStats(rows), [1.0, 1 / 3])]
    [(9, 90, 2.5), (3, 30, 0.0)]
    """
    half = ARRIVAL_PERIOD / 2
    arrived = stats.arrived.amax(0)
    after_first = [float((a - arrived[0] + half) % ARRIVAL_PERIOD - half) for a in arrived]
    last = max(after_first)
    rows = []
    for r in range(arrived.numel()):
        weight = float(stats.weight[0, r]) if weights is None else float(weights[r])
        rows.append({"replica": r, "participated": weight > 0, "steps": int(stats.steps[:, r].max()),
                     "tokens": int(stats.tokens[:, r].sum()), "weight": weight,
                     "loss_sum": float(stats.loss_sum[:, r].mean()),
                     "compute_seconds": float(stats.compute_seconds[:, r].max()),
                     "waited_seconds": last - after_first[r]})
    return rows


# Columns of a torchft membership row that steer the sync but are not part of the record (the participant's step,
# its parameters' digest, the contribution checks' numbers).
UNRECORDED_MEMBER_FIELDS = ("at_step", "digest", *CHECK_FIELDS)


def membership(rows: list[dict], known: set[int]) -> tuple[list[dict], set[int]]:
    """The record's replica rows from a torchft sync's membership rows (one per participant): weights as the merge used
    them (relative to the largest, as on the torch backend), counts as whole numbers, and a row for each replica
    seen in an earlier sync (`known`) that is absent from this one. Returns (replica rows, the participants' ids).

    >>> rows = [{"replica": 1.0, "steps": 5.0, "tokens": 50.0, "weight": 2.0, "healed": 0.0, "staleness": 0.0,
    ...          "stop_requested": 0.0, "non_finite": 0.0, "quorum_seconds": 0.1, "at_step": 5.0}]
    >>> replicas, present = membership(rows, known={0, 1})
    >>> [(m["replica"], m["participated"], m.get("weight")) for m in replicas], present
    ([(1, True, 1.0), (0, False, None)], {1})
    """
    largest = max((row["weight"] for row in rows), default=0.0)
    replicas = []
    for row in rows:
        member = {**row, "replica": int(row["replica"]), "participated": True, "healed": bool(row["healed"]),
                  "weight": row["weight"] / largest if largest > 0 else 0.0,
                  "steps": int(row["steps"]), "tokens": int(row["tokens"]), "staleness": int(row["staleness"]),
                  "stop_requested": bool(row["stop_requested"]), "non_finite": bool(row["non_finite"])}
        for key in UNRECORDED_MEMBER_FIELDS:
            member.pop(key, None)
        member["waited_seconds"] = member.pop("quorum_seconds")  # as the torch backend's rows name it
        replicas.append(member)
    present = {m["replica"] for m in replicas}
    return replicas + [{"replica": r, "participated": False} for r in sorted(known - present)], present


def quorum_record(record: dict, replicas: list[dict], *, committed: bool, quorum_seconds: float, replica: int,
                  tokens_trained: int, heal_refused: str | None = None, error: str | None = None) -> None:
    """A torchft sync's record, in place: its membership (every member, absent ones too), the vote, and loss and
    tokens from the members' rows (known even when the sync rolled back), replacing the fixed group's reading.
    `tokens_trained`: what this replica trained in the sync (its tokens per second); `heal_refused` and `error`:
    why its heal was refused, why the sync did not commit."""
    for key in ("non_finite_replicas", "outer_step_skipped", "participants"):  # (a refusal's reasons stay)
        record.pop(key, None)
    took_part = [m for m in replicas if m["participated"]]
    losses = [m["loss_sum"] / m["steps"] for m in took_part if m["steps"]]
    compute = record["compute_seconds"] + record["blocked_seconds"]
    record.update(replicas=sorted(replicas, key=lambda m: m["replica"]),
                  committed=committed, participants=len(took_part), num_replicas=len(took_part),
                  quorum_seconds=quorum_seconds, outer_backend="torchft", replica=replica,
                  loss=sum(losses) / len(losses) if losses else float("nan"), replica_losses=losses,
                  tokens=sum(m["tokens"] for m in took_part),
                  tokens_per_second=tokens_trained / compute if compute > 0 else 0.0)
    non_finite = [m["replica"] for m in replicas if m.get("non_finite")]
    if non_finite:
        record["non_finite_replicas"] = non_finite
    if not committed:
        record["outer_step_skipped"] = True
    if heal_refused:
        record["heal_refused"] = heal_refused
    if error:
        record["error"] = error


def summary(syncs: list[dict], *, steps: int, train_started: float, initial_eval_loss: float | None,
            settings: dict, initial_eval_accuracy: float | None = None) -> dict:
    """The run's totals (`diloco_summary.json`), from its sync records (a classifier's: its accuracy too)."""
    wall = sum(r["compute_seconds"] + r["blocked_seconds"] for r in syncs)
    tokens = sum(r["tokens"] for r in syncs)
    evals = [r["eval_loss"] for r in syncs if r.get("eval_loss") is not None]
    accuracies = [r["eval_accuracy"] for r in syncs if r.get("eval_accuracy") is not None]
    accuracy = {} if initial_eval_accuracy is None and not accuracies else {
        "eval_accuracy_initial": initial_eval_accuracy, "eval_accuracy_final": accuracies[-1] if accuracies else None}
    return {
        **accuracy,
        "rounds": outer_rounds(syncs),
        "syncs": len(syncs),
        "steps": steps,
        **settings,
        "eval_loss_initial": initial_eval_loss,
        "eval_loss_final": evals[-1] if evals else None,
        "train_loss_final": syncs[-1]["loss"] if syncs else None,
        "tokens": tokens,
        "tokens_per_second": tokens / wall if wall > 0 else 0.0,
        "train_seconds": time.time() - train_started,
        "sync_seconds": sum(r["sync_seconds"] for r in syncs),
        "blocked_seconds": sum(r["blocked_seconds"] for r in syncs),
        "bytes_per_replica": sum(r["bytes_per_replica"] for r in syncs),
        "startup_bytes": sum(r.get("startup_bytes", 0) for r in syncs),
        "ddp_bytes_per_replica": sum(r["ddp_bytes_per_replica"] for r in syncs),
        "contributions_excluded": sum(len(r.get("excluded") or []) for r in syncs),
    }


class Records:
    """The syncs of this process as they land, for both backends. A record waits until the sync's evaluation
    (Trainer runs it right after the sync, at the same step) so that `eval_loss` lands in it; then it is kept, and
    on the main process written to syncs.jsonl (`SyncWriter`), handed to the trackers (`report`) and printed
    as one console line. At the end the main process writes the run's summary (`close`)."""

    def __init__(self, plain_console: bool, num_fragments: int = 1):
        self.plain_console = plain_console  # print lines as they are (disable_tqdm), else through tqdm.write
        self.console = True  # print each sync's line (hf_diloco.console: on the run's main process only)
        self.num_fragments = num_fragments
        self.pending: list[dict] = []  # syncs landed at this step, written once its eval is known
        self.history: list[dict] = []
        self.writer: SyncWriter | None = None
        self.report = None  # called with each written record (the trainer's trackers)
        self.total_syncs: int | None = None
        self.initial_eval_loss: float | None = None
        self.initial_eval_accuracy: float | None = None
        self.carried: dict = {}  # fields for the next record (a resume's note, the start-up's bytes)
        self.cumulative_bytes = 0  # bytes this replica sent in every sync of the run so far
        self.train_started = time.time()


    def expect_syncs(self, total: int | None) -> None:
        """How many syncs the run makes (None: not known ahead, with time budgets), for the console lines."""
        self.total_syncs = total
    def open(self, output_dir: str, step: int, *, continues_record: bool, resumed_from: str | None,
             reached_before_resume: int, report) -> None:
        """Main process, at the start of training: the sync record of `output_dir`, cut at the checkpoint's
        `step` (syncs past it are retrained) unless the backend `continues_record` (a restarted torchft replica)."""
        syncs = read_syncs(output_dir)
        reached = max([r["step"] for r in syncs] + [reached_before_resume, step])
        self.writer = SyncWriter(output_dir)
        self.report = report
        kept = syncs if continues_record else self.writer.truncate_after(step)
        self.train_started = time.time()
        if resumed_from is not None:
            # Syncs after the checkpoint are gone with the processes that made them: say how many steps.
            self.carry(resumed_from=resumed_from, steps_lost=max(0, reached - step))
        self.cumulative_bytes = kept[-1]["cumulative_bytes_per_replica"] if kept else 0

    def carry(self, **fields) -> None:
        """Fields that go into the next record queued."""
        self.carried.update(fields)

    def add_bytes(self, sent: int) -> int:
        """A sync sent `sent` bytes: the run's total so far."""
        self.cumulative_bytes += sent
        return self.cumulative_bytes

    def queue(self, record: dict) -> None:
        record.update(self.carried)
        self.carried = {}
        self.pending.append(record)

    def evaluated(self, step: int, eval_loss: float | None, accuracy: float | None = None) -> None:
        """An evaluation at `step` (its loss, and a classifier's accuracy): it belongs to the sync landed at that
        step, or (step 0) to the start."""
        if self.pending and self.pending[-1]["step"] == step:
            self.pending[-1]["eval_loss"] = eval_loss
            if accuracy is not None:
                self.pending[-1]["eval_accuracy"] = accuracy
            self.flush()
        elif step == 0:  # eval_on_start: the model before any training
            self.initial_eval_loss, self.initial_eval_accuracy = eval_loss, accuracy

    def quiet(self) -> None:
        """Keep writing and reporting the syncs, but print no line for them (hf_diloco.console: a process other
        than the run's main one)."""
        self.console = False

    def flush(self) -> None:
        records, self.pending = self.pending, []
        for record in records:
            self.history.append(record)
            if self.writer is None:
                continue
            self.writer.write(record)
            if self.report is not None:
                self.report(record)
            line = format_sync(record, self.total_syncs, self.num_fragments)
            if not self.console:
                continue
            if self.plain_console:
                print(line, flush=True)
            else:
                from tqdm.auto import tqdm

                tqdm.write(line)

    def close(self, output_dir: str, steps: int, settings: dict, last_agreement: list[float] | None) -> None:
        """Main process, at the end of training: the run's totals in `diloco_summary.json`."""
        self.flush()
        if self.writer is None:
            return
        totals = summary(self.history, steps=steps, train_started=self.train_started,
                         initial_eval_loss=self.initial_eval_loss, settings=settings,
                         initial_eval_accuracy=self.initial_eval_accuracy)
        if last_agreement is not None and self.history:
            totals["last_sync_agreement"] = {"sync": self.history[-1]["sync"], "replica_agreement": last_agreement}
        write_summary(output_dir, totals)
