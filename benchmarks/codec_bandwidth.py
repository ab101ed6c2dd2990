"""B_H per expert codec: the CPU expert kernel at batch 1 on banks kept as stored, in stored bytes per second,
beside the host read ceiling measured in the same round.

    python benchmarks/codec_bandwidth.py [--threads N] [--rounds 3] [--codecs bf16,Q8_0,Q4_K,...] [--json]

Each codec's bank holds more experts than the last-level cache (random raw blocks with small finite fp16
scales; bf16: random values), and every call takes the next top-k experts in turn, so no call finds its
weights in a cache. Q8_0 and the K-quants run both ways: weight-only (the default) and against int8
activation blocks (`--moe-cpu-int8-act`). The activations are bf16 values, as a bf16 model's are
(`--x-dtype fp32`: values off the bf16 grid, as an fp32 model's; the weight-only Q4_K/Q5_K dots take
bf16 pair-dot instructions only for the former). Figures: the median over rounds of each codec's ratio
to its round's read.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from freetoken.codecs import get_codec
from freetoken.formats.ftw import aligned_empty
from freetoken.runtime.measure.bandwidth import PRESETS
from freetoken.runtime.moe.kernels.cpu_experts import (
    INT8_ACT_IDS,
    beyond_cache_bytes,
    cpu_experts,
    read_bandwidth,
)


def random_bank(codec: str, experts: int, rows: int, n: int, rng: np.random.Generator) -> torch.Tensor:
    if codec == "bf16":
        return aligned_empty((experts, rows, n), torch.bfloat16, huge=True).normal_(0.0, 0.02)
    spec = get_codec(codec)
    bank = aligned_empty((experts, rows, spec.row_bytes(n)), torch.uint8, huge=True)
    spec.random_blocks(bank.numpy(), rng, 1e-4)
    return bank


def stored_bytes_per_s(
    codec: str,
    int8_act: bool,
    banks: tuple[torch.Tensor, torch.Tensor],
    top_k: int,
    threads: int,
    calls: int,
    x_dtype: torch.dtype = torch.bfloat16,
) -> float:
    gate_up, down = banks
    experts, hidden = gate_up.shape[0], down.shape[1]
    per_expert = (gate_up.numel() * gate_up.element_size() + down.numel() * down.element_size()) // experts
    x, w, out = (
        torch.randn(1, hidden).to(x_dtype).float(),
        torch.full((1, top_k), 1.0 / top_k),
        torch.empty(1, hidden),
    )
    steps = [torch.arange(i * top_k, (i + 1) * top_k)[None] % experts for i in range(calls + 1)]
    best = float("inf")
    for i, ids in enumerate(steps):
        t0 = time.perf_counter()
        cpu_experts(x, ids, w, gate_up, down, threads, out=out, codecs=(codec, codec), int8_act=int8_act)
        if i:
            best = min(best, time.perf_counter() - t0)
    return top_k * per_expert / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=12, help="kernel calls per round (the best is kept)")
    ap.add_argument("--codecs", default="bf16,Q8_0,Q4_K,Q5_K,Q6_K,IQ4_XS,MXFP4")
    ap.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(PRESETS))
    ap.add_argument("--x-dtype", choices=("bf16", "fp32"), default="bf16", help="the activations' values")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    shape = PRESETS[args.preset]
    rng = np.random.default_rng(0)
    rows: list[tuple[str, bool, tuple[torch.Tensor, torch.Tensor]]] = []
    x_dtype = torch.bfloat16 if args.x_dtype == "bf16" else torch.float32
    for codec in args.codecs.split(","):
        per_expert = 3 * shape.hidden * shape.intermediate * 2  # bf16 bytes: the bank outgrows the cache
        experts = max(2 * shape.top_k, -(-beyond_cache_bytes() // per_expert))
        banks = (
            random_bank(codec, experts, 2 * shape.intermediate, shape.hidden, rng),
            random_bank(codec, experts, shape.hidden, shape.intermediate, rng),
        )
        for int8_act in (False, True) if codec in INT8_ACT_IDS else (False,):
            rows.append((codec, int8_act, banks))
    ratios: dict[str, list[float]] = {}
    speeds: dict[str, list[float]] = {}
    reads = []
    for _ in range(args.rounds):
        read = read_bandwidth(threads=args.threads)
        reads.append(read)
        for codec, int8_act, banks in rows:
            name = codec + (" int8-act" if int8_act else "")
            gbs = stored_bytes_per_s(codec, int8_act, banks, shape.top_k, args.threads, args.calls, x_dtype)
            ratios.setdefault(name, []).append(gbs / read)
            speeds.setdefault(name, []).append(gbs)
    doc = {
        "threads": args.threads,
        "preset": args.preset,
        "x_dtype": args.x_dtype,
        "read_GBps": [round(r / 1e9, 1) for r in reads],
        "codecs": {
            name: {
                "GBps": round(statistics.median(speeds[name]) / 1e9, 1),
                "x_read": round(statistics.median(r), 2),
            }
            for name, r in ratios.items()
        },
    }
    if args.json:
        print(json.dumps(doc, indent=1))
        return
    low, high = min(doc["read_GBps"]), max(doc["read_GBps"])
    print(f"{args.threads} threads, {args.preset} experts, read {low}-{high} GB/s")
    print(f"{'codec':>16} {'GB/s stored':>12} {'x read':>7}")
    for name, row in doc["codecs"].items():
        print(f"{name:>16} {row['GBps']:>12.1f} {row['x_read']:>7.2f}")


if __name__ == "__main__":
    main()
