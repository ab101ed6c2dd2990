"""Decode speed of the offload, cpu and hybrid backends with the expert cache capped, beside the floor.

    python benchmarks/decode_offload.py                       # Qwen3-30B-A3B shape, cache 0.37 of the pool
    python benchmarks/decode_offload.py --layers 12 --ratio 0.25 --tokens 32 --json

The model is built in memory (random weights drawn on the device). B_P is measured through the
runtime's own fill path (expert copies from the pinned pool into slots); B_H through its CPU expert
path at batch 1. The floor of one token is sum over MoE layers of misses·S/B_H plus the GPU's own time
(the fused backend's step, every expert resident); measured/floor says how far each backend is from it.
Routing of random weights has no locality, so miss rates here are the worst case for an LRU.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from freetoken.runtime.config import EngineConfig, MoeConfig
from freetoken.runtime.demo import DEMO_SPEC, QWEN3_30B_A3B_SPEC, random_weights, write_random_model
from freetoken.runtime.engine import Engine
from freetoken.runtime.moe.experts import grouped_experts
from freetoken.runtime.moe.slot_bank import SlotBank


def measure_pcie(engine: Engine, experts: int = 64) -> float:
    """Bytes/s of expert fills from the pinned pool into device slots (the runtime's copy path)."""
    pool = engine.pool
    bank = SlotBank(pool, experts, engine.device)
    layers = pool.layers
    for slot in range(experts):  # warm
        bank.fill(slot, layers[slot % len(layers)], slot % pool.num_experts)
    sync(engine)
    t0 = time.perf_counter()
    for rep in range(3):
        for slot in range(experts):
            bank.fill(slot, layers[(slot + rep) % len(layers)], (7 * slot + rep) % pool.num_experts)
    sync(engine)
    seconds = time.perf_counter() - t0
    del bank
    return 3 * experts * pool.expert_nbytes / seconds


def measure_host(engine: Engine, top_k: int, reps: int = 20) -> float:
    """Bytes/s of the CPU expert path at batch 1: top-k experts of one layer, weights read from the pool."""
    pool = engine.pool
    x = torch.randn(1, pool.hidden_size, dtype=pool.dtype)
    w = torch.full((1, top_k), 1.0 / top_k, dtype=pool.dtype)
    layers = pool.layers
    seconds = 0.0
    with torch.inference_mode():
        for rep in range(reps + 2):
            ids = torch.randperm(pool.num_experts)[:top_k][None]
            layer = layers[rep % len(layers)]
            t0 = time.perf_counter()
            grouped_experts(x, ids, w, pool.gate_up[layer], pool.down[layer])
            if rep >= 2:
                seconds += time.perf_counter() - t0
    return reps * top_k * pool.expert_nbytes / seconds


def uniform_routing(engine: Engine, seed: int = 0) -> None:
    """Replace every router with uniformly random top-k choices (no locality: an LRU's worst case).

    Random-weight models route very unevenly in deep layers (their hidden states align), which would
    flatter the cache; real locality is what routing traces measure.
    """
    gen = torch.Generator(device=engine.device).manual_seed(seed)
    top_k = engine.config.num_experts_per_tok
    for block in engine.model.moe_blocks():

        def route(x: torch.Tensor, block=block) -> tuple[torch.Tensor, torch.Tensor]:
            scores = torch.rand(x.shape[0], block.gate.out_features, device=x.device, generator=gen)
            weights, ids = scores.topk(top_k, dim=-1)
            return ids, (weights / weights.sum(-1, keepdim=True)).to(x.dtype)

        block.route = route


def sync(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def decode(engine: Engine, warm: int, tokens: int) -> dict[str, float]:
    """Decode steps fed a fixed pseudo-random token stream (the same for every backend; greedy output of
    random weights repeats itself and would flatter the cache): `warm` steps, then `tokens` measured."""
    stream = torch.randint(
        0, engine.config.vocab_size, (warm + tokens,), generator=torch.Generator().manual_seed(0)
    )
    seq = engine.new_sequence()
    engine.forward(seq, list(range(100, 116)))
    for token in stream[:warm].tolist():
        engine.forward(seq, [token])
    engine.moe_counters.reset()
    sync(engine)
    t0 = time.perf_counter()
    for token in stream[warm:].tolist():
        int(engine.forward(seq, [token])[-1].argmax())  # the sampler's read-back, as in real decoding
    sync(engine)
    step = (time.perf_counter() - t0) / tokens
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
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, help="override the layer count (48 for Qwen3-30B-A3B)")
    ap.add_argument("--ratio", type=float, default=0.37, help="expert cache as a fraction of the pool")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--warm", type=int, default=16, help="decode tokens before measuring")
    ap.add_argument("--backends", default="fused,offload,cpu,hybrid")
    ap.add_argument("--cpu-threads", type=int)
    ap.add_argument("--device", default="cuda", help="cuda; cpu stands in for a smoke test with --small")
    ap.add_argument("--small", action="store_true", help="the demo shape instead of Qwen3-30B-A3B")
    ap.add_argument(
        "--routing",
        choices=("uniform", "model"),
        default="uniform",
        help="uniform: random top-k per token (no locality); model: the random model's own router",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    base = DEMO_SPEC if args.small else QWEN3_30B_A3B_SPEC
    spec = replace(base, num_layers=args.layers or base.num_layers)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ft-offload-") as tmp:
        folder = write_random_model(Path(tmp) / "m", spec, with_weights=False)
        dtype = "bfloat16" if args.device == "cuda" else "float32"
        config = EngineConfig(folder, args.device, dtype, MoeConfig("cpu", cache_size=0))
        engine = Engine(config, weights=random_weights())
    build_s = time.perf_counter() - t0
    if args.routing == "uniform":
        uniform_routing(engine)
    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    top_k = engine.config.num_experts_per_tok
    b_p, b_h = measure_pcie(engine), measure_host(engine, top_k)
    size = engine.pool.expert_nbytes
    rows = []
    gpu_ms = None
    for backend in args.backends.split(","):
        if backend == "fused":
            moe = MoeConfig("fused")
        else:
            moe = MoeConfig(backend, cache_ratio=args.ratio, pcie_gbps=b_p / 1e9, host_gbps=b_h / 1e9)
        engine.configure_moe(moe)
        result = decode(engine, args.warm, args.tokens)
        if backend == "fused":
            gpu_ms = result["step_ms"]
        floor_ms = result["misses_per_token"] * size / b_h * 1000 + (gpu_ms or 0.0)
        rows.append(
            {
                "backend": backend,
                "slots": engine.num_slots,
                **result,
                "floor_ms": floor_ms,
                "measured_over_floor": result["step_ms"] / floor_ms,
            }
        )
    engine.close()
    doc = {
        "shape": "qwen3-30b-a3b",
        "layers": args.layers,
        "cache_ratio": args.ratio,
        "pool_GiB": engine.pool.nbytes / 2**30,
        "expert_MiB": size / 2**20,
        "build_s": build_s,
        "B_P_GBps": b_p / 1e9,
        "B_H_GBps": b_h / 1e9,
        "q_over_m_model": min(1.0, b_p / b_h),
        "gpu_ms": gpu_ms,
        "threads": torch.get_num_threads(),
        "rows": rows,
    }
    if args.json:
        print(json.dumps(doc, indent=2))
        return
    title = (
        f"decode, {doc['shape']} shape, {spec.num_layers} layers, {args.routing} routing, "
        f"cache {args.ratio:.0%} of "
        f"{doc['pool_GiB']:.2f} GiB · B_P {doc['B_P_GBps']:.1f} GB/s · B_H {doc['B_H_GBps']:.1f} GB/s"
    )
    table = Table(title=title)
    for col in (
        "backend",
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
    ):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["backend"],
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
        )
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
