"""FreeToken beside llama.cpp on the same GGUF at the same expert budget, in one run.

    python benchmarks/peer_llamacpp.py --llama-bench .peers/llama-build-cuda/bin/llama-bench \\
        --gguf /dev/shm/q30.gguf --device cuda --budgets 1,0.375
    python benchmarks/peer_llamacpp.py --llama-bench .peers/llama-build-cpu/bin/llama-bench \\
        --gguf small.gguf --device cpu --threads 2 --json

A budget is the fraction of the expert bytes on the GPU. llama.cpp gets `-ngl 99 -ncmoe N` with N =
round((1 - budget) · layers) (layers whose experts stay in host memory); FreeToken gets `fused` at 1
and `--moe-backend BACKEND --moe-cache-ratio (layers - N) / layers` below it, the same bytes. On a cpu
device both run everything on the host (`-ngl 0`; FreeToken's `cpu` backend). Prefill: one prompt of
`--prompt` tokens (llama-bench pp); decode: `--gen` tokens after it (tg). Random weights route unevenly,
so a cache hits more than on a real model: say so beside any figure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from freetoken.runtime.devices import sync_device
from freetoken.runtime.engine import Engine, build_engine


def llama_bench(
    binary: Path, gguf: Path, device: str, offloaded: int, threads: int, prompt: int, gen: int
) -> dict[str, float]:
    """llama-bench's pp and tg tokens per second (its own mean over repetitions)."""
    args = [str(binary), "-m", str(gguf), "-t", str(threads), "-p", str(prompt), "-n", str(gen), "-o", "json"]
    args += ["-ngl", "99", "-ncmoe", str(offloaded), "-fa", "1"] if device != "cpu" else ["-ngl", "0"]
    env = {**os.environ, "LD_LIBRARY_PATH": f"{binary.parent}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    done = subprocess.run(args, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"llama-bench failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    out = {}
    for row in json.loads(done.stdout):
        kind = "prefill_tok_s" if row.get("n_prompt", 0) > 0 and row.get("n_gen", 0) == 0 else "decode_tok_s"
        out[kind] = float(row["avg_ts"])
    return out


def freetoken_bench(engine: Engine, prompt: int, gen: int) -> dict[str, float]:
    """Prefill `prompt` tokens, then `gen` greedy decode steps: tokens per second of each (warmed up)."""
    vocab = engine.config.vocab_size
    ids = [(7 * i + 11) % vocab for i in range(prompt)]
    warm = engine.new_sequence()  # warm-up: prefill and decode kernels compiled, caches touched
    token = int(engine.prefill(warm, ids[:32])[-1].argmax())
    for _ in range(4):
        token = int(engine.decode_batch([warm], [token])[-1].argmax())
    seq = engine.new_sequence()
    sync_device(engine.device)
    start = time.perf_counter()
    token = int(engine.prefill(seq, ids)[-1].argmax())
    sync_device(engine.device)
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(gen):
        token = int(engine.decode_batch([seq], [token])[-1].argmax())
    decode_s = time.perf_counter() - start
    return {"prefill_tok_s": prompt / prefill_s, "decode_tok_s": gen / decode_s}


def layer_count(gguf: Path) -> int:
    from gguf import GGUFReader

    reader = GGUFReader(gguf)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    return int(reader.fields[f"{arch}.block_count"].parts[-1][0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bench", type=Path, required=True, help="llama-bench built by build_llamacpp.sh")
    ap.add_argument("--gguf", type=Path, required=True, help="e.g. made by make_qwen3moe_gguf.py")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--budgets", default="1,0.375", help="fractions of the expert bytes on the GPU")
    ap.add_argument("--backend", default="offload", help="FreeToken's backend below a budget of 1")
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    layers = layer_count(args.gguf)
    rows: list[dict[str, Any]] = []
    budgets = [1.0] if args.device == "cpu" else [float(b) for b in args.budgets.split(",")]
    for budget in budgets:
        offloaded = 0 if args.device == "cpu" else round((1 - budget) * layers)
        ratio = (layers - offloaded) / layers
        peer = llama_bench(
            args.llama_bench, args.gguf, args.device, offloaded, args.threads, args.prompt, args.gen
        )
        if args.device == "cpu":
            options: dict[str, Any] = {"moe_backend": "cpu", "cpu_threads": args.threads}
        elif offloaded == 0:
            options = {"moe_backend": "fused"}
        else:
            options = {"moe_backend": args.backend, "cache_ratio": ratio, "cpu_threads": args.threads}
        engine = build_engine(args.gguf, device=args.device, dtype="auto", **options)
        ours = freetoken_bench(engine, args.prompt, args.gen)
        engine.close()
        del engine
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        rows.append(
            {
                "budget": ratio,
                "llama_cpp": {"ncmoe": offloaded, **peer},
                "freetoken": {**options, **ours},
                "ratio": {k: ours[k] / peer[k] for k in ours if peer.get(k)},
            }
        )
    doc = {"gguf": str(args.gguf), "layers": layers, "device": args.device, "threads": args.threads,
           "prompt": args.prompt, "gen": args.gen, "rows": rows}  # fmt: skip
    if args.json:
        print(json.dumps(doc, indent=1))
        return
    print(f"{args.gguf.name} · {layers} layers · {args.device} · pp{args.prompt} / tg{args.gen}")
    print(f"{'budget':>7} {'engine':>10} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for row in rows:
        for name in ("llama_cpp", "freetoken"):
            r = row[name]
            print(f"{row['budget']:>7.3f} {name:>10} {r['prefill_tok_s']:>14.1f} {r['decode_tok_s']:>13.1f}")
        ratio = row["ratio"]
        print(f"{'':>7} {'ours/peer':>10} {ratio['prefill_tok_s']:>14.2f} {ratio['decode_tok_s']:>13.2f}")


if __name__ == "__main__":
    main()
