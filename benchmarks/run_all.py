"""Run every benchmark and rebuild benchmarks/README.md from their results.

    python benchmarks/run_all.py [--quick]      # full: about 35 minutes on 2 CPU cores; the wan one needs root
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHMARKS = ["quality", "overhead", "wan", "peers"]


INTRO = """# Benchmarks

Side-by-side measurements, not tests: each script prints a markdown table, writes a PNG plot and its raw numbers
as JSON in `results/`, and asserts nothing about time. Every script has `--quick` (a smaller version of the same
comparison) and a full mode. `python benchmarks/run_all.py` runs all four in sequence and rebuilds this file from
`results/` (`--report-only` rebuilds it without running anything).

Requirements beyond `make setup`: the `wan` benchmark needs root (network namespaces and `tc`); `peers` needs
torchft (`.venv/bin/pip install -e '.[bench]'`).
"""

SECTIONS = {
    "quality": ("Quality at equal tokens", "python benchmarks/quality.py",
                "Built-in corpus, tiny-llama, 64-token blocks, batch 8 per replica, 400 inner steps; every "
                "multi-replica run sees the same tokens, the single worker the same number of steps."),
    "overhead": ("Overhead vs the same replicas alone", "python benchmarks/overhead.py",
                 "Two replicas on two CPU processes, 400 steps of the peer task; steady tokens/s (steps after the "
                 "first tenth)."),
    "wan": ("Two hosts over a shaped link", "sudo python benchmarks/wan.py",
            "Network namespaces joined by a veth pair, shaped with tc tbf (no added latency: netem is not "
            "available here); bytes from the veth counters."),
    "peers": ("Peers on the same task", "python benchmarks/peers.py",
              "hf-diloco, torchft's DiLoCo 0.2.0 and accelerate's LocalSGD: same model, data, inner optimizer, H "
              "and steps."),
}


def write_report() -> None:
    parts = [INTRO]
    for name, (title, command, about) in SECTIONS.items():
        table = HERE / "results" / f"{name}.md"
        parts.append(f"## {title}\n\n`{command}`. {about}\n")
        parts.append(table.read_text() if table.exists() else "_not run yet_\n")
        if (HERE / "results" / f"{name}.png").exists():
            parts.append(f"![{name}](results/{name}.png)\n")
    targets = HERE / "targets.md"
    if targets.exists():
        parts.append(targets.read_text())
    (HERE / "README.md").write_text("\n".join(parts))
    print(f"wrote {HERE / 'README.md'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", nargs="*", choices=BENCHMARKS, help="run these only (the report uses all results)")
    parser.add_argument("--report-only", action="store_true", help="rebuild README.md from results/ only")
    args = parser.parse_args()
    for name in [] if args.report_only else args.only or BENCHMARKS:
        started = time.time()
        print(f"=== {name} ===", flush=True)
        command = [sys.executable, str(HERE / f"{name}.py"), *(["--quick"] if args.quick else [])]
        if subprocess.run(command, cwd=HERE.parent).returncode != 0:
            sys.exit(f"{name} failed")
        print(f"=== {name}: {time.time() - started:.0f} s ===", flush=True)
    write_report()


if __name__ == "__main__":
    main()
