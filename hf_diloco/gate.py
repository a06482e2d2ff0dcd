"""The gate: contribution checks between a sync's launch and its landing (the rules: hf_diloco.contributions).

    launch   this replica's row for the sync (‖Δ_i‖, the steps and Σ η it covers, its last agreements, with
             contribution_loss_check the loss its round removed from a held-out batch)
    start    every replica's row (torchft: in the membership table its quorum exchanged; torch: one small all-reduce
             over the sync's groups, its bytes counted with the sync's), the same verdict on every replica, and
             weight 0 for this replica if it is found out (mode exclude)
    land     its leave-one-out agreement λ_i with what merged, remembered for the next sync's row; a replica left
             out takes θ_global

Who is left out is the gate's only output: the verdicts in the sync's start (`SyncStart.excluded`) and the record.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from .backends import SyncStart
from .config import DiLoCoConfig
from .contributions import CHECK_FIELDS, ContributionChecks, Limits, judge, leave_one_out
from .fragments import SyncResult, norm
from .inner import unwrapped


class Gate:
    """One replica's contribution checks. `attach` hands it the inner optimizer (its kind: the `size` rule bounds
    AdamW-like steps by the learning rate; its age) and, with contribution_loss_check, the model's loss on a held-out
    batch (a callable, the same batch on every replica)."""

    def __init__(self, args: DiLoCoConfig):
        self.args = args
        self.inner_optimizer = None
        self.held_out_loss: Callable[[], float] | None = None
        self.checks = ContributionChecks(
            args.contribution_checks, Limits(adam_ratio=args.contribution_adam_ratio,
                                             norm_ratio=args.contribution_norm_ratio,
                                             min_agreement=args.contribution_min_agreement,
                                             agreement_gap=args.contribution_agreement_gap,
                                             loss_margin=args.contribution_loss_margin),
            faulty_after=args.contribution_faulty_after, base_lr=args.learning_rate)
        self.base_loss = float("nan")  # contribution_loss_check: the held-out batch's loss where the round started

    def attach(self, inner_optimizer, held_out_loss: Callable[[], float] | None) -> None:
        """The replica's inner optimizer and (contribution_loss_check) its held-out loss, once training begins."""
        self.inner_optimizer, self.held_out_loss = inner_optimizer, held_out_loss

    @property
    def active(self) -> bool:
        return self.checks.active

    @property
    def excluding(self) -> bool:
        return self.checks.mode == "exclude"

    def checking(self, joining: bool, num_replicas: int) -> bool:
        """Whether a sync's contributions are checked: not the joining one, and only with peers to compare."""
        return self.checks.active and not joining and num_replicas > 1

    def row(self, comm, buckets: list[int], deltas, since_base: tuple[float, float, float], with_loss: bool = False
            ) -> list[float]:
        """This replica's row: ‖Δ_i‖ over `buckets` (`deltas`: a list or an iterator of Δ_i), the steps, Σ η and
        examples since its base, and (`with_loss`, a blocking sync) the loss its round removed."""
        steps, lr_sum, examples = since_base
        # Every member counts the rows of its own micro-batches (tensor-parallel members the same rows each): the
        # replica's are their sum, and a step takes at most a micro-batch per accumulation step on each member.
        examples = comm.control.members_total([float(examples)])[0]
        batch = self.args.per_device_train_batch_size * self.args.gradient_accumulation_steps * comm.group_size
        return self.checks.row(norm(comm, buckets, deltas), steps, lr_sum,
                               self._loss_gain() if with_loss else float("nan"), self._optimizer_age(), examples,
                               batch)

    def presence_row(self) -> list[float]:
        """The row of a replica that joins a sync with nothing to judge: its base learning rate, for the others."""
        return self.checks.presence_row()

    def judge(self, start: SyncStart, local: dict, comm, parameters: int, replica: int) -> SyncStart:
        """`start` with the verdict: every replica's row judged alike (`excluded`), weight 0 for this replica if it
        is found out (mode exclude), and the bytes the rows cost. `parameters`: the values the sync carries."""
        # A replica joining a torchft sync (healing, no steps) judges the others' rows too, so that its record
        # holds the verdict every other participant reached; on the torch backend every replica joins together.
        if "checks" not in local or start.empty or (start.joining and not start.participants):
            return start
        sent = 0
        if start.participants:
            rows = {int(m["replica"]): [m.get(f, float("nan")) for f in CHECK_FIELDS] for m in start.participants}
        else:
            table, sent = comm.control.replica_rows(local["checks"])
            rows = {r: table[r].tolist() for r in range(table.shape[0])}
        excluded = judge(rows, parameters, self._adam(), self.checks.limits)
        weight = 0.0 if self.excluding and replica in excluded else start.weight
        return replace(start, excluded=excluded, weight=weight, extra_bytes=start.extra_bytes + sent)

    def landed(self, result: SyncResult, start: SyncStart, replica_index: int, replica: int) -> bool:
        """A committed sync landed: λ_i of this replica is remembered for its next row. Returns whether this replica
        was left out (mode exclude), so that it starts again from θ_global as a replica that diverged."""
        if not result.committed:
            return False
        if self.checks.active and result.weights is not None and not start.joining:
            weight = result.weights[replica_index]
            norm_sq, dot = result.own_terms(weight, decoded=True)  # with a codec: what the average holds of it
            self.checks.landed(leave_one_out(result.total_weight, weight, dot=dot, norm_sq=norm_sq,
                                             average_norm_sq=result.average_norm_sq),
                               left_out=replica in start.excluded)
        return replica in start.excluded and self.excluding

    def rebase(self) -> None:
        """contribution_loss_check: the replica holds θ_global now (F = 1, α = 0, τ = 0); its loss there is the next
        round's base."""
        if self.args.contribution_loss_check:
            self.base_loss = self._held_out_loss()

    def record(self, excluded: dict[int, str], record: dict) -> list[str]:
        """The verdicts into the sync's record; the console lines they call for."""
        return self.checks.record(excluded, record)

    def _loss_gain(self) -> float:
        """contribution_loss_check: the loss this replica's round removed from the held-out batch (its loss at
        θ_global when the round started, less its loss at the replica's parameters now); NaN without the check."""
        return self.base_loss - self._held_out_loss() if self.args.contribution_loss_check else float("nan")

    def _held_out_loss(self) -> float:
        assert self.held_out_loss is not None, "contribution_loss_check needs the held-out loss (Gate.attach)"
        return self.held_out_loss()


    def _inner_optimizer(self):
        return unwrapped(self.inner_optimizer)

    def _adam(self) -> bool:
        """Whether the inner optimizer's steps are bounded by the learning rate, as AdamW's are (the `size` check):
        an AdamW-family optimizer, or one that says so (inner_optimizer muon: MuonWithAdamW)."""
        optimizer = self._inner_optimizer()
        return getattr(optimizer, "steps_bounded_by_lr", "adam" in type(optimizer).__name__.lower())

    def _optimizer_age(self) -> float:
        """The steps the inner optimizer's state has taken (AdamW's `step`: since this process built it, or since
        the run's start when it was loaded from a checkpoint); NaN for an optimizer that does not count them."""
        for state in self._inner_optimizer().state.values():
            if "step" in state:
                return float(state["step"])
        return float("nan")
