"""The grouped Triton MoE kernels for many tokens beside the torch path they replace, one layer's experts.

    python benchmarks/moe_prefill_kernel.py                 # Qwen3-30B-A3B experts, bf16, 64..4096 tokens
    python benchmarks/moe_prefill_kernel.py --codec Q4_K    # experts kept as Q4_K blocks (Q8_0, Q6_K, MXFP4)
    python benchmarks/moe_prefill_kernel.py --sweep --json  # also try tile sizes at the largest batch

One MoE layer's routed experts for T tokens with uniform random routing. `torch` is the path the kernels
replace: one expert at a time with the routing read back (bf16 banks), the used experts dequantised
first (codec banks). `TFLOP/s` counts 2·3·H·I multiply-adds per (token, choice) pair. Times are CUDA
events around each call (median of repeats) after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict
from typing import Any

import torch
from moe_decode_kernel import random_banks

from freetoken.codecs.torch_dequant import DEVICE_CODECS
from freetoken.runtime.moe.experts import grouped_experts, stored_experts
from freetoken.runtime.moe.kernels.moe_prefill import CODEC_BLOCKS, DEFAULT_BLOCKS, PrefillBlocks, grouped_moe

SWEEP = [
    PrefillBlocks(block_m=m, block_n=n, block_k=k, num_warps=w, num_stages=s)
    for m in (32, 64)
    for n, k in ((64, 64), (128, 64), (64, 128))
    for w, s in ((4, 2), (8, 3))
]


def event_time(fn: Any, reps: int = 5) -> float:
    """Seconds per call: the median of `reps` calls timed by CUDA events, after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--moe-inter", type=int, default=768)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokens", default="64,512,4096")
    ap.add_argument("--codec", choices=("bf16", *DEVICE_CODECS), default="bf16")
    ap.add_argument("--sweep", action="store_true", help="time the tiles in SWEEP at the largest batch first")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    h, i, e, k = args.hidden, args.moe_inter, args.experts, args.top_k
    g = torch.Generator(device="cuda").manual_seed(0)
    codecs = None if args.codec == "bf16" else (args.codec, args.codec)
    gate_up, down, plain = random_banks(args.codec, e, h, i, g)
    tiles = DEFAULT_BLOCKS if codecs is None else CODEC_BLOCKS
    counts = [int(t) for t in args.tokens.split(",")]

    def inputs(t: int) -> tuple[torch.Tensor, ...]:
        x = torch.randn(t, h, device="cuda", generator=g).bfloat16()
        ids = torch.rand(t, e, device="cuda", generator=g).argsort(dim=1)[:, :k]
        return x, ids, torch.rand(t, k, device="cuda", generator=g)

    sweep_rows = []
    if args.sweep:
        x, ids, w = inputs(counts[-1])
        for cand in SWEEP:
            try:
                s = event_time(lambda c=cand: grouped_moe(x, ids, w, gate_up, down, codecs=codecs, blocks=c))
            except Exception as exc:  # a tile the compiler cannot fit: skipped
                print(f"sweep {asdict(cand)}: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)
                continue
            sweep_rows.append({**asdict(cand), "ms": s * 1e3})
        best = min(sweep_rows, key=lambda r: r["ms"])
        tiles = PrefillBlocks(**{f: best[f] for f in asdict(tiles)})
    rows = []
    for t in counts:
        x, ids, w = inputs(t)
        ours = event_time(
            lambda x=x, ids=ids, w=w: grouped_moe(x, ids, w, gate_up, down, codecs=codecs, blocks=tiles)
        )
        if codecs is None:
            torch_s = event_time(lambda x=x, ids=ids, w=w: grouped_experts(x, ids, w, gate_up, down), reps=3)
        else:
            torch_s = event_time(
                lambda x=x, ids=ids, w=w: stored_experts(x, ids, w, gate_up, down, codecs), reps=3
            )
        ref = grouped_experts(x.float(), ids, w, *plain)
        got = grouped_moe(x, ids, w, gate_up, down, codecs=codecs, blocks=tiles).float()
        flops = 2 * 3 * h * i * t * k
        rows.append(
            {
                "tokens": t,
                "ours_ms": ours * 1e3,
                "torch_ms": torch_s * 1e3,
                "speedup": torch_s / ours,
                "tflops": flops / ours / 1e12,
                "tokens_per_s": t / ours,
                "rel_err": float((got - ref).norm() / ref.norm()),
            }
        )
    doc = {
        "shape": {"hidden": h, "moe_inter": i, "experts": e, "top_k": k},
        "codec": args.codec,
        "device": torch.cuda.get_device_name(),
        "blocks": asdict(tiles),
        "rows": rows,
        "sweep": sweep_rows,
    }
    if args.json:
        print(json.dumps(doc, indent=1))
        return
    print(f"{doc['device']} · H {h} I {i} E {e} K {k} {args.codec} · blocks {asdict(tiles)}")
    print(
        f"{'T':>6} {'ours ms':>9} {'torch ms':>9} {'speedup':>8} {'TFLOP/s':>8} {'tok/s':>10} {'rel err':>8}"
    )
    for r in rows:
        print(
            f"{r['tokens']:>6} {r['ours_ms']:>9.3f} {r['torch_ms']:>9.3f} {r['speedup']:>8.1f} "
            f"{r['tflops']:>8.1f} {r['tokens_per_s']:>10.0f} {r['rel_err']:>8.1e}"
        )


if __name__ == "__main__":
    main()
