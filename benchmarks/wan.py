"""DDP vs DiLoCo between two hosts over a shaped link: throughput, compute utilisation, bytes on the wire.

Two network namespaces joined by a veth pair stand in for two machines (one replica each, one CPU thread each);
`tc ... tbf` limits the link to 100 Mbit/s or 10 Mbit/s in both directions (netem is not available here, so no
added latency). Compute utilisation = tokens/s of the run ÷ tokens/s of the same two replicas training alone,
unshaped and unsynced. Bytes are read from the veth's transmit counters, so they include every protocol byte.

    python benchmarks/wan.py [--quick]          # needs root (ip netns, tc)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from common import REPO, free_port, markdown_table, read_run, run_env, save, tokens_per_second, train_command
from netns import NamespaceError, two_hosts
from overhead import independent_pair


def two_node_run(hosts, out: Path, overrides: list[str]) -> tuple[dict, list[int]]:
    """One replica per host; returns the main process's run metrics and the bytes each host transmitted."""
    port = str(free_port())
    before = [h.tx_bytes() for h in hosts]
    procs = []
    for rank, host in enumerate(hosts):
        launch = ["--multi_gpu", "--num_machines", "2", "--num_processes", "2", "--machine_rank", str(rank),
                  "--main_process_ip", hosts[0].address, "--main_process_port", port]
        command = train_command(2, ["--output_dir", str(out / f"node{rank}"), *overrides],
                                prefix=host.exec_prefix(), launch=launch)
        procs.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                      env=run_env(1), cwd=REPO))
    for p in procs:
        _, err = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise SystemExit(f"two-node run failed:\n{err[-3000:]}")
    sent = [after - start for after, start in zip((h.tx_bytes() for h in hosts), before, strict=True)]
    return read_run(out / "node0"), sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer steps, two link settings (about 2 minutes)")
    args = parser.parse_args()
    links = [None, "10mbit"] if args.quick else [None, "100mbit", "10mbit"]
    diloco_steps, inner = (50, 25) if args.quick else (200, 50)
    ddp_steps = {None: 40, "100mbit": 20, "10mbit": 8} if args.quick else {None: 60, "100mbit": 30, "10mbit": 10}
    base = ["--eval_strategy", "no", "--eval_on_start", "false", "--save_strategy", "no", "--logging_steps", "10"]
    rows, raw = [], {"runs": []}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        print("baseline: the two replicas alone, unshaped and unsynced ...", flush=True)
        alone = independent_pair(tmp, [*base, "--max_steps", str(diloco_steps)])
        alone_tps = sum(tokens_per_second(r, 1) for r in alone)
        raw["independent_tokens_per_second"] = alone_tps
        try:
            for rate in links:
                with two_hosts(rate) as hosts:
                    methods = [("DDP", ["--trainer", "ddp", "--max_steps", str(ddp_steps[rate])], ddp_steps[rate]),
                               (f"DiLoCo H={inner}", ["--inner_steps", str(inner), "--max_steps", str(diloco_steps)],
                                diloco_steps)]
                    for method, overrides, steps in methods:
                        link = rate or "unlimited"
                        print(f"{method} over {link} ...", flush=True)
                        result, sent = two_node_run(hosts, tmp / f"{method}-{link}".replace(" ", ""),
                                                    [*base, *overrides])
                        tps = tokens_per_second(result, 2)
                        per_step = max(sent) / steps
                        rows.append([link, method, steps, f"{tps:,.0f}", f"{tps / alone_tps:.1%}",
                                     f"{max(sent) / 1e6:.1f}", f"{per_step / 1e3:.0f}"])
                        raw["runs"].append({"link": link, "method": method, "steps": steps, "tokens_per_second": tps,
                                            "utilisation": tps / alone_tps, "veth_tx_bytes": sent})
        except NamespaceError as error:
            sys.exit(f"wan benchmark needs network namespaces (run as root): {error}")
    table = markdown_table(["link", "method", "steps", "tokens/s", "compute utilisation", "MB sent (veth, max host)",
                            "kB sent per step"], rows)
    table += f"\n\nUnshaped, unsynced tokens/s of the two replicas alone: {alone_tps:,.0f}."
    save("wan", table, raw, plot(raw))


def plot(raw: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    links = list(dict.fromkeys(r["link"] for r in raw["runs"]))
    methods = list(dict.fromkeys(r["method"] for r in raw["runs"]))
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        values = [next(r["utilisation"] for r in raw["runs"] if r["link"] == link and r["method"] == method) * 100
                  for link in links]
        ax.bar([x + i * width for x in range(len(links))], values, width, label=method)
    ax.set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(links))], links)
    ax.axhline(95, color="#d62728", linestyle="--", linewidth=1, label="95% target (10 Mbit/s)")
    ax.set_ylabel("compute utilisation, %")
    ax.legend()
    ax.set_title("Two hosts over a shaped veth link")
    return fig


if __name__ == "__main__":
    main()
