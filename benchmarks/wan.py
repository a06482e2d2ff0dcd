"""DiLoCo between two hosts over a shaped link: compute utilisation against a same-conditions baseline, and the
physical bound of every run.

Method:
- Two network namespaces joined by one veth pair stand in for two machines (one replica each, one CPU thread
  each, `accelerate launch` per host). `tc tbf` limits both directions; netem is not available here, so no added
  latency. The namespaces live for the whole invocation; only the qdisc changes between runs.
- Baseline: the same trainer, launcher, namespaces, settings and process count with syncs turned off
  (`inner_steps` above `max_steps`), on the unshaped link. What remains of DiLoCo in it: the initial broadcast and
  the one sync every run makes at its last step, both over the unshaped veth.
- Runs are interleaved and repeated: each repeat runs, per variant, its baseline then every link in turn. The
  utilisation of a synced run is its tokens/s ÷ the tokens/s of the baseline of the same repeat; the table gives
  the median and [min, max] over the repeats. Tokens/s: tokens ÷ Trainer's loop wall time, for every row.
- Physical bound: the link carries at most `rate` bits per second, so a host that sent B bytes during the loop
  spent at least (B − tbf burst) · 8 / rate seconds on the wire. Bytes are the veth's own transmit counter, read
  when the main replica announces its training loop and after both exit. A blocking sync waits for those bytes,
  so loop ≥ compute + wire and utilisation ≤ compute ÷ (compute + wire), with compute = the repeat's baseline loop
  time; a variant that overlaps its sync with compute (`--sync_delay` > 0) is bounded by compute ÷ max(compute,
  wire). A run whose utilisation beats its bound by more than the noise (the baseline's relative spread over
  the repeats, at least 1%) is marked INVALID: a number that beats physics is a bug. A row whose baseline spreads
  by more than 10% (other work on the cores) is marked unreliable: its bound check has little power then.

    python benchmarks/wan.py [--quick] [--repeats N] [--variants fp32 ...] [--variant 'name=--field v ...']
    # needs root (ip netns, tc)
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from common import (
    BATCH,
    BLOCK,
    Processes,
    RunFailed,
    add_variant_arguments,
    free_port,
    loop_seconds,
    loop_tokens_per_second,
    markdown_table,
    overlaps_compute,
    pyplot,
    read_run,
    save,
    selected_variants,
    show,
    skip,
    spread,
    spread_errors,
    train_command,
)
from netns import BURST_BYTES, NamespaceError, shape, two_hosts

# bits/s; 100 kbit/s (a home uplink) only when asked for with --links: blocking fp32 would take 6 minutes a sync.
LINKS: dict[str, float | None] = {"unlimited": None, "100mbit": 100e6, "10mbit": 10e6, "1mbit": 1e6,
                                  "100kbit": 100e3}
LABELS = {"unlimited": "unlimited", "100mbit": "100 Mbit/s", "10mbit": "10 Mbit/s", "1mbit": "1 Mbit/s",
          "100kbit": "100 kbit/s"}
DEFAULT_LINKS = ("unlimited", "100mbit", "10mbit", "1mbit")
LOOP_STARTS = "***** Running training *****"  # Trainer logs this on the main process just before its loop clock
NOISE_FLOOR = 0.01
NOISE_TRUSTED = 0.10  # a baseline spreading more than this (other work on the cores) makes a row unreliable


@dataclass(frozen=True)
class Group:
    """Links measured with the same steps and H, so they share one baseline per repeat and variant."""

    links: tuple[str, ...]
    steps: int
    inner_steps: int


# Full: 100 steps with H = 50 (2 syncs, about 9 MB per host in fp32; the replicas build the model from one seed, so
# the start-up check sends 128 bytes, not the model) at every link but 1 Mbit/s; at 1 Mbit/s each fp32 transfer
# takes 35 s, so there it is 50 steps (1 sync).
FULL = [Group(("unlimited", "100mbit", "10mbit"), steps=100, inner_steps=50),
        Group(("1mbit",), steps=50, inner_steps=50)]
QUICK = Group(("10mbit",), steps=20, inner_steps=10)

TRAIN = ["--eval_strategy", "no", "--eval_on_start", "false", "--save_strategy", "no", "--save_every_rounds", "0",
         "--log_level", "info"]


@dataclass
class Measured:
    loop_seconds: float
    tokens_per_second: float
    veth_tx_bytes: list[int]  # per host, during the training loop
    veth_tx_bytes_process: list[int]  # per host, from launch to exit
    sync_seconds: float
    blocking_bytes: int  # bytes of the rounds that held the inner loop (all, unless overlapped; then the last)
    blocked_seconds: list[float]  # per round, how long it kept the inner loop waiting (the last round last)
    compute_seconds: list[float]  # per round, the slowest replica's inner-step seconds since the round before
    sync_delays: dict[str, int]  # the τ each fragment ended with under sync_delay auto (empty otherwise)


def two_host_run(hosts, out: Path, overrides: list[str]) -> Measured:
    """One replica per host through the CLI; bytes each host sent during the loop and in all."""
    port = str(free_port())
    launched = [h.tx_bytes() for h in hosts]
    at_loop: list[int] = []
    seen = threading.Event()

    def watch(line: str) -> None:
        if LOOP_STARTS in line and not seen.is_set():
            at_loop.extend(h.tx_bytes() for h in hosts)
            seen.set()

    commands = []
    torchft = any(a == "--outer_backend" and b == "torchft" for a, b in zip(overrides, overrides[1:], strict=False))
    lighthouse = None
    if torchft:  # a Lighthouse on the first host, bound to its veth address; one replica launch per host
        lighthouse = Processes([[*hosts[0].exec_prefix(), sys.executable, "-m", "hf_diloco.cli", "lighthouse",
                                 "--host", hosts[0].address, "--port", port, "--min-replicas", "2",
                                 "--grace-seconds", "5"]])
    try:
        for rank, host in enumerate(hosts):
            if torchft:
                replica = ["--replica_id", str(rank), "--num_replicas", "2", "--min_replicas", "2",
                           "--lighthouse", f"http://{hosts[0].address}:{port}", "--replica_address", host.address]
                commands.append(train_command(1, ["--output_dir", str(out / f"node{rank}"), *overrides, *replica],
                                              prefix=host.exec_prefix()))
                continue
            launch = ["--multi_gpu", "--num_machines", "2", "--num_processes", "2", "--machine_rank", str(rank),
                      "--main_process_ip", hosts[0].address, "--main_process_port", port]
            commands.append(train_command(2, ["--output_dir", str(out / f"node{rank}"), *overrides],
                                          prefix=host.exec_prefix(), launch=launch))
        Processes(commands, on_line=watch).wait()
    finally:
        if lighthouse is not None:
            lighthouse.stop()
    ended = [h.tx_bytes() for h in hosts]
    if not seen.is_set():
        raise RunFailed(f"the main replica never logged {LOOP_STARTS!r}; cannot tell the loop's bytes")
    result = read_run(out / "node0")
    return Measured(
        loop_seconds=loop_seconds(result),
        tokens_per_second=loop_tokens_per_second(result, 2),
        veth_tx_bytes=[e - s for e, s in zip(ended, at_loop, strict=True)],
        veth_tx_bytes_process=[e - s for e, s in zip(ended, launched, strict=True)],
        sync_seconds=result.get("summary", {}).get("sync_seconds", 0.0),
        # An overlapped round's record names the step it was launched at; the others (every round of a blocking
        # variant, the final all-fragment round of a streaming one) kept the inner loop waiting for their bytes.
        blocking_bytes=sum(r["bytes_per_replica"] for r in result.get("rounds", []) if "launch_step" not in r),
        blocked_seconds=[round(r["blocked_seconds"], 4) for r in result.get("rounds", [])],
        compute_seconds=[round(r["compute_seconds"], 4) for r in result.get("rounds", [])],
        sync_delays={str(f): r["sync_delay_auto"]["chosen"] for r in result.get("rounds", [])
                     if "sync_delay_auto" in r for f in r["sync_delay_auto"]["fragments"]},
    )


def best_utilisation(compute_seconds: float, sent: list[int], rate: float | None, overlapped: bool,
                     blocking_bytes: int = 0) -> tuple:
    """(minimum wire seconds, best utilisation the link allows) for a run that sent `sent` bytes per host.

    Blocking: compute and wire time add up. Overlapped: the wire time of the overlapped rounds can hide behind
    compute, but the rounds that block (the final one with every fragment, unless the end is staggered) add theirs.
    """
    if rate is None:
        return 0.0, 1.0
    wire = max(0, max(sent) - BURST_BYTES) * 8 / rate
    if overlapped:
        blocking = min(wire, blocking_bytes * 8 / rate)
        floor = max(compute_seconds, wire - blocking) + blocking
    else:
        floor = compute_seconds + wire
    return wire, compute_seconds / floor


def fragments_of(overrides: list[str]) -> int:
    for i, flag in enumerate(overrides):
        if flag.split("=")[0] == "--num_fragments":
            return int(flag.partition("=")[2] or overrides[i + 1])
    return 1


def steady_state(run: dict) -> float | None:
    """The share of the loop a run's replicas computed rather than waited, over its rounds after the first 2F
    (while τ auto measures each fragment's exchange) and before the last: Σ compute ÷ Σ (compute + blocked), from
    the round records. None where fewer than two rounds remain."""
    start = 2 * fragments_of(run["overrides"])
    compute, blocked = run.get("compute_seconds", [])[start:-1], run.get("blocked_seconds", [])[start:-1]
    if len(compute) < 2 or sum(compute) <= 0:
        return None
    return sum(compute) / (sum(compute) + sum(blocked))


def measure(groups: list[Group], variants: dict[str, list[str]], repeats: int, tmp: Path) -> list[dict]:
    """All runs, interleaved: for each repeat, group and variant, the baseline and then every link."""
    runs: list[dict] = []
    with two_hosts() as hosts:
        for repeat in range(repeats):
            for group in groups:
                for v, (name, extra) in enumerate(variants.items()):
                    common = [*TRAIN, *extra, "--max_steps", str(group.steps), "--logging_steps", str(group.steps)]
                    plan = [("baseline", None, ["--inner_steps", str(10 * group.steps)])]
                    plan += [(link, LINKS[link], ["--inner_steps", str(group.inner_steps)]) for link in group.links]
                    for k, (link, rate, sync) in enumerate(plan):
                        label = f"repeat {repeat + 1}/{repeats}, {name}, {group.steps} steps: {link}"
                        print(f"{label} ...", flush=True)
                        shape(hosts, rate)
                        load = os.getloadavg()[0]  # other work on the cores shows up in the spread; kept per run
                        out = tmp / f"r{repeat}-v{v}-s{group.steps}-l{k}"
                        measured = two_host_run(hosts, out, [*common, *sync])
                        runs.append({"repeat": repeat, "variant": name, "overrides": extra, "link": link,
                                     "link_bits_per_second": rate, "steps": group.steps,
                                     "inner_steps": None if link == "baseline" else group.inner_steps,
                                     "tokens": group.steps * BATCH * BLOCK * 2, "load_average_at_start": load,
                                     **measured.__dict__})
                        print(f"  {measured.tokens_per_second:,.0f} tokens/s, loop {measured.loop_seconds:.1f} s, "
                              f"veth {[round(b / 1e6, 2) for b in measured.veth_tx_bytes]} MB", flush=True)
        shape(hosts, None)
    return runs


def judge(runs: list[dict], repeats: int) -> list[dict]:
    """Per (variant, steps, link): utilisation against the same repeat's baseline, bounds, validity."""
    rows = []
    keys = list(dict.fromkeys((r["variant"], r["steps"], r["link"]) for r in runs if r["link"] != "baseline"))
    for variant, steps, link in keys:
        baselines = {r["repeat"]: r for r in runs if (r["variant"], r["steps"], r["link"]) == (variant, steps,
                                                                                                "baseline")}
        base_tps = spread([b["tokens_per_second"] for b in baselines.values()])
        noise = max(NOISE_FLOOR, (base_tps["max"] - base_tps["min"]) / base_tps["median"])
        synced = [r for r in runs if (r["variant"], r["steps"], r["link"]) == (variant, steps, link)]
        for run in synced:
            base = baselines[run["repeat"]]
            run["utilisation"] = run["tokens_per_second"] / base["tokens_per_second"]
            run["wire_seconds_min"], run["best_utilisation"] = best_utilisation(
                base["loop_seconds"], run["veth_tx_bytes"], run["link_bits_per_second"],
                overlaps_compute(run["overrides"]), run.get("blocking_bytes", 0))
            run["valid"] = run["utilisation"] <= run["best_utilisation"] * (1 + noise)
        rows.append({
            "variant": variant, "link": link, "link_bits_per_second": synced[0]["link_bits_per_second"],
            "steps": steps, "inner_steps": synced[0]["inner_steps"], "repeats": len(synced),
            "tokens_per_second": spread([r["tokens_per_second"] for r in synced]),
            "baseline_tokens_per_second": base_tps,
            "utilisation": spread([r["utilisation"] for r in synced]),
            "steady_state": spread(steady) if (steady := [x for r in synced
                                                           if (x := steady_state(r)) is not None]) else None,
            "best_utilisation": spread([r["best_utilisation"] for r in synced]),
            "wire_seconds_min": spread([r["wire_seconds_min"] for r in synced]),
            "loop_seconds": spread([r["loop_seconds"] for r in synced]),
            "veth_tx_bytes": [r["veth_tx_bytes"] for r in synced],
            "noise": noise, "valid": all(r["valid"] for r in synced), "run_valid": [r["valid"] for r in synced],
        })
    assert all(len(r["utilisation"]["values"]) == repeats for r in rows), "every row needs every repeat"
    return rows


def table(rows: list[dict]) -> str:
    lines = []
    for row in rows:
        sent = max(max(per_host) for per_host in row["veth_tx_bytes"]) / 1e6
        beaten = sum(not r for r in row["run_valid"])
        verdict = (f"INVALID: {beaten} of {row['repeats']} runs beat the bound" if beaten else
                   f"unreliable: baseline spread {row['noise']:.0%}" if row["noise"] > NOISE_TRUSTED else "ok")
        lines.append([LABELS[row["link"]], row["variant"], f"{row['steps']} (H = {row['inner_steps']})",
                      show(row["tokens_per_second"]), show(row["baseline_tokens_per_second"]),
                      show(row["utilisation"], "{:.1%}"),
                      show(row["steady_state"], "{:.1%}") if row.get("steady_state") else "-",
                      f"{row['best_utilisation']['median']:.1%}",
                      f"{row['wire_seconds_min']['median']:.1f}", f"{sent:.1f}", verdict])
    return markdown_table(["link", "variant", "steps", "tokens/s", "baseline tokens/s (no sync)",
                           "utilisation", "steady state (rounds after the first 2F)", "best the link allows",
                           "wire s ≥", "MB on veth (max host, loop)",
                           "check"], lines)


def plot(rows: list[dict]):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    links = list(dict.fromkeys(r["link"] for r in rows))
    width = 0.8 / len(variants)
    for i, variant in enumerate(variants):
        for j, link in enumerate(links):
            row = next((r for r in rows if r["variant"] == variant and r["link"] == link), None)
            if row is None:
                continue
            x, u = j + i * width, row["utilisation"]
            ax.bar(x, u["median"] * 100, width, color=f"C{i}", label=variant if j == 0 else None,
                   yerr=spread_errors([u], scale=100), capsize=3)
            ax.plot([x - width / 2, x + width / 2], [row["best_utilisation"]["median"] * 100] * 2, color="black",
                    linewidth=2, label="best the link allows" if i == j == 0 else None)
    ax.set_xticks([j + width * (len(variants) - 1) / 2 for j in range(len(links))], [LABELS[k] for k in links])
    ax.set_ylabel("compute utilisation, % (median, [min, max])")
    ax.set_ylim(0, max(110, 5 + 100 * max(r["utilisation"]["max"] for r in rows)))
    ax.legend(fontsize=8)
    ax.set_title("DiLoCo between two hosts: tokens/s ÷ the same runs with syncs off")
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one link, 20 steps (under 3 minutes)")
    parser.add_argument("--repeats", type=int, default=3, help="repeats of every run, interleaved (at least 3)")
    parser.add_argument("--links", nargs="+", choices=list(LINKS),
                        help="measure these links only (with --quick: at the quick steps, default 10mbit)")
    parser.add_argument("--steps", type=int, metavar="N",
                        help="every link at N steps (default: 100, and 50 at 1 Mbit/s); longer runs weigh the "
                             "start-up and the last round as a long run does")
    parser.add_argument("--inner-steps", type=int, default=50, metavar="H", help="H with --steps (default 50)")
    add_variant_arguments(parser, default=["fp32"])
    parser.add_argument("--results", default="wan", metavar="NAME",
                        help="write results/NAME.md, .json and .png (default wan; e.g. wan-torchft for a variant run)")
    args = parser.parse_args()
    if args.repeats < 3:
        sys.exit("--repeats must be at least 3: a median and a spread need three runs.")
    started = time.time()
    variants = selected_variants(args)
    if args.quick:  # the quick group's steps and H at the links asked for (default: 10 Mbit/s only)
        groups = [Group(tuple(args.links or QUICK.links), QUICK.steps, QUICK.inner_steps)]
    elif args.steps:
        groups = [Group(tuple(args.links or DEFAULT_LINKS), args.steps, args.inner_steps)]
    else:
        groups = [Group(tuple(k for k in g.links if k in (args.links or DEFAULT_LINKS)), g.steps, g.inner_steps)
                  for g in FULL]
        if "100kbit" in (args.links or ()):
            groups.append(Group(("100kbit",), steps=50, inner_steps=50))
        groups = [g for g in groups if g.links]
    # A SIGTERM must still run the namespaces' cleanup (two_hosts' finally), so it becomes SystemExit.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("wan benchmark: terminated; namespaces removed."))
    with tempfile.TemporaryDirectory() as tmp:
        try:
            runs = measure(groups, variants, args.repeats, Path(tmp))
        except NamespaceError as error:
            skip("wan", f"it needs network namespaces and tc (run as root with iproute2): {error}.")
        except RunFailed as error:
            sys.exit(str(error))
    rows = judge(runs, args.repeats)
    text = table(rows)
    loads = [r["load_average_at_start"] for r in runs]
    text += (f"\n\nLoad average (1 min) before each run: {min(loads):.2f} to {max(loads):.2f} on "
             f"{os.cpu_count()} cores.")
    text += ("\n\nUtilisation: median [min, max] over the repeats, each run divided by the baseline of its own "
             "repeat (same namespaces, syncs off, unshaped). Best the link allows: baseline loop time ÷ (baseline "
             "loop time + bytes on the veth · 8 ÷ rate) for blocking syncs; for overlapped ones (sync_delay > 0) "
             "baseline loop time ÷ (max(baseline loop time, wire time of the overlapped rounds) + wire time of the "
             "rounds that block: the final all-fragment round of a blocking end, none with a staggered one). Steady "
             "state: from the main replica's round records, the rounds after the first 2F (while τ auto measures "
             "each fragment) and before the last, Σ compute ÷ Σ (compute + seconds a round kept the loop waiting): "
             "what a long run's rounds get, without start-up.")
    save(args.results, text, {"method": __doc__.split("\n\n")[1], "groups": [g.__dict__ for g in groups],
                       "repeats": args.repeats, "variants": variants, "rows": rows, "runs": runs},
         plot(rows), quick=args.quick, seconds=time.time() - started)


if __name__ == "__main__":
    main()
