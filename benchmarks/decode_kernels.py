"""The decode step's Triton kernels at Qwen3-30B-A3B shapes, beside HBM bandwidth and the torch path.

    python benchmarks/decode_kernels.py              # B 1, 8 × lengths 512, 4096
    python benchmarks/decode_kernels.py --sweep      # also time a few attention tilings per shape
    python benchmarks/decode_kernels.py --json

Kernels: slot decode attention (split + combine launches), add + RMSNorm over [B, H], and q/k norm +
rotary + k/v cache write. `graph us`: `reps` launches captured in one CUDA graph, median over replays
(no launch overhead); `eager us`: the same launches issued from Python, timed with CUDA events.
`bytes` is what the kernel must move at least (keys and values of every row's length, activations in
and out); `GB/s` = bytes / graph time, `x peak` over the card's data-sheet HBM bandwidth. `torch us`:
the plain-torch reference (row by row, as the model decodes today), eager, for attention.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
from triton.runtime.errors import OutOfResources

from freetoken.runtime.models.kernels.decode_attention import (
    DEFAULT_ATTENTION_BLOCKS,
    AttentionBlocks,
    choose_splits,
    slot_decode_attention,
    slot_decode_attention_reference,
)
from freetoken.runtime.models.kernels.norm_rope import add_rms_norm, qk_norm_rope_kv_write

NH, KVH, D, H, CAP = 32, 4, 128, 2048, 4096  # Qwen3-30B-A3B attention
HBM_PEAK = {"NVIDIA H200": 4.8e12, "NVIDIA H100 80GB HBM3": 3.35e12}  # bytes/s, the data sheets
SWEEP = [
    AttentionBlocks(block_n=n, max_splits=s, num_warps=w, num_stages=st)
    for n in (32, 64, 128)
    for s in (16, 32, 64)
    for w in (4, 8)
    for st in (1, 2, 3)
]


def graph_time(fn: Callable[[], Any], reps: int = 50, rounds: int = 7) -> float:
    """Seconds per call: `reps` calls captured in one CUDA graph, median over `rounds` replays."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return _median_time(graph.replay, reps, rounds)


def eager_time(fn: Callable[[], Any], reps: int = 50, rounds: int = 7) -> float:
    """Seconds per call issued from Python, launch overhead included."""
    fn()

    def run() -> None:
        for _ in range(reps):
            fn()

    return _median_time(run, reps, rounds)


def _median_time(run: Callable[[], Any], reps: int, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / reps)
    return statistics.median(times)


def row(kernel: str, b: int, length: int, fn: Callable[[], Any], nbytes: int, **extra: Any) -> dict:
    graph = graph_time(fn)
    peak = HBM_PEAK.get(torch.cuda.get_device_name(), float("nan"))
    return {
        "kernel": kernel,
        "batch": b,
        "length": length,
        "graph_us": graph * 1e6,
        "eager_us": eager_time(fn) * 1e6,
        "bytes": nbytes,
        "gbps": nbytes / graph / 1e9,
        "x_peak": nbytes / graph / peak,
        **extra,
    }


def attention_rows(b: int, length: int, sweep: bool) -> tuple[list[dict], list[dict]]:
    g = torch.Generator(device="cuda").manual_seed(b * 10_000 + length)
    q = torch.randn(b, NH, D, device="cuda", generator=g).bfloat16()
    k_cache = torch.randn(b, KVH, CAP, D, device="cuda", generator=g).bfloat16()
    v_cache = torch.randn(b, KVH, CAP, D, device="cuda", generator=g).bfloat16()
    slots = torch.randperm(b, device="cuda", generator=g).int()
    lengths = torch.full((b,), length, dtype=torch.int32, device="cuda")
    rows = (slots, lengths)
    nbytes = b * length * KVH * D * 2 * 2 + 2 * b * NH * D * 2  # keys + values, q in and out

    def run(blocks: AttentionBlocks = DEFAULT_ATTENTION_BLOCKS) -> torch.Tensor:
        return slot_decode_attention(q, k_cache, v_cache, slots, lengths, D**-0.5, blocks=blocks)

    sweep_rows = []
    if sweep:
        for candidate in SWEEP:
            try:
                s = graph_time(lambda c=candidate: run(c), reps=20, rounds=3)
            except OutOfResources:  # too much shared memory for this card: raised before the capture
                continue
            sweep_rows.append({"batch": b, "length": length, **asdict(candidate), "us": s * 1e6})
    as_fp32 = (q.float(), k_cache.float(), v_cache.float())
    want = slot_decode_attention_reference(*as_fp32, slots, lengths, D**-0.5)
    err = float((run().float() - want).norm() / want.norm())
    torch_s = eager_time(lambda: slot_decode_attention_reference(q, k_cache, v_cache, *rows, D**-0.5))
    splits = choose_splits(b, KVH, CAP, DEFAULT_ATTENTION_BLOCKS)
    extra = {"splits": splits, "torch_us": torch_s * 1e6, "rel_err": err}
    return [row("attention", b, length, run, nbytes, **extra)], sweep_rows


def norm_rows(b: int) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(b)
    x = torch.randn(b, H, device="cuda", generator=g).bfloat16()
    residual = torch.randn(b, H, device="cuda", generator=g).bfloat16()
    weight = torch.ones(H, device="cuda").bfloat16()
    qkv = torch.randn(b, (NH + 2 * KVH) * D, device="cuda", generator=g).bfloat16()
    q, k, v = qkv.split([NH * D, KVH * D, KVH * D], dim=1)
    head_w = torch.ones(D, device="cuda").bfloat16()
    cos, sin = torch.rand(b, D, device="cuda").bfloat16(), torch.rand(b, D, device="cuda").bfloat16()
    k_cache = torch.zeros(b, KVH, CAP, D, device="cuda").bfloat16()
    v_cache = torch.zeros_like(k_cache)
    slots = torch.arange(b, dtype=torch.int32, device="cuda")
    positions = torch.full((b,), CAP - 1, dtype=torch.int32, device="cuda")
    norm_bytes = 4 * b * H * 2 + H * 2  # x, residual in; normed, summed out
    rope_bytes = (b * (NH + 2 * KVH) * D + 2 * b * D + b * NH * D + 2 * b * KVH * D) * 2
    head = (q, k, v, head_w, head_w, 1e-6, cos, sin)
    return [
        row("add_rms_norm", b, 0, lambda: add_rms_norm(x, residual, weight, 1e-6), norm_bytes),
        row(
            "qk_norm_rope_kv_write",
            b,
            0,
            lambda: qk_norm_rope_kv_write(*head, k_cache, v_cache, slots, positions),
            rope_bytes,
        ),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--lengths", default="512,4096")
    ap.add_argument("--sweep", action="store_true", help="time every tiling in SWEEP for attention")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_kernels.py needs a CUDA device")
    batches = [int(b) for b in args.batches.split(",")]
    lengths = [int(n) for n in args.lengths.split(",")]
    rows, sweep_rows = [], []
    for b in batches:
        for length in lengths:
            found, swept = attention_rows(b, min(length, CAP), args.sweep)
            rows += found
            sweep_rows += swept
        rows += norm_rows(b)
    doc = {
        "shape": {"heads": NH, "kv_heads": KVH, "head_dim": D, "hidden": H, "capacity": CAP},
        "device": torch.cuda.get_device_name(),
        "blocks": asdict(DEFAULT_ATTENTION_BLOCKS),
        "rows": rows,
        "sweep": sweep_rows,
    }
    if args.json:
        print(json.dumps(doc, indent=1))
        return
    print(f"{doc['device']} · NH {NH} KVH {KVH} D {D} H {H} CAP {CAP} · blocks {doc['blocks']}")
    head = ("kernel", "B", "len", "graph us", "eager us", "KB", "GB/s", "x peak", "torch us")
    widths = (22, 3, 5, 9, 9, 8, 7, 7, 9)
    print(" ".join(f"{c:>{w}}" for c, w in zip(head, widths, strict=True)))
    for r in rows:
        torch_us = f"{r['torch_us']:>9.1f}" if "torch_us" in r else f"{'':>9}"
        shape = f"{r['kernel']:>22} {r['batch']:>3} {r['length'] or '':>5}"
        print(
            f"{shape} {r['graph_us']:>9.1f} {r['eager_us']:>9.1f} "
            f"{r['bytes'] / 1e3:>8.1f} {r['gbps']:>7.0f} {r['x_peak']:>7.2f} {torch_us}"
        )
    for b in batches:
        for length in lengths:
            mine = [r for r in sweep_rows if r["batch"] == b and r["length"] == min(length, CAP)]
            for r in sorted(mine, key=lambda r: r["us"])[:3]:
                tiling = f"n {r['block_n']} splits<={r['max_splits']} w{r['num_warps']} st{r['num_stages']}"
                print(f"sweep B {b} len {length}: {tiling}: {r['us']:.1f} us")


if __name__ == "__main__":
    main()
