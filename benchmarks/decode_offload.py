"""Decode speed of the offload, cpu and hybrid backends with the expert cache capped, beside the floor.

    python benchmarks/decode_offload.py                       # Qwen3-30B-A3B shape, cache 0.37 of the pool
    python benchmarks/decode_offload.py --layers 12 --ratio 0.25 --tokens 32 --json

The model is built in memory (random weights drawn on the device). B_P is measured through the
runtime's own fill path (expert copies from the pinned pool into slots); B_H through its CPU expert
path at batch 1. The floor of one token is sum over MoE layers of misses·S/B_H plus the GPU's own time
(the fused backend's step, every expert resident); measured/floor says how far each backend is from it.
Each backend's own floor counts its misses at the rate its path allows: offload at B_P, cpu at B_H,
hybrid at B_P + B_H (both paths at once, split by q*), capped by the host's read bandwidth where
`freetoken bench bw` measured it (the fills and the CPU branch read the same memory).
Routing of random weights has no locality, so miss rates here are the worst case for an LRU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from freetoken.errors import FreeTokenError
from freetoken.replay.synthetic import decode_steps, synthetic_engine, trace_routing, uniform_routing
from freetoken.replay.trace import load_trace
from freetoken.runtime.config import MoeConfig
from freetoken.runtime.engine import Engine
from freetoken.runtime.loading.demo import DEMO_SPEC, QWEN3_30B_A3B_SPEC
from freetoken.runtime.measure.bandwidth import Bench, ExpertShape
from freetoken.runtime.measure.profile import load_profile
from freetoken.runtime.moe.kernels.cpu_experts import branch_threads
from freetoken.runtime.moe.kernels.loader import cpu_description
from freetoken.runtime.moe.slot_bank import SlotBank


def bandwidths(engine: Engine, threads: int) -> tuple[float | None, float]:
    """B_P and B_H through the runtime's paths (the same measurement as `freetoken bench bw`)."""
    cfg = engine.config
    shape = ExpertShape(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok, cfg.num_experts)
    bench = Bench(shape, threads)
    b_h = bench.host_bw()
    b_p = bench.fill_bw(SlotBank(bench.pool, shape.top_k, bench.device)) if bench.cuda else None
    return b_p, b_h


def decode(engine: Engine, warm: int, tokens: int) -> dict[str, Any]:
    branch = getattr(engine.executor, "stream_branch", None)
    reset = None if branch is None else (lambda: branch.timings(reset=True))
    step = decode_steps(engine, warm, tokens, before_measure=reset)
    timings = None if branch is None else branch.timings()  # µs a layer that had CPU pairs
    c = engine.moe_counters
    per_token = c.per_token()
    q = c.by_layer["fills"] / max(c.steps, 1)  # fetched experts per layer step
    return {
        "step_ms": step * 1000,
        "tok_s": 1 / step,
        "hits_per_token": per_token["hits"],
        "misses_per_token": per_token["misses"],
        "fills_per_token": per_token["fills"],
        "cpu_per_token": per_token["cpu"],
        "miss_rate": c.miss_rate(),
        "q_mean": float(q.mean()),
        "q_min": float(q.min()),
        "q_max": float(q.max()),
        "cpu_branch_us": timings,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, help="override the layer count (48 for Qwen3-30B-A3B)")
    ap.add_argument("--ratio", type=float, default=0.37, help="expert cache as a fraction of the pool")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--warm", type=int, default=16, help="decode tokens before measuring")
    ap.add_argument("--backends", default="fused,offload,cpu,hybrid")
    ap.add_argument(
        "--cpu-threads",
        default="",
        help="CPU-branch threads, a list runs each (e.g. 16,15): the thread that launches GPU work "
        "needs a core too (default: the engine's, all cores less one beside a GPU)",
    )
    ap.add_argument("--device", default="cuda", help="cuda; cpu stands in for a smoke test with --small")
    ap.add_argument("--small", action="store_true", help="the demo shape instead of Qwen3-30B-A3B")
    ap.add_argument(
        "--routing",
        choices=("uniform", "model"),
        default="uniform",
        help="uniform: random top-k per token (no locality); model: the random model's own router",
    )
    ap.add_argument(
        "--routing-trace",
        type=Path,
        help="replay a recorded routing trace (freetoken run/serve --record-routing) instead of a router; "
        "its layer and expert counts must match the model (see --layers)",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    base = DEMO_SPEC if args.small else QWEN3_30B_A3B_SPEC
    spec = replace(base, num_layers=args.layers or base.num_layers)
    t0 = time.perf_counter()
    engine = synthetic_engine(spec, args.device, MoeConfig("cpu", cache_size=0), dtype="bfloat16")
    build_s = time.perf_counter() - t0
    if args.routing_trace is not None:
        trace_routing(engine, load_trace(args.routing_trace))
    elif args.routing == "uniform":
        uniform_routing(engine)
    thread_counts = [int(t) for t in args.cpu_threads.split(",") if t] or [branch_threads()]
    profile = load_profile()
    if profile is not None:  # what `freetoken bench bw` measured here, its measured split included
        b_p, b_h, correction = profile.b_p, profile.b_h, profile.fetch_correction()
        host_read: float | None = profile.host_read
    else:
        (b_p, b_h), correction, host_read = bandwidths(engine, torch.get_num_threads()), 1.0, None
    size = engine.pool.expert_nbytes
    rows = []
    gpu_ms = None
    runs = [
        (backend, threads)
        for backend in args.backends.split(",")
        for threads in (thread_counts[:1] if backend == "fused" else thread_counts)
    ]
    for backend, threads in runs:
        if backend == "fused":
            moe = MoeConfig("fused")
        else:
            moe = MoeConfig(
                backend,
                cache_ratio=args.ratio,
                cpu_threads=threads,
                pcie_gbps=b_p / 1e9 if b_p else None,
                host_gbps=b_h / 1e9,
                fetch_correction=correction,
                reprofile=False,
            )
        engine.configure_moe(moe)
        result = decode(engine, args.warm, args.tokens)
        if backend == "fused":
            gpu_ms = result["step_ms"]
        floor_ms = result["misses_per_token"] * size / b_h * 1000 + (gpu_ms or 0.0)
        # hybrid's fills and CPU branch read the same host memory: together no faster than its read
        both = min((b_p or 0.0) + b_h, host_read) if host_read else (b_p or 0.0) + b_h
        path_bw = {"offload": b_p or b_h, "hybrid": both}.get(backend, b_h)
        own_ms = result["misses_per_token"] * size / path_bw * 1000 + (gpu_ms or 0.0)
        rows.append(
            {
                "backend": backend,
                "threads": threads,
                "slots": engine.num_slots,
                **result,
                "floor_ms": floor_ms,
                "measured_over_floor": result["step_ms"] / floor_ms,
                "own_floor_ms": own_ms,
                "measured_over_own_floor": result["step_ms"] / own_ms,
            }
        )
    engine.close()
    doc = {
        "shape": "demo" if args.small else "qwen3-30b-a3b",
        "layers": spec.num_layers,
        "cache_ratio": args.ratio,
        "pool_GiB": engine.pool.nbytes / 2**30,
        "expert_MiB": size / 2**20,
        "build_s": build_s,
        "B_P_GBps": (b_p or 0.0) / 1e9,
        "B_H_GBps": b_h / 1e9,
        "host_read_GBps": (host_read or 0.0) / 1e9,
        "fetch_correction": correction,
        "from_profile": profile is not None,
        "cpu": cpu_description(),
        "q_over_m_model": min(1.0, (b_p or 0.0) / b_h),
        "gpu_ms": gpu_ms,
        "rows": rows,
    }
    if args.json:
        print(json.dumps(doc, indent=2))
        return
    title = (
        f"decode, {doc['shape']} shape, {spec.num_layers} layers, "
        f"{'trace' if args.routing_trace else args.routing} routing, "
        f"cache {args.ratio:.0%} of "
        f"{doc['pool_GiB']:.2f} GiB · B_P {doc['B_P_GBps']:.1f} GB/s · B_H {doc['B_H_GBps']:.1f} GB/s"
    )
    table = Table(title=title)
    for col in (
        "backend",
        "threads",
        "slots",
        "tok/s",
        "ms/token",
        "hits/tok",
        "misses/tok",
        "fills/tok",
        "cpu/tok",
        "q per layer",
        "floor ms",
        "measured/floor",
        "own floor ms",
        "measured/own",
        "CPU µs busy/start/gap",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["backend"],
            str(r["threads"]),
            str(r["slots"]),
            f"{r['tok_s']:.1f}",
            f"{r['step_ms']:.2f}",
            f"{r['hits_per_token']:.1f}",
            f"{r['misses_per_token']:.1f}",
            f"{r['fills_per_token']:.1f}",
            f"{r['cpu_per_token']:.1f}",
            f"{r['q_mean']:.2f} [{r['q_min']:.1f}-{r['q_max']:.1f}]",
            f"{r['floor_ms']:.2f}",
            f"{r['measured_over_floor']:.2f}",
            f"{r['own_floor_ms']:.2f}",
            f"{r['measured_over_own_floor']:.2f}",
            _branch_cell(r["cpu_branch_us"]),
        )
    Console(width=200).print(table)


def _branch_cell(t: dict[str, float] | None) -> str:
    """The CPU branch's µs a layer: busy, its team's start after the call, the gap between layers."""
    return "—" if t is None else f"{t['busy']:.0f} / {t['team_start']:.0f} / {t['gap']:.0f}"


if __name__ == "__main__":
    try:
        main()
    except FreeTokenError as exc:
        sys.exit(f"error: {exc}")
