"""How long a command takes before it does anything: `ft run demo -p hi -n 1` and `ft --help` against a
bare `python -c "import torch"` on the same machine, each the median of --runs fresh processes (the
demo model made beforehand, so no run pays for writing it). The bar: the one-token run within 1.5 × the
bare torch import.

    python benchmarks/startup.py [--runs 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

CASES = {
    "import torch": [sys.executable, "-c", "import torch"],
    "ft --help": [sys.executable, "-m", "freetoken", "--help"],
    "ft run demo -p hi -n 1": [sys.executable, "-m", "freetoken", "run", "demo", "-p", "hi", "-n", "1"],
}


def wall_seconds(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    wall_seconds(CASES["ft run demo -p hi -n 1"])  # the demo model and the CPU kernels, made once
    times: dict[str, list[float]] = {name: [] for name in CASES}
    for _ in range(args.runs):  # interleaved, so a noisy second hits every case alike
        for name, cmd in CASES.items():
            times[name].append(wall_seconds(cmd))
    base = statistics.median(times["import torch"])
    rows: list[dict[str, Any]] = [
        {
            "command": name,
            "median_s": statistics.median(t),
            "min_s": min(t),
            "ratio_to_torch": statistics.median(t) / base,
        }
        for name, t in times.items()
    ]
    if args.json:
        print(json.dumps({"runs": args.runs, "rows": rows}, indent=1))
        return
    print(f"{'command':<26} {'median s':>9} {'min s':>7} {'x import torch':>15}")
    for row in rows:
        cmd, median, low, ratio = row["command"], row["median_s"], row["min_s"], row["ratio_to_torch"]
        print(f"{cmd:<26} {median:>9.2f} {low:>7.2f} {ratio:>15.2f}")


if __name__ == "__main__":
    main()
