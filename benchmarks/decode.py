"""Prefill and decode speed per MoE backend on one model, beside the memory-bandwidth floor.

    python benchmarks/decode.py --spec demo
    python benchmarks/decode.py --spec qwen3-30b-a3b --layers 8 --device cuda --backends fused,cpu --json

The floor of one decode step is the bytes it must read (dense weights, the lm head, and the top-k
experts of every MoE layer) over the device's measured copy bandwidth; `x floor` is measured time
over that floor (1.0 is perfect).
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

from freetoken.runtime.devices import sync_device
from freetoken.runtime.engine import Engine, build_engine
from freetoken.runtime.loading.demo import DEMO_SPEC, QWEN3_30B_A3B_SPEC, write_random_model
from freetoken.runtime.sampling import SamplingParams

SPECS = {"demo": DEMO_SPEC, "qwen3-30b-a3b": QWEN3_30B_A3B_SPEC}


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes per second moved by a device-to-device copy (read plus write)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync_device(device)
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    sync_device(device)
    return 2 * nbytes * 5 / (time.perf_counter() - t0)


def step_bytes(engine: Engine) -> int:
    """Bytes one decode step reads: every dense parameter plus top-k experts per MoE layer."""
    dense = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    experts = len(engine.config.moe_layers) * engine.config.num_experts_per_tok * engine.pool.expert_nbytes
    return dense + experts


def measure(engine: Engine, prompt_tokens: int, decode_tokens: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    vocab = min(engine.config.vocab_size, engine.tokenizer.vocab_size)
    prompt = torch.randint(0, vocab, (prompt_tokens,), generator=gen).tolist()
    params = SamplingParams(max_tokens=decode_tokens, ignore_eos=True)
    list(engine.generate(prompt[:16], SamplingParams(max_tokens=4, ignore_eos=True)))  # warm up
    engine.reset()  # no prefix reuse between runs
    events = list(engine.generate(prompt, params))
    stats = events[-1].stats
    assert stats is not None
    return {
        "prefill_tok_s": stats.prefill_tok_s,
        "decode_tok_s": stats.decode_tok_s,
        "decode_ms": 1000.0 / stats.decode_tok_s if stats.decode_tok_s else float("nan"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="an HF model folder (default: generate --spec)")
    ap.add_argument("--spec", choices=sorted(SPECS), default="demo")
    ap.add_argument("--layers", type=int, help="override the spec's layer count (smaller, faster to make)")
    ap.add_argument("--backends", default="fused,cpu")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="ft-bench-") as tmp:
        folder = args.model
        if folder is None:
            spec = SPECS[args.spec]
            if args.layers:
                spec = replace(spec, num_layers=args.layers)
            t0 = time.perf_counter()
            folder = write_random_model(Path(tmp) / "model", spec)
            made_s = time.perf_counter() - t0
        else:
            made_s = 0.0
        rows = []
        for backend in args.backends.split(","):
            t0 = time.perf_counter()
            engine = build_engine(folder, args.device, args.dtype, backend)
            load_s = time.perf_counter() - t0
            result = measure(engine, args.prompt_tokens, args.decode_tokens)
            bandwidth = copy_bandwidth(engine.device)
            floor_ms = 1000.0 * step_bytes(engine) / bandwidth
            rows.append(
                {
                    "backend": backend,
                    "device": str(engine.device),
                    "dtype": str(engine.dtype),
                    "load_s": load_s,
                    **result,
                    "floor_ms": floor_ms,
                    "x_floor": result["decode_ms"] / floor_ms,
                    "device_copy_GBps": bandwidth / 1e9,
                    "pool_GiB": engine.pool.nbytes / 2**30,
                }
            )
            del engine
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    doc = {"model": str(args.model or args.spec), "layers": args.layers, "made_s": made_s, "rows": rows}
    if args.json:
        print(json.dumps(doc, indent=2))
        return
    table = Table(title=f"decode: {doc['model']} (prompt {args.prompt_tokens}, decode {args.decode_tokens})")
    for col in (
        "backend",
        "device",
        "pool GiB",
        "load s",
        "prefill tok/s",
        "decode tok/s",
        "decode ms",
        "floor ms",
        "x floor",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["backend"],
            r["device"],
            f"{r['pool_GiB']:.2f}",
            f"{r['load_s']:.1f}",
            f"{r['prefill_tok_s']:.0f}",
            f"{r['decode_tok_s']:.1f}",
            f"{r['decode_ms']:.2f}",
            f"{r['floor_ms']:.3f}",
            f"{r['x_floor']:.1f}",
        )
    Console().print(table)


if __name__ == "__main__":
    main()
