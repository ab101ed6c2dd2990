"""Where one decode step's time goes: torch profiler tables (device and host) for a few decode steps.

python benchmarks/profile_decode.py --spec qwen3-30b-a3b --layers 4 --device cuda --backend fused
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from freetoken.runtime.demo import DEMO_SPEC, QWEN3_30B_A3B_SPEC, write_random_model
from freetoken.runtime.devices import sync_device
from freetoken.runtime.engine import build_engine

SPECS = {"demo": DEMO_SPEC, "qwen3-30b-a3b": QWEN3_30B_A3B_SPEC}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", choices=sorted(SPECS), default="demo")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--backend", default="fused")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rows", type=int, default=15)
    args = ap.parse_args()
    spec = SPECS[args.spec] if not args.layers else replace(SPECS[args.spec], num_layers=args.layers)
    with tempfile.TemporaryDirectory(prefix="ft-prof-") as tmp:
        engine = build_engine(write_random_model(Path(tmp) / "m", spec), args.device, "auto", args.backend)
    seq = engine.new_sequence()
    engine.forward(seq, list(range(64)))
    for _ in range(3):
        engine.forward(seq, [7])

    def sync() -> None:
        sync_device(engine.device)

    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.forward(seq, [7])
    sync()
    print(f"decode step: {(time.perf_counter() - t0) / args.steps * 1000:.2f} ms (no profiler)")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            engine.forward(seq, [7])
        sync()
    sort = "self_cuda_time_total" if engine.device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=args.rows))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
