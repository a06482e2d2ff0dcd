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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", nargs="*", choices=BENCHMARKS, help="run these only (the report uses all results)")
    args = parser.parse_args()
    for name in args.only or BENCHMARKS:
        started = time.time()
        print(f"=== {name} ===", flush=True)
        command = [sys.executable, str(HERE / f"{name}.py"), *(["--quick"] if args.quick else [])]
        if subprocess.run(command, cwd=HERE.parent).returncode != 0:
            sys.exit(f"{name} failed")
        print(f"=== {name}: {time.time() - started:.0f} s ===", flush=True)


if __name__ == "__main__":
    main()
