"""`hf-diloco plan` against what this project measured and what papers published, and the tables a reader wants.

    python benchmarks/plan_checks.py                # every table and plot below, from arithmetic (under a minute)
    sudo python benchmarks/plan_checks.py --transport   # also: this project's collectives alone over a shaped veth

Writes results/plan-measured.*, plan-published.*, plan-tables.*, plan-collective.* (and plan-transport.*):
- measured   every shaped-link row of results/wan*.json, predicted from the same inputs the run had (the tiny model,
             M = 2, the link's rate, no added latency, the baseline's seconds per step, the variant's codec, F, τ and
             end), sync by sync with the run's own Schedule (plan.simulate_run), against the measured utilisation;
             within 3 points or explained.
- published  the DiLoCo paper's setting, INTELLECT-1 and Covenant-72B, inputs from the papers (sources in the table).
- tables     150M, 1B, 7B and 70B models at 100 Mbit/s, 1 Gbit/s and 10 Gbit/s: DDP, DiLoCo fp32, the best codec with
             streaming (utilisation and bytes per day).
- collective the bytes and seconds of each collective as M grows to 1,024, and where a codec stops paying.
- transport  (root) the fp32, int8, int4 and sparse sums of comm.ReplicaComm between two network namespaces over a
             tc-shaped veth, timed alone: the goodput TCP reaches there, against the link's rate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from common import REPO, RESULTS, markdown_table, pyplot, save, spread

from hf_diloco import plan
from hf_diloco.metrics import format_bytes

TOLERANCE = 0.03  # 3 points of utilisation
PEER_RECIPE = REPO / "recipes" / "tiny-pretrain.yaml"
SCALE_RECIPE = REPO / "recipes" / "paper-150m-c4.yaml"  # batch 64 x 1024 tokens a GPU, H = 500: the paper's
BATCH_TOKENS = 8 * 256  # the peer task's tokens per replica per step (benchmarks/common.py: BATCH x BLOCK)


def plan_args(*argv: str):
    """`hf-diloco plan` arguments, parsed by the CLI's own parser."""
    from hf_diloco.cli import build_parser

    return build_parser().parse_args(["plan", *argv])


def setting(*argv: str) -> tuple[plan.Setting, dict]:
    return plan.setting_from_args(plan_args(*argv))


# --- measured ---------------------------------------------------------------------------------------------------------


def flag(overrides: list[str], name: str, default):
    """The value of `--name` in a variant's overrides."""
    for i, item in enumerate(overrides):
        if item.split("=")[0] == f"--{name}":
            return item.partition("=")[2] or overrides[i + 1]
    return default


def measured_rows(results: Path = RESULTS) -> list[dict]:
    """Every row of results/wan*.json over a shaped link, with its runs and their baselines (repeat by repeat)."""
    rows = []
    for path in sorted(results.glob("wan*.json")):
        data = json.loads(path.read_text())
        for row in data["rows"]:
            if row["link_bits_per_second"] is None:
                continue
            key = (row["variant"], row["steps"])
            runs = [r for r in data["runs"] if (r["variant"], r["steps"], r["link"]) == (*key, row["link"])]
            baselines = {r["repeat"]: r for r in data["runs"] if (r["variant"], r["steps"], r["link"]) ==
                         (*key, "baseline")}
            rows.append({"source": path.name, **row, "overrides": runs[0]["overrides"],
                         "baseline_loop_seconds": [baselines[r["repeat"]]["loop_seconds"] for r in runs],
                         "sync_seconds": statistics.median(r["sync_seconds"] for r in runs),
                         "blocking_bytes": runs[0]["blocking_bytes"]})
    return rows


def variant_of(row: dict) -> dict:
    """Codec, F, τ, backend and end of a measured row (a run with overlapped syncs ended staggered when no round
    blocked: the wan records say how many bytes blocked)."""
    overrides = row["overrides"]
    delay = flag(overrides, "sync_delay", "0")
    delay = plan.AUTO if delay == "auto" else int(delay)
    backend = flag(overrides, "outer_backend", "torch")
    return {"codec": flag(overrides, "compression", "none"), "fragments": int(flag(overrides, "num_fragments", 1)),
            "sync_delay": delay, "backend": backend,
            "staggered": delay != 0 and backend == "torch" and row["blocking_bytes"] == 0}


def peer_setting() -> plan.Setting:
    """The peer task's model (tiny Llama) between two hosts, as the WAN benchmark runs it."""
    s, _ = setting(str(PEER_RECIPE), "--replicas", "2", "--link", "1gbit", "--latency-ms", "0",
                   "--tokens-per-second", "1")
    return s


def fragment_values(s: plan.Setting, fragments: int) -> list[int]:
    """Values each fragment syncs (what sync_delay auto scales an unmeasured fragment's τ by)."""
    return [sum(buckets) for buckets in s.shape.fragment_buckets(fragments, s.pattern, s.bucket_numel)]


def predict_run(s: plan.Setting, row: dict, rate: float, loop_seconds: float) -> float:
    """Utilisation of one measured run: its baseline's loop ÷ the loop the planner predicts for the synced run
    (the same steps at the baseline's seconds per step, plus what each sync kept the loop waiting)."""
    v = variant_of(row)
    s = replace(s, link=plan.Link(rate, 0.0), step_seconds=loop_seconds / row["steps"])
    exchanges = plan.fragment_exchanges(s, v["codec"], v["fragments"])
    timeline = plan.simulate_run(row["steps"], row["inner_steps"], s.step_seconds,
                                 lambda due: sum(exchanges[f].seconds for f in due), v["fragments"],
                                 v["sync_delay"], v["staggered"], sizes=fragment_values(s, v["fragments"]))
    return loop_seconds / timeline.loop_seconds


def line_rate_exchange_seconds(s: plan.Setting, row: dict) -> float:
    """Seconds the run's syncs take on the link at its rate, all of them (what the run's sync_seconds measured)."""
    v = variant_of(row)
    s = replace(s, link=plan.Link(row["link_bits_per_second"], 0.0))
    exchanges = plan.fragment_exchanges(s, v["codec"], v["fragments"])
    total = []
    plan.simulate_run(row["steps"], row["inner_steps"], 1.0,
                      lambda due: total.append(sum(exchanges[f].seconds for f in due)) or total[-1],
                      v["fragments"], v["sync_delay"], v["staggered"], sizes=fragment_values(s, v["fragments"]))
    return sum(total)


def judge_measured(s: plan.Setting, row: dict) -> dict:
    """The prediction for a measured row and the verdict: within 3 points of the median; or its steady state
    (the rounds after τ auto's first measurements) within 3 points; or inside the repeats' [min, max]; or within
    3 points once the link runs at the goodput the run's own syncs reached (TCP below the rate); else not
    explained."""
    v = variant_of(row)
    rate = row["link_bits_per_second"]
    predicted = statistics.median(predict_run(s, row, rate, b) for b in row["baseline_loop_seconds"])
    measured = row["utilisation"]
    t = statistics.median(row["baseline_loop_seconds"]) / row["steps"]
    steady = plan.diloco_row(replace(s, link=plan.Link(rate, 0.0), step_seconds=t), v["codec"], row["inner_steps"],
                             v["fragments"], v["sync_delay"]).utilisation
    # The goodput of a blocking run's syncs: their seconds at the rate ÷ the seconds measured. (An overlapped sync's
    # seconds run from its launch to its landing, in a background thread that shares the cores: not the link's.)
    blocking = v["sync_delay"] == 0 and row["sync_seconds"] > 0
    goodput = min(1.0, line_rate_exchange_seconds(s, row) / row["sync_seconds"]) if blocking else None
    at_goodput = statistics.median(predict_run(s, row, rate * goodput, b) for b in row["baseline_loop_seconds"]) \
        if blocking else None
    if abs(predicted - measured["median"]) <= TOLERANCE:
        verdict = "within 3 points"
    elif row.get("steady_state") and abs(steady - row["steady_state"]["median"]) <= TOLERANCE:
        verdict = (f"steady state within 3 points ({steady:.1%} against {row['steady_state']['median']:.1%}); the "
                   f"run-level figure beats the link's bound (baseline noise)")
    elif measured["min"] <= predicted <= measured["max"]:
        verdict = "inside the repeats' [min, max]"
    elif blocking and abs(at_goodput - measured["median"]) <= TOLERANCE:
        verdict = (f"TCP delivered {goodput:.0%} of the rate (the run's syncs took {row['sync_seconds']:.1f} s, "
                   f"{goodput * row['sync_seconds']:.1f} s at the rate); at that goodput {at_goodput:.1%}")
    else:
        verdict = "NOT EXPLAINED"
    return {"source": row["source"], "variant": row["variant"], "link": row["link"], "rate": rate,
            "steps": row["steps"], "inner_steps": row["inner_steps"], **v, "measured": measured,
            "steady_state": row.get("steady_state"), "predicted": predicted, "predicted_steady_state": steady,
            "goodput": goodput, "predicted_at_goodput": at_goodput, "sync_seconds": row["sync_seconds"],
            "error_points": 100 * (predicted - measured["median"]), "verdict": verdict}


def measured_table(checks: list[dict]) -> str:
    lines = [[c["source"].removesuffix(".json"), plan.format_rate(c["rate"]), c["variant"],
              f"{c['steps']} (H = {c['inner_steps']})",
              f"{c['measured']['median']:.1%} [{c['measured']['min']:.1%}, {c['measured']['max']:.1%}]",
              f"{c['predicted']:.1%}", f"{c['error_points']:+.1f}",
              f"{c['steady_state']['median']:.1%} / {c['predicted_steady_state']:.1%}" if c["steady_state"] else "-",
              "-" if c["goodput"] is None else f"{c['goodput']:.0%}", c["verdict"]] for c in checks]
    return markdown_table(["results", "link", "variant", "steps", "measured utilisation", "predicted",
                           "points", "steady state measured / predicted", "goodput of a blocking run's syncs",
                           "verdict"], lines)


def measured_plot(checks: list[dict]):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 5.5))
    ax.fill_between([0, 110], [-3, 107], [3, 113], color="#e5e7eb", label="within 3 points")
    ax.plot([0, 110], [0, 110], color="black", linewidth=0.8)
    for c in checks:
        m, within = c["measured"], c["verdict"] == "within 3 points"
        ax.errorbar(100 * c["predicted"], 100 * m["median"], fmt="o" if within else "s",
                    yerr=[[100 * (m["median"] - m["min"])], [100 * (m["max"] - m["median"])]], capsize=3,
                    color="#16a34a" if within else "#ea580c")
        if not within:
            ax.annotate(f"{c['variant']}, {plan.format_rate(c['rate'])}", (100 * c["predicted"], 100 * m["median"]),
                        textcoords="offset points", xytext=(-6, -4), ha="right", fontsize=6.5)
    ax.plot([], [], "o", color="#16a34a", label="within 3 points of the median")
    ax.plot([], [], "s", color="#ea580c", label="explained (see the table)")
    ax.set_xlim(0, 110)
    ax.set_ylim(0, 110)
    ax.set_xlabel("predicted utilisation, %")
    ax.set_ylabel("measured utilisation, % (median, [min, max] of 3 repeats)")
    ax.set_title("hf-diloco plan against every shaped-link WAN row", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    return fig


# --- published --------------------------------------------------------------------------------------------------------

# Inputs taken from the papers; each figure names its source.
DILOCO = {"replicas": 8, "inner_steps": 500,
          "source": "Douillard et al., DiLoCo, arXiv 2311.08105: M = 8, H = 500, 'communicating 500 times less'"}
INTELLECT = {"replicas": 14, "gpus": 8, "inner_steps": 100, "sequences": 128, "sequence": 8192, "mfu": (0.362, 0.414),
             "utilisation": (0.83, 0.96), "reduction": 400, "sync_minutes": 8.3,
             "source": "Jaghouar et al., INTELLECT-1, arXiv 2412.01152 (abstract: up to 14 nodes, 83-96% compute "
                       "utilisation, 36.2-41.4% MFU, 400x less than data parallel; blog: 112 H100s, 8 a node); "
                       "H = 100, batch 128 x 8192, int8: PrimeIntellect-ai/prime configs/10B/H100_intellect1.toml; "
                       "8.3 min of communication a round: Covenant-72B's authors"}
COVENANT = {"replicas": 20, "gpus": 8, "inner_steps": 30, "sequences": 192, "sequence": 2048, "utilisation": 0.945,
            "communication_seconds": 70, "compression": 146,
            "source": "Lidin et al., Covenant-72B, arXiv 2603.08163, and its authors' announcement: 72B, 20+ peers of "
                      "8 x B200, SparseLoCo over 146x (1.56% of values, 2-bit), 94.5% utilisation, 70 s of "
                      "communication a round; H = 30 and 192 x 2048 a step from a third-party reading of the "
                      "report (l402-train.ai) and tplr-ai/templar hparams (inner_steps 30, 20 peers a window)"}


def rate_for(s: plan.Setting, codec: str, utilisation: float) -> float:
    """The link rate (bit/s) at which a blocking round with `codec` reaches `utilisation` (bisection)."""
    low, high = 1e5, 1e13
    for _ in range(100):
        middle = (low * high) ** 0.5
        if plan.diloco_row(replace(s, link=replace(s.link, bits_per_second=middle)), codec,
                           s.inner_steps).utilisation < utilisation:
            low = middle
        else:
            high = middle
    return high


def published_checks() -> list[dict]:
    """Predicted figures beside the published ones."""
    out = []
    # DiLoCo: bytes per round of DDP over bytes per round of DiLoCo, at M = 8 and H = 500.
    s, _ = setting(str(SCALE_RECIPE), "--replicas", str(DILOCO["replicas"]), "--link", "1gbit", "--gpu", "h100")
    ddp, fp32 = plan.ddp_row(s, DILOCO["inner_steps"]), plan.diloco_row(s, "none", DILOCO["inner_steps"])
    ratio = ddp.bytes_per_replica_per_round / fp32.bytes_per_replica_per_round
    out.append({"setting": "DiLoCo paper (150M, M = 8, H = 500, fp32)", "figure": "communication vs data parallel",
                "published": "500x less", "predicted": f"{ratio:.0f}x less",
                "agrees": "yes", "source": DILOCO["source"]})
    # INTELLECT-1.
    p = INTELLECT
    s, _ = setting(str(SCALE_RECIPE), "--model", "intellect-1-10b", "--replicas", str(p["replicas"]),
                   "--gpus-per-replica", str(p["gpus"]), "--sharded", "--gpu", "h100", "--mfu", str(p["mfu"][0]),
                   "--link", "1gbit", "--inner-steps", str(p["inner_steps"]), "--codec", "int8")
    tokens = p["sequences"] * p["sequence"]
    flops = s.shape.flops_per_token(p["sequence"])
    computes = [p["inner_steps"] * tokens * flops / (p["gpus"] * mfu * plan.GPUS["h100"].peak_flops)
                for mfu in p["mfu"]]
    six_n = [p["inner_steps"] * tokens * 6 * s.shape.parameters / (p["gpus"] * mfu * plan.GPUS["h100"].peak_flops)
             for mfu in p["mfu"]]
    s = replace(s, step_seconds=computes[0] / p["inner_steps"], tokens_per_step=tokens)
    ddp, int8 = plan.ddp_row(s, p["inner_steps"]), plan.diloco_row(s, "int8", p["inner_steps"])
    out.append({"setting": "INTELLECT-1 (10B, 14 x 8 H100, H = 100, int8)", "figure": "communication vs data parallel",
                "published": f"{p['reduction']}x less",
                "predicted": f"{ddp.bytes_per_replica_per_round / int8.bytes_per_replica_per_round:.0f}x less",
                "agrees": "yes", "source": p["source"]})
    out.append({"setting": "INTELLECT-1", "figure": "compute a round (H = 100 steps of 128 x 8192 tokens)",
                "published": "not stated as such (a summary of the report: about 38 min)",
                "predicted": f"{computes[1] / 60:.0f}-{computes[0] / 60:.0f} min at 41.4-36.2% MFU with attention "
                             f"FLOPs; {six_n[1] / 60:.0f}-{six_n[0] / 60:.0f} min counting 6N only",
                "agrees": "yes, if the reported MFU counts 6N", "source": p["source"]})
    sync = p["sync_minutes"] * 60
    predicted = [c / (c + sync) for c in six_n]
    out.append({"setting": "INTELLECT-1", "figure": "utilisation with 8.3 min of communication a round",
                "published": "83% (across continents)",
                "predicted": f"{min(predicted):.1%}-{max(predicted):.1%} (6N compute at 36.2-41.4% MFU)",
                "agrees": "yes" if min(predicted) - TOLERANCE <= 0.83 <= max(predicted) + TOLERANCE else "no",
                "source": p["source"]})
    s = replace(s, step_seconds=six_n[0] / p["inner_steps"])
    floor = plan.diloco_row(replace(s, link=plan.Link(1e15, s.link.latency_seconds)), "int8", p["inner_steps"])
    s = replace(s, link=plan.Link(1e9, 0.0))
    rates = [rate_for(s, "int8", u) for u in p["utilisation"]]
    out.append({"setting": "INTELLECT-1", "figure": "per-node link the reported utilisation implies (int8 "
                                                    "reduce-scatter + all-gather, 6N compute at 36.2% MFU)",
                "published": "83-96%; link rates not reported",
                "predicted": f"83% at {plan.format_rate(rates[0])}, 96% at {plan.format_rate(rates[1])} "
                             f"({format_bytes(int8.bytes_per_replica_per_round)} a node a round, no latency); with "
                             f"25 ms a hop and this project's 256 MB buckets one after the other, the hops alone "
                             f"take {floor.wire_seconds:.0f} s a round and cap it at {floor.utilisation:.1%}",
                "agrees": "-", "source": p["source"]})
    # Covenant-72B.
    p = COVENANT
    s, _ = setting(str(SCALE_RECIPE), "--model", "covenant-72b", "--replicas", str(p["replicas"]),
                   "--gpus-per-replica", str(p["gpus"]), "--sharded", "--gpu", "b200", "--link", "1gbit",
                   "--inner-steps", str(p["inner_steps"]), "--codec", "sparse")
    tokens = p["sequences"] * p["sequence"]
    compute = p["inner_steps"] * tokens * s.shape.flops_per_token(p["sequence"]) / (
        p["gpus"] * plan.DEFAULT_MFU * plan.GPUS["b200"].peak_flops)
    s = replace(s, step_seconds=compute / p["inner_steps"], tokens_per_step=tokens)
    sparse = plan.diloco_row(s, "sparse", p["inner_steps"])
    values = s.shape.synced_values
    ours = 4 * values / (s.codecs.make("sparse").encoded_bytes(values))
    kept_bits = s.codecs.sparse_k * (12 + s.codecs.sparse_bits)
    theirs = 32 * s.codecs.sparse_chunk / kept_bits
    out.append({"setting": "Covenant-72B (72B, 20 peers of 8 B200, H = 30, SparseLoCo)",
                "figure": "compression of a pseudo-gradient vs fp32", "published": f"over {p['compression']}x",
                "predicted": f"{ours:.1f}x with this project's sparse codec (64 of 4,096 values, 2 bits, 12-bit "
                             f"positions, plus 2 fp32 bounds a chunk); {theirs:.1f}x without the bounds",
                "agrees": "yes: the bounds are the difference", "source": p["source"]})
    implied = p["communication_seconds"] * p["utilisation"] / (1 - p["utilisation"])
    out.append({"setting": "Covenant-72B", "figure": "utilisation with 70 s of communication a round",
                "published": f"{p['utilisation']:.1%} (compute implied: {implied / 60:.0f} min a round)",
                "predicted": f"{compute / (compute + p['communication_seconds']):.1%} (compute {compute / 60:.1f} "
                             f"min at {plan.DEFAULT_MFU:.0%} MFU on 8 B200)",
                "agrees": "within 3 points" if abs(compute / (compute + 70) - 0.945) <= TOLERANCE else
                          f"{100 * (compute / (compute + 70) - 0.945):+.1f} points: the reported figures imply "
                          f"{implied / 60:.0f} min of compute a round, {plan.DEFAULT_MFU * compute / implied:.1%} MFU "
                          f"by the planner's FLOPs, not 40%", "source": p["source"]})
    needed = sparse.bytes_per_replica_per_round * 8 * plan.FRAMING / p["communication_seconds"]
    out.append({"setting": "Covenant-72B", "figure": "download a peer needs to gather 19 others' payloads in 70 s",
                "published": "link rates not reported ('commodity internet')",
                "predicted": f"{format_bytes(sparse.bytes_per_replica_per_round)} a round: "
                             f"{plan.format_rate(needed)} per peer", "agrees": "-", "source": p["source"]})
    return out


# --- tables and the collective at scale -------------------------------------------------------------------------------

SCALE_MODELS = (("150M", "llama-150m"), ("1B", "llama-3.2-1b"), ("7B", "llama-2-7b"), ("70B", "llama-3.1-70b"))
SCALE_LINKS = ("100mbit", "1gbit", "10gbit")
SITE = ("--replicas", "8", "--gpus-per-replica", "8", "--sharded", "--gpu", "h100", "--latency-ms", "25")


def best_streamed(rows: list[plan.Row], target: float) -> plan.Row:
    """Of the streamed rows, the fewest bytes that meet the target, else the best utilisation."""
    streamed = [r for r in rows if r.method == "diloco" and r.streaming]
    meeting = [r for r in streamed if r.utilisation >= target]
    if meeting:
        return min(meeting, key=lambda r: (r.bytes_per_replica_per_round, r.fragments))
    return max(streamed, key=lambda r: r.utilisation)


def scale_tables() -> list[dict]:
    out = []
    for label, model in SCALE_MODELS:
        base, _ = setting(str(SCALE_RECIPE), "--model", model, "--link", "1gbit", *SITE)
        for link in SCALE_LINKS:
            s = replace(base, link=replace(base.link, bits_per_second=plan.parse_rate(link)))
            rows = plan.plan_rows(s)
            ddp = rows[0]
            fp32 = next(r for r in rows if r.codec == "none" and not r.streaming and r.method == "diloco")
            best = best_streamed(rows, s.target)
            out.append({"model": label, "preset": model, "parameters": s.shape.parameters, "link": link,
                        "round_compute_seconds": s.inner_steps * s.step_seconds,
                        **{f"{name}_{k}": getattr(row, k) for name, row in (("ddp", ddp), ("fp32", fp32),
                                                                           ("best", best))
                           for k in ("utilisation", "bytes_per_replica_per_day", "bytes_per_replica_per_round")},
                        "best": best.label()})
    return out


def scale_table_text(rows: list[dict]) -> str:
    lines = [[r["model"], plan.format_rate(plan.parse_rate(r["link"])), f"{r['round_compute_seconds'] / 60:.1f} min",
              f"{r['ddp_utilisation']:.1%}", format_bytes(r["ddp_bytes_per_replica_per_day"]),
              f"{r['fp32_utilisation']:.1%}", format_bytes(r["fp32_bytes_per_replica_per_day"]),
              r["best"].removeprefix("diloco "), f"{r['best_utilisation']:.1%}",
              format_bytes(r["best_bytes_per_replica_per_day"])] for r in rows]
    return markdown_table(["model", "link between sites", "compute a round (H = 500)", "DDP", "DDP per day",
                           "DiLoCo fp32", "fp32 per day", "best codec, streamed", "its utilisation",
                           "its bytes per day"], lines)


def scale_plot(rows: list[dict]):
    plt = pyplot()
    fig, axes = plt.subplots(1, len(SCALE_LINKS), figsize=(11, 3.6), sharey=True)
    methods = (("ddp", "DDP", "#dc2626"), ("fp32", "DiLoCo fp32", "#2563eb"), ("best", "best codec, streamed",
                                                                                 "#16a34a"))
    for ax, link in zip(axes, SCALE_LINKS, strict=True):
        chosen = [r for r in rows if r["link"] == link]
        for i, (key, name, color) in enumerate(methods):
            ax.bar([j + 0.27 * (i - 1) for j in range(len(chosen))], [100 * r[f"{key}_utilisation"] for r in chosen],
                   0.27, color=color, label=name)
        ax.set_xticks(range(len(chosen)), [r["model"] for r in chosen])
        ax.set_title(f"{plan.format_rate(plan.parse_rate(link))} between sites")
        ax.axhline(95, color="black", linewidth=0.8, linestyle=":")
    axes[0].set_ylabel("predicted utilisation, %")
    axes[0].legend(fontsize=8, loc="lower left")
    fig.suptitle("8 sites of 8 H100s (40% MFU), H = 500, 25 ms a hop: hf-diloco plan", fontsize=10)
    return fig


COLLECTIVE_MODEL = "llama-2-7b"


def collective_rows() -> tuple[list[dict], dict]:
    s, _ = setting(str(SCALE_RECIPE), "--model", COLLECTIVE_MODEL, "--link", "1gbit", *SITE)
    rows = plan.scale_rows(s)

    def first(condition) -> int | None:
        return next((m for m in plan.SCALE_REPLICAS if condition(m)), None)

    def at(m: int, name: str) -> dict:
        return next(r for r in rows if r["replicas"] == m and r["collective"] == name)

    int4, sparse = "int4 reduce-scatter + all-gather", "sparse all-gather"
    ring, tree = "fp32 ring all-reduce", "fp32 tree all-reduce"
    findings = {
        "sparse sends more than int4 from M": first(lambda m: at(m, sparse)["bytes_per_replica"] >
                                                    at(m, int4)["bytes_per_replica"]),
        "fp32 tree all-reduce is faster than int4 reduce-scatter + all-gather from M":
            first(lambda m: at(m, tree)["seconds"] < at(m, int4)["seconds"]),
        "int4's latency exceeds its transfer from M": first(
            lambda m: at(m, int4)["hops"] * s.link.latency_seconds > at(m, int4)["seconds"] / 2),
        "fp32 ring below 95% utilisation from M": first(lambda m: at(m, ring)["utilisation"] < 0.95),
    }
    return rows, {"model": COLLECTIVE_MODEL, "parameters": s.shape.parameters,
                  "round_compute_seconds": s.inner_steps * s.step_seconds, "findings": findings,
                  "buckets": len(s.shape.fragment_buckets(1, s.pattern, s.bucket_numel)[0])}


def collective_text(rows: list[dict]) -> str:
    names = [name for name, _, _ in plan.SCALE_COLLECTIVES]
    lines = []
    for m in plan.SCALE_REPLICAS:
        at = {r["collective"]: r for r in rows if r["replicas"] == m}
        lines.append([m, *(f"{format_bytes(at[n]['bytes_per_replica'])}, {at[n]['seconds']:,.0f} s, "
                           f"{at[n]['utilisation']:.0%}" for n in names)])
    return markdown_table(["M", *names], lines)


def collective_plot(rows: list[dict]):
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (name, _, _) in enumerate(plan.SCALE_COLLECTIVES):
        mine = [r for r in rows if r["collective"] == name]
        left.plot([r["replicas"] for r in mine], [r["bytes_per_replica"] / 1e9 for r in mine], marker="o",
                  color=f"C{i}", label=name)
        right.plot([r["replicas"] for r in mine], [r["seconds"] for r in mine], marker="o", color=f"C{i}", label=name)
    for ax, label in ((left, "GB a replica sends a round"), (right, "seconds a round (blocking)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("replicas M (sites)")
        ax.set_ylabel(label)
    left.legend(fontsize=7)
    fig.suptitle(f"{COLLECTIVE_MODEL}, 1 Gbit/s and 25 ms a hop between sites, buckets of 256 MB", fontsize=10)
    return fig


# --- transport (root) -------------------------------------------------------------------------------------------------

TRANSPORT_LINKS = {"10mbit": 10e6, "1mbit": 1e6}
TRANSPORT_CODECS = ("none", "int8", "int4", "sparse")


def transport_worker(rank: int, address: str, port: int, numel: int, repeats: int, idle: float) -> None:
    """One host's side of the transport check: each codec's sum of `numel` values through comm.ReplicaComm, after
    `idle` seconds of silence (as between a run's syncs), timed alone."""
    import torch
    import torch.distributed as dist

    from hf_diloco.codecs import ErrorFeedback, make_codec
    from hf_diloco.comm import ReplicaComm

    dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=rank, world_size=2)
    comm, out = ReplicaComm(), []
    for codec in TRANSPORT_CODECS:
        feedback = ErrorFeedback(1.0) if codec in ("int4", "sparse") else None
        for _ in range(repeats):
            delta = torch.randn(numel)
            dist.barrier()
            time.sleep(idle)
            began = time.perf_counter()
            _, _, cost = comm.sum_replicas(delta, codec=make_codec(codec), feedback=feedback, key="b")
            out.append({"codec": codec, "seconds": time.perf_counter() - began, "bytes": cost.bytes_sent})
    if rank == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


def transport(repeats: int, idle: float) -> list[dict]:
    from netns import shape, two_hosts

    numel = peer_setting().shape.synced_values
    rows = []
    with two_hosts(subnet="10.79.0") as hosts:
        for link, rate in TRANSPORT_LINKS.items():
            shape(hosts, rate)
            port = str(29700 + len(rows))
            procs = [subprocess.Popen([*h.exec_prefix(), "OMP_NUM_THREADS=1", sys.executable, __file__,
                                       "--transport-worker", str(rank), hosts[0].address, port, str(numel),
                                       str(repeats), str(idle)], stdout=subprocess.PIPE, text=True)
                     for rank, h in enumerate(hosts)]
            results = json.loads(procs[0].communicate()[0].strip().splitlines()[-1])
            procs[1].wait()
            for codec in TRANSPORT_CODECS:
                times = [r["seconds"] for r in results if r["codec"] == codec]
                sent = next(r["bytes"] for r in results if r["codec"] == codec)
                line = sent * 8 * plan.FRAMING / rate
                rows.append({"link": link, "rate": rate, "codec": codec, "bytes": sent, "line_rate_seconds": line,
                             "seconds": spread(times), "goodput": spread([min(1.0, line / t) for t in times])})
        shape(hosts, None)
    return rows


def transport_text(rows: list[dict]) -> str:
    return markdown_table(["link", "codec", "bytes a host sends", "at the link's rate, s", "measured, s",
                           "goodput (of the rate)"],
                          [[plan.format_rate(r["rate"]), r["codec"], f"{r['bytes']:,}", f"{r['line_rate_seconds']:.2f}",
                            f"{r['seconds']['median']:.2f} [{r['seconds']['min']:.2f}, {r['seconds']['max']:.2f}]",
                            f"{r['goodput']['median']:.0%} [{r['goodput']['min']:.0%}, {r['goodput']['max']:.0%}]"]
                           for r in rows])


# --- main -------------------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transport", action="store_true", help="also time the collectives alone (root, minutes)")
    parser.add_argument("--repeats", type=int, default=3, help="repeats of each transport timing (default 3)")
    parser.add_argument("--idle", type=float, default=5.0, help="seconds of silence before each timing (default 5)")
    parser.add_argument("--transport-worker", nargs=6, metavar=("RANK", "ADDRESS", "PORT", "NUMEL", "REPEATS", "IDLE"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.transport_worker:
        rank, address, port, numel, repeats, idle = args.transport_worker
        transport_worker(int(rank), address, int(port), int(numel), int(repeats), float(idle))
        return
    started = time.time()
    peer = peer_setting()
    checks = [judge_measured(peer, row) for row in measured_rows()]
    text = measured_table(checks)
    unexplained = sum(c["verdict"] == "NOT EXPLAINED" for c in checks)
    text += (f"\n\n{len(checks)} rows; {sum(c['verdict'] == 'within 3 points' for c in checks)} within 3 points of "
             f"the measured median, {len(checks) - unexplained} within 3 points or explained, {unexplained} not "
             "explained. Predicted: the planner, given the run's inputs (the tiny model, M = 2, the link's rate, "
             "no added latency, the baseline's seconds per step of the same repeat, the variant's codec, F, τ and "
             "end), sync by sync with the run's own Schedule; the median over the repeats. Goodput: the seconds "
             "the run's syncs would take at the link's rate ÷ the seconds its summary measured (sync_seconds).")
    save("plan-measured", text, {"tolerance": TOLERANCE, "checks": checks}, measured_plot(checks),
         seconds=time.time() - started)
    published = published_checks()
    save("plan-published", markdown_table(["setting", "figure", "published", "predicted", "agrees", "source"],
                                          [[p[k] for k in ("setting", "figure", "published", "predicted", "agrees",
                                                           "source")] for p in published]),
         {"checks": published, "inputs": {"diloco": DILOCO, "intellect_1": INTELLECT, "covenant_72b": COVENANT}})
    tables = scale_tables()
    save("plan-tables", scale_table_text(tables) + "\n\nEvery site: 8 H100s at 40% MFU sharding one replica "
         "(FSDP2), 64 x 1024 tokens a GPU a step (recipes/paper-150m-c4.yaml), H = 500, M = 8 sites, 25 ms one way "
         "a hop, 256 MB buckets. Best codec, streamed: of every codec streamed with τ auto below 5, the fewest bytes "
         "that reach 95%, else the best utilisation.", {"rows": tables}, scale_plot(tables))
    collective, about = collective_rows()
    findings = "; ".join(f"{k} {v}" for k, v in about["findings"].items())
    save("plan-collective", collective_text(collective) + f"\n\n{about['model']} ({about['parameters']:,} "
         f"parameters, {about['buckets']} buckets of 256 MB), 8 H100s a site, 1 Gbit/s and 25 ms a hop; each cell: "
         f"bytes a site sends a round, seconds of the blocking sync, utilisation of a round of H = 500 "
         f"({about['round_compute_seconds'] / 60:.0f} min of compute). Where a codec stops paying: {findings}.",
         {"rows": collective, **about}, collective_plot(collective))
    if args.transport:
        rows = transport(args.repeats, args.idle)
        save("plan-transport", transport_text(rows) + f"\n\nOne replica per network namespace, a tc tbf link (burst "
             f"32 kB, latency 400 ms) as in benchmarks/wan.py, gloo over TCP (this machine's congestion control); "
             f"each sum after {args.idle:g} s of silence, {args.repeats} repeats; goodput: the seconds at the link's "
             f"rate (bytes sent x 8 x framing ÷ rate) ÷ the seconds measured.", {"rows": rows})
    print(f"plan checks: {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
