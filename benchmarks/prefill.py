"""Prefill at the link floor: whole expert layers streamed through two slot buffers, beside the floor.

    python benchmarks/prefill.py                          # Qwen3-30B-A3B shape, 48 layers, 4k/8k/16k prompts
    python benchmarks/prefill.py --layers 12 --prompts 4096,8192 --json

Every 8192-token chunk streams the whole expert pool across PCIe once, so the floor of one chunk is
pool bytes / B_P, with B_P measured through the runtime's own fill path (or taken from the machine's
`bench bw` profile). Variants: stream (double buffering, the default), serial (copy, then compute:
--disable-moe-prefill-overlap), hit-d2d (resident experts copied on the device), on-demand (streaming
off; the shortest prompt only). The expert cache is capped (default 37% of the pool).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import torch
from decode_offload import bandwidths
from rich.console import Console
from rich.table import Table

from freetoken.replay.synthetic import synthetic_engine, uniform_routing
from freetoken.runtime.config import MoeConfig
from freetoken.runtime.devices import sync_device
from freetoken.runtime.engine import Engine
from freetoken.runtime.loading.demo import DEMO_SPEC, QWEN3_30B_A3B_SPEC
from freetoken.runtime.measure.profile import load_profile

VARIANTS = {
    "stream": {"prefill_stream": "on"},
    "serial": {"prefill_stream": "on", "prefill_overlap": False},
    "hit-d2d": {"prefill_stream": "on", "prefill_hit_d2d": True},
    "on-demand": {"prefill_stream": "off"},
}


def timed_prefill(engine: Engine, tokens: int, seed: int) -> float:
    ids = torch.randint(0, engine.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(seed))
    seq = engine.new_sequence()
    sync_device(engine.device)
    t0 = time.perf_counter()
    engine.prefill(seq, ids.tolist())
    sync_device(engine.device)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, help="override the layer count (48 for Qwen3-30B-A3B)")
    ap.add_argument("--ratio", type=float, default=0.37, help="expert cache as a fraction of the pool")
    ap.add_argument("--prompts", default="4096,8192,16384", help="prompt lengths in tokens")
    ap.add_argument("--chunk", type=int, default=8192, help="--max-prefill-tokens")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="a subset of: " + ", ".join(VARIANTS))
    ap.add_argument("--backend", default="offload", help="the cached backend decode would use")
    ap.add_argument("--device", default="cuda", help="cuda; cpu stands in for a smoke test with --small")
    ap.add_argument("--small", action="store_true", help="the demo shape instead of Qwen3-30B-A3B")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    base = DEMO_SPEC if args.small else QWEN3_30B_A3B_SPEC
    spec = replace(base, num_layers=args.layers or base.num_layers)
    prompts = [int(p) for p in args.prompts.split(",")]
    engine = synthetic_engine(spec, args.device, MoeConfig("cpu", cache_size=0), dtype="bfloat16")
    engine.engine_config = replace(engine.engine_config, max_prefill_tokens=args.chunk)
    uniform_routing(engine)  # a real long prompt routes to nearly every expert; random weights do not
    profile = load_profile()
    b_p = (
        profile.b_p if profile is not None and profile.b_p else bandwidths(engine, torch.get_num_threads())[0]
    )
    pool_bytes = engine.pool.nbytes
    floor_chunk = pool_bytes / b_p if b_p else float("nan")
    rows = []
    for name in args.variants.split(","):
        engine.configure_moe(
            MoeConfig(args.backend, cache_ratio=args.ratio, reprofile=False, **VARIANTS[name])  # type: ignore[arg-type]
        )
        timed_prefill(engine, min(prompts[0], args.chunk), seed=99)  # warm: kernels, allocator, slots
        lengths = prompts[:1] if name == "on-demand" else prompts
        for tokens in lengths:
            engine.moe_counters.reset()
            seconds = timed_prefill(engine, tokens, seed=tokens)
            chunks = -(-tokens // args.chunk)
            totals = engine.moe_counters.totals()
            rows.append(
                {
                    "variant": name,
                    "prompt": tokens,
                    "chunks": chunks,
                    "seconds": seconds,
                    "per_chunk_s": seconds / chunks,
                    "floor_chunk_s": floor_chunk,
                    "over_floor": seconds / chunks / floor_chunk,
                    "tok_s": tokens / seconds,
                    "streamed_GB": totals["streamed"] * engine.pool.expert_nbytes / 1e9,
                    "fetched_GB": totals["fills"] * engine.pool.expert_nbytes / 1e9,
                }
            )
    engine.close()
    base_s = {r["prompt"]: r["seconds"] for r in rows if r["variant"] == "stream"}
    for r in rows:
        r["vs_stream"] = r["seconds"] / base_s[r["prompt"]] if r["prompt"] in base_s else None
    doc = {
        "shape": "demo" if args.small else "qwen3-30b-a3b",
        "layers": spec.num_layers,
        "cache_ratio": args.ratio,
        "slots": engine.num_slots,
        "pool_GB": pool_bytes / 1e9,
        "B_P_GBps": (b_p or 0.0) / 1e9,
        "B_P_from_profile": bool(profile is not None and profile.b_p),
        "chunk": args.chunk,
        "rows": rows,
    }
    if args.json:
        print(json.dumps(doc, indent=2))
        return
    table = Table(
        title=f"prefill, {doc['shape']} shape, {spec.num_layers} layers, pool {doc['pool_GB']:.1f} GB, "
        f"cache {args.ratio:.0%} · B_P {doc['B_P_GBps']:.1f} GB/s · "
        f"floor {floor_chunk:.3f} s per {args.chunk}-token chunk"
    )
    for col in ("variant", "prompt", "s", "s/chunk", "× floor", "tok/s", "× stream", "PCIe GB"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["variant"],
            str(r["prompt"]),
            f"{r['seconds']:.3f}",
            f"{r['per_chunk_s']:.3f}",
            f"{r['over_floor']:.2f}",
            f"{r['tok_s']:.0f}",
            "—" if r["vs_stream"] is None else f"{r['vs_stream']:.2f}",
            f"{r['streamed_GB'] + r['fetched_GB']:.1f}",
        )
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
