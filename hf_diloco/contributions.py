"""Contribution checks: a replica whose pseudo-gradient does not belong is left out of the merge, and named.

Before each sync's exchange every replica's numbers go round in one small table (torchft: eleven more columns of
the membership table it exchanges anyway; torch backend: one all-reduce of M rows of eleven float64 numbers). Each
row holds

    norm        ‖Δ_i‖ of the sync (taken before a codec: the rules judge what the replica trained)
    steps       the inner steps Δ_i covers (since its base: a rolled-back torchft sync's steps count too)
    lr          its mean inner learning rate over those steps (its own schedule)
    loo         λ_i of its last sync: the leave-one-out agreement cos(Δ_i, Σ_{j≠i} w_j Δ_j), with a codec measured
                on what merged: cos(D_i, Σ_{j≠i} w_j D_j), D_j what the others decoded of replica j's contribution
                (error feedback's carried residual included)
    loo_before  λ_i of the sync before that
    left_out    1 if it was left out of its last sync
    loss_gain   with contribution_loss_check: the held-out batch's loss at the global parameters the round started
                from, less its loss at the replica's parameters now (NaN without the check)
    base_lr     the learning rate its settings give it (the peak of its schedule): known before any step, so a
                replica that joins, heals or brings no steps to a sync still reports it
    optimizer_age  the steps its inner optimizer's state has taken (a restarted process's is young)
    examples    the rows of the micro-batches its steps trained on, summed over its processes (NaN: inputs it cannot
                count, a preference pair's)
    batch       the most rows one step takes: per-device batch × gradient accumulation × processes

and every replica applies the same rules to the same table (`judge`), so every replica reaches the same verdict
without a vote. A replica found out sends weight 0 (the others divide by the weight that took part, its
error-feedback residual is left alone, it takes θ_global after the sync, as a replica with a non-finite
pseudo-gradient does) and every record names it in `excluded`. The rules, with the thresholds' defaults:

    size      ‖Δ_i‖ > 2.0 · √P · Σ η  where P is the number of values synced and Σ η the learning rates of exactly
              the steps Δ_i covers (since the replica's own base, syncs it missed or rolled back included) on its
              schedule, scaled to the agreed base learning rate: the median of every participant's base_lr, those
              that bring no steps included (of two the smaller: too low a learning rate only slows a replica, too
              high a one spoils the merge). For an AdamW-family inner optimizer (or inner_optimizer muon, whose Muon
              steps are scaled to 0.2·η per value): AdamW moves each value by about η a step at most, so a replica far
              beyond that trained with a wrong learning rate (or sends something else). Works at M = 2, and on a lone
              contribution, judged against a replica that joined the sync with no steps. When every contribution is
              beyond it and each was given the agreed learning rate, none is left out (the run's own rate is what is
              too high); one given another rate is left out even when it is the only contribution, and then the sync
              does not move θ_global.
    steps     its steps against its examples, both its own account: more examples than `steps` batches hold, or
              fewer than half of them on average (only an epoch's last batch is short): a step counter that counts
              micro-batches would loosen its `size` and `outlier` measures by the accumulation factor. Any M; never
              every contribution. Its time is no bound: a replica's pace changes legitimately (a quota, a shared
              GPU, time budgets).
    outlier   M ≥ 3: ‖Δ_i‖ / Σ η > 2.3 · the median of every reporting replica's (itself included), Σ η as in
              `size`: per unit of learning rate spent, so a Δ_i covering more steps is not an outlier for it.
    opposed   M ≥ 3: λ_i < −0.3 in its last sync: it pulled against the others.
    apart     M ≥ 3: median_{j≠i} λ_j − λ_i > 0.35 · min(1, median_{j≠i} λ_j / 0.5) in each of its last two
              syncs: it agrees with the others far less than they agree with each other (a replica reading other
              data than the rest). The others are those not left out of their last sync (at least two, agreeing
              with each other: a positive median); the gap scales down where they agree less than 0.5 (late in a
              run, or a sparse codec's decoded values). A replica left out of its last sync stays out while either
              of its last two syncs was that far apart: it is taken back after two syncs that agree.
    loss      with contribution_loss_check, M ≥ 2: its round raised the held-out batch's loss by more than 0.05
              below min(0, the median replica's gain): its training made the model worse where the others' did not
              (the Gauntlet's idea, scored by each replica on its own parameters, so no Δ_i is sent apart).

With a codec, the norms are Δ_i's before it (what the replica trained: rounding and error feedback's carry-over
are not its doing) and λ is measured on what merged, D_i. Measured on Δ_i instead, λ would count the replica's
own codec error as the others': for the sparse codec with error feedback, the part of Δ_i left unsent points
against Δ_i, and a clean replica's λ falls as low as −0.6 (tests/test_contributions.py measures both against
the vectors). Decoded sparse values agree less with each other than the full Δ_i do (λ about 0.1 to 0.2 against
0.4 to 0.7 in the tests' runs), which is why the `apart` gap scales with the others' agreement.

At M = 2 there is no majority: the two replicas' agreement λ is the same number for both, and a norm ratio says
that the two differ, not which one is wrong; only `size`, measured against the learning rate every replica was
given, and `loss`, measured against where the round started, name a replica there. Comparing a replica with its
own past was measured and left out: a clean replica's norm moves 2x between syncs during warm-up, and a replica
wrong from the start has no clean past.

The numbers are each replica's own account of itself: the checks catch a site's mistakes (a wrong learning rate,
corrupted or foreign data, a bug), not a site that lies about its numbers; that needs every Δ_i sent apart (M times
the bytes of an all-reduce), which the checks do not do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

CHECK_FIELDS = ("check_norm", "check_steps", "check_lr", "check_loo", "check_loo_before", "check_left_out",
                "check_loss_gain", "check_base_lr", "check_optimizer_age", "check_examples", "check_batch")
SHORTEST_FILL = 0.5  # the `steps` rule: the least share of their batches a replica's steps may fill on average
MIN_MAJORITY = 3  # replicas reporting, for the rules that compare a replica with the others
AGREEMENT_LEVEL = 0.5  # the others' median λ below which the `apart` gap scales down with it


@dataclass
class Limits:
    """The rules' thresholds (DiLoCoConfig's contribution_* fields)."""

    adam_ratio: float = 2.0
    norm_ratio: float = 2.3
    min_agreement: float = -0.3
    agreement_gap: float = 0.35
    loss_margin: float = 0.05


def leave_one_out(total_weight: float, weight: float, dot: float, norm_sq: float, average_norm_sq: float) -> float:
    """λ_i = cos(Δ_i, Σ_{j≠i} w_j Δ_j) from what a replica knows after a sync: W = Σ w_j, its own w_i, Δ_i · Δ,
    ‖Δ_i‖² and ‖Δ‖², where Δ = Σ w_j Δ_j / W (so Σ_{j≠i} w_j Δ_j = WΔ − w_i Δ_i). NaN when the others sent nothing.

    >>> round(leave_one_out(2.0, 1.0, dot=0.5, norm_sq=1.0, average_norm_sq=0.5), 6)  # Δ_0 = e1, Δ_1 = e2
    0.0
    >>> round(leave_one_out(2.0, 0.0, dot=-1.0, norm_sq=1.0, average_norm_sq=1.0), 6)  # left out: cos(Δ_i, Δ)
    -1.0
    """
    others_sq = total_weight**2 * average_norm_sq - 2 * total_weight * weight * dot + weight**2 * norm_sq
    if not (others_sq > 1e-12 * max(1.0, total_weight**2 * average_norm_sq) and norm_sq > 0):
        return float("nan")
    return (total_weight * dot - weight * norm_sq) / math.sqrt(norm_sq * others_sq)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def judge(rows: dict[int, list[float]], parameters: int, adam: bool, limits: Limits) -> dict[int, str]:
    """The replicas to leave out of this sync, each with one sentence why, from every replica's row (replica id →
    CHECK_FIELDS values; NaN where a replica has no such number: its first syncs, a heal). `parameters`: the number
    of values the sync carries; `adam`: whether the inner optimizer is AdamW-like (the `size` rule). Never every
    replica that reports: when all would be left out, none can be told from the others and none is, save one that
    `size` leaves out for having been given another learning rate than the agreed one.

    >>> rows = {0: [1.0, 10, 0.01, 0.6, 0.6, 0], 1: [1.2, 10, 0.01, 0.5, 0.7, 0], 2: [9.0, 10, 0.01, 0.6, 0.5, 0]}
    >>> judge(rows, parameters=400, adam=False, limits=Limits())
    {2: "outlier: its pseudo-gradient norm 9 is 7.5x the median replica's (1.2); the check leaves out above 2.3x"}
    """
    norms = {r: row[0] for r, row in rows.items() if math.isfinite(row[0]) and row[0] > 0}
    verdicts: dict[int, str] = {}
    given_other_rate: set[int] = set()  # left out by `size` for a base learning rate other than the agreed one
    # A base rate from a peer counts only as a positive finite number (NaN: a replica of an older row, or none)
    bases = {r: row[7] for r, row in rows.items() if len(row) > 7 and math.isfinite(row[7]) and row[7] > 0}
    agreed = (_median(list(bases.values())) if len(bases) >= MIN_MAJORITY else min(bases.values())) if bases \
        else float("nan")
    spent = {r: _spent(rows[r], bases.get(r, agreed), agreed) for r in norms} if bases else {}
    if adam and spent and parameters > 0:
        over = {r: norms[r] / (math.sqrt(parameters) * spent[r]) for r in norms}
        over = {r: ratio for r, ratio in over.items() if ratio > limits.adam_ratio}
        given_other_rate = {r for r in over if not math.isclose(bases.get(r, agreed), agreed, rel_tol=1e-6)}
        for r, ratio in over.items():
            if len(over) < len(norms) or r in given_other_rate:
                given = f" (it was given {bases[r]:.3g})" if r in given_other_rate else ""
                verdicts[r] = (f"size: its pseudo-gradient norm {norms[r]:.4g} is {ratio:.1f}x what its "
                               f"{rows[r][1]:.0f} inner steps can make at the agreed learning rate {agreed:.3g} (Σ η "
                               f"{spent[r]:.3g} over those steps); the check leaves out above {limits.adam_ratio:g}x: "
                               f"is its learning rate the others'?{given}")
    for r in norms:
        if r not in verdicts and (said := _miscounted(rows[r])):
            verdicts[r] = said
    if len(norms) >= MIN_MAJORITY:
        # Norms per unit of learning rate spent (Σ η over the steps each covers, at the agreed rate): a replica whose
        # Δ_i covers more steps (it missed a sync, or trained faster under time budgets) is not an outlier for it.
        scaled = {r: n / spent[r] for r, n in norms.items()} if spent else norms
        # A replica whose inner optimizer started inside the steps its Δ_i covers (a restarted process: fresh AdamW
        # moments take steps of about η per value) is not measured against replicas whose optimizers are older, nor
        # counted in their median; `size` still bounds it.
        fresh = _fresh_optimizers(rows, norms)
        middle = _median([n for r, n in scaled.items() if r not in fresh] or list(scaled.values()))
        for r, n in scaled.items():
            if r not in verdicts and r not in fresh and middle > 0 and n / middle > limits.norm_ratio:
                per = " per unit of learning rate over its steps" if spent else ""
                verdicts[r] = (f"outlier: its pseudo-gradient norm{per} {n:.4g} is {n / middle:.1f}x the median "
                               f"replica's ({middle:.4g}); the check leaves out above {limits.norm_ratio:g}x")
        # a cosine outside [-1, 1] from a peer is not a number to judge by: it does not report
        loo = {r: rows[r][3] for r in norms if -1.0 <= rows[r][3] <= 1.0}
        before = {r: rows[r][4] for r in norms if -1.0 <= rows[r][4] <= 1.0}
        for r, value in loo.items():
            if r in verdicts:
                continue
            if value < limits.min_agreement:
                verdicts[r] = (f"opposed: in its last sync its pseudo-gradient pointed against the others' "
                               f"(leave-one-out agreement {value:.2f}; the check leaves out below "
                               f"{limits.min_agreement:g})")
                continue
            gaps = [_gap(values, r, rows) for values in (loo, before)]
            apart = [g is not None and g[0] > _gap_limit(g[1], limits) for g in gaps]
            if all(apart) or (rows[r][5] > 0 and any(apart)):
                shown = gaps[0] if apart[0] else gaps[1]
                verdicts[r] = (f"apart: it agrees with the others far less than they with each other (leave-one-out "
                               f"agreement {shown[1] - shown[0]:.2f} against their median {shown[1]:.2f}; the check "
                               f"leaves out a gap above {limits.agreement_gap:g} twice running, and keeps out until "
                               f"two syncs agree)")
    gains = {r: rows[r][6] for r in norms if len(rows[r]) > 6 and math.isfinite(rows[r][6])}
    if len(gains) >= 2:
        floor = min(0.0, _median(list(gains.values()))) - limits.loss_margin
        for r, gain in gains.items():
            if r not in verdicts and gain < floor:
                verdicts[r] = (f"loss: its round raised the held-out batch's loss by {-gain:.3f} where the median "
                               f"replica's changed it by {-_median(list(gains.values())):+.3f}; the check leaves out "
                               f"{limits.loss_margin:g} below the median (or below no change)")
    if verdicts and len(verdicts) >= len(norms):
        # Never every contribution, unless it was given another learning rate than the agreed one: that one is
        # told apart by what the others were given, not by what they sent.
        return {r: verdicts[r] for r in given_other_rate}
    return verdicts


def _miscounted(row: list[float]) -> str | None:
    """The `steps` rule on one row: its inner steps against the examples they trained on and the most one step
    takes (its batch), both from its own account; None when they agree or it gives no such numbers."""
    steps, examples, batch = row[1], *(row[9:11] if len(row) > 10 else (math.nan, math.nan))
    if not (math.isfinite(examples) and math.isfinite(batch) and batch > 0 and steps > 0):
        return None
    if examples > steps * batch * (1 + 1e-9):
        return (f"steps: its {examples:.0f} examples take at least {math.ceil(examples / batch - 1e-9)} steps of its "
                f"batch of {batch:.0f}, more than the {steps:.0f} it reports: does it count every optimizer step?")
    if steps >= 2 and examples < SHORTEST_FILL * steps * batch:
        return (f"steps: it reports {steps:.0f} steps, but its {examples:.0f} examples fill "
                f"{examples / (steps * batch):.0%} of that many batches of {batch:.0f} (only an epoch's last batch "
                f"is short; the check leaves out below {SHORTEST_FILL:.0%}): are its steps counted once per "
                f"optimizer step?")
    return None


def _fresh_optimizers(rows: dict[int, list[float]], norms: dict[int, float]) -> set[int]:
    """The replicas whose inner optimizer's age (its step count, CHECK_FIELDS' last) is no more than the steps their
    Δ_i covers, while another replica's optimizer is older than its own Δ_i: restarted among running ones. At a
    run's start every optimizer is that young, and none is set apart. The age is the replica's own word: it counts
    only with the rest of a new process's row (no agreement λ from a last sync), so a replica can claim it for one
    sync after each start, not at every sync."""
    age = {r: rows[r][8] for r in norms if len(rows[r]) > 8 and math.isfinite(rows[r][8]) and rows[r][8] >= 0}
    young = {r for r, a in age.items() if a <= rows[r][1] and not math.isfinite(rows[r][3])}
    return young if any(a > rows[r][1] for r, a in age.items()) else set()


def _spent(row: list[float], own: float, agreed: float) -> float:
    """Σ η of exactly the steps a row's Δ_i covers, on its replica's schedule scaled from its base rate `own` to
    the `agreed` one (its mean rate over those steps; the base rate where it reports none)."""
    steps, mean = max(row[1], 1.0), row[2]
    return steps * (mean if math.isfinite(mean) and mean > 0 else own) * agreed / own


def _gap(loo: dict[int, float], replica: int, rows: dict[int, list[float]]) -> tuple[float, float] | None:
    """(median of the others' λ − this replica's, the others' median), with at least two others that were not
    left out of their last sync (a replica found out is no measure of the rest) and agree with each other (a
    positive median); else None."""
    others = [value for r, value in loo.items() if r != replica and not rows[r][5] > 0]
    if replica not in loo or len(others) < MIN_MAJORITY - 1:
        return None
    middle = _median(others)
    return (middle - loo[replica], middle) if middle > 0 else None


def _gap_limit(middle: float, limits: Limits) -> float:
    """The `apart` rule's gap for an agreement level `middle` among the others: agreement_gap, scaled down in
    proportion where they agree less than AGREEMENT_LEVEL (late in a run, or a sparse codec's decoded values, which
    keep a few values of each chunk and agree about a fifth as much as the full Δ_i)."""
    return limits.agreement_gap * min(1.0, middle / AGREEMENT_LEVEL)


class ContributionChecks:
    """One replica's side of the checks: its row for the table, what it remembers of its last two syncs (λ), and
    how many syncs in a row each replica was left out (`faulty_after` in a row: said once on the console)."""

    def __init__(self, mode: str, limits: Limits, faulty_after: int, base_lr: float = float("nan")):
        self.mode = mode
        self.base_lr = base_lr  # the learning rate this replica's settings give it
        self.limits = limits
        self.faulty_after = faulty_after
        self.loo = [float("nan"), float("nan")]  # λ of this replica's last sync, and of the one before
        self.left_out = False  # whether it was left out of its last sync
        self.streaks: dict[int, int] = {}

    @property
    def active(self) -> bool:
        return self.mode != "off"

    def row(self, norm: float, steps: int, lr_sum: float, loss_gain: float = float("nan"),
            optimizer_age: float = float("nan"), examples: float = float("nan"), batch: float = float("nan")
            ) -> list[float]:
        """This replica's CHECK_FIELDS for a sync whose Δ_i has norm `norm` and covers `steps` inner steps of
        learning rates summing to `lr_sum`, trained on `examples` rows of at most `batch` a step; `optimizer_age`:
        the steps its inner optimizer's state has taken (NaN: unknown)."""
        return [norm, float(steps), lr_sum / steps if steps else float("nan"), *self.loo, float(self.left_out),
                loss_gain, self.base_lr, float(optimizer_age), float(examples), float(batch)]

    def presence_row(self) -> list[float]:
        """The row of a replica that brings no contribution to a sync (it joins or heals): its base learning rate,
        which the others' `size` bounds agree on, and nothing to judge."""
        nan = float("nan")
        return [nan, 0.0, nan, nan, nan, 0.0, nan, self.base_lr, nan, nan, nan]

    def landed(self, loo: float, left_out: bool) -> None:
        self.loo = [loo, self.loo[0]]
        self.left_out = left_out

    def record(self, verdicts: dict[int, str], record: dict) -> list[str]:
        """Put the sync's verdicts in its record (`excluded`, or with mode "warn" `flagged`, with the members' rows
        marked) and return the console lines it calls for: each verdict in warn mode, and a replica reported
        faulty when it has been left out `faulty_after` syncs in a row."""
        listed = [{"replica": r, "reason": reason} for r, reason in sorted(verdicts.items())]
        excluding = self.mode == "exclude"
        record["excluded"] = listed if excluding else []
        if not excluding and listed:
            record["flagged"] = listed
        for member in record.get("replicas", []):
            reason = verdicts.get(member.get("replica"))
            if reason is not None and excluding:
                member.update(participated=False, weight=0.0, excluded=reason)
        if excluding and "non_finite_replicas" in record:  # left out by a check, not for a NaN
            record["non_finite_replicas"] = [r for r in record["non_finite_replicas"] if r not in verdicts]
            if not record["non_finite_replicas"]:
                del record["non_finite_replicas"]
        lines = []
        present = {m.get("replica") for m in record.get("replicas", [])} or set(verdicts)
        for replica in present | set(self.streaks):
            self.streaks[replica] = self.streaks.get(replica, 0) + 1 if replica in verdicts else 0
            if excluding and self.streaks[replica] == self.faulty_after:
                lines.append(f"[diloco] replica {replica} looks faulty: its contribution was left out of "
                             f"{self.faulty_after} syncs in a row ({verdicts[replica]}). Check its data and "
                             f"settings; it stays in the run at weight 0 and is taken back once its numbers agree "
                             f"with the others' again.")
        if not excluding:
            lines += [f"[diloco] sync {record.get('sync')}: replica {r} would be left out ({reason})"
                      for r, reason in sorted(verdicts.items())]
        return lines
