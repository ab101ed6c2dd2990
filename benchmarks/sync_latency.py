"""What one host<->device round trip costs on this machine: the price of reading routing back per layer.

python benchmarks/sync_latency.py [--json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def timed(fn, n: int = 200) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    x = torch.randn(8, device="cuda")
    small = torch.randn(2048, device="cuda", dtype=torch.bfloat16)
    rows = {
        "launch_us (add, no sync)": timed(lambda: x.add_(1.0)),
        "sync_us (synchronize)": timed(torch.cuda.synchronize),
        "item_us (kernel + .item())": timed(lambda: x.sum().item()),
        "d2h_4KiB_us (.cpu())": timed(lambda: small.cpu()),
    }
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    for name, value in rows.items():
        print(f"{name:32s} {value:10.1f}")


if __name__ == "__main__":
    main()
