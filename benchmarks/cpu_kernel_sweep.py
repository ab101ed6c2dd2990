"""Compile variants of the CPU expert kernel and time them at batch 1 beside the host read ceiling.

    python benchmarks/cpu_kernel_sweep.py [--threads 16] [--json]

Each variant is the shipped source with other -D values (accumulator lanes, rows of `down` per work
item); the table says which one the machine likes, against the STREAM-like read in the same run.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from freetoken.runtime.bandwidth import PRESETS, Bench
from freetoken.runtime.moe.kernels.cpu_experts import read_bandwidth
from freetoken.runtime.moe.kernels.loader import FLAGS, SOURCE, find_compiler

VARIANTS = [(16, 32), (32, 8), (32, 32), (32, 128), (64, 32)]


def build(folder: Path, lanes: int, block: int) -> ctypes.CDLL:
    out = folder / f"k_{lanes}_{block}.so"
    subprocess.run(
        [
            find_compiler(),
            *FLAGS,
            f"-DLANES={lanes}",
            f"-DDOWN_BLOCK={block}",
            str(SOURCE),
            "-o",
            str(out),
            "-lm",
        ],
        check=True,
    )
    lib = ctypes.CDLL(str(out))
    lib.ft_experts_bf16.argtypes = (
        [ctypes.c_void_p] * 2 + [ctypes.c_int] * 3 + [ctypes.c_void_p] * 6 + [ctypes.c_int]
    )
    return lib


def time_variant(lib: ctypes.CDLL, gu: torch.Tensor, dn: torch.Tensor, threads: int, k: int = 8) -> float:
    e, two_i, h = gu.shape
    i = two_i // 2
    x = torch.randn(1, h)
    tok = torch.zeros(k, dtype=torch.int32)
    w = torch.full((k,), 1.0 / k)
    off = torch.arange(k + 1, dtype=torch.int32)
    act = torch.empty(k, i)
    out = torch.zeros(1, h)
    best = float("inf")
    for rep in range(12):
        experts = [(rep * k + j) % e for j in range(k)]
        gp = (ctypes.c_void_p * k)(*(gu.data_ptr() + x_ * gu.stride(0) * 2 for x_ in experts))
        dp = (ctypes.c_void_p * k)(*(dn.data_ptr() + x_ * dn.stride(0) * 2 for x_ in experts))
        t0 = time.perf_counter()
        lib.ft_experts_bf16(
            gp,
            dp,
            k,
            h,
            i,
            x.data_ptr(),
            tok.data_ptr(),
            w.data_ptr(),
            off.data_ptr(),
            act.data_ptr(),
            out.data_ptr(),
            threads,
        )
        if rep >= 2:
            best = min(best, time.perf_counter() - t0)
    return k * 3 * h * i * 2 / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--experts", type=int, default=96, help="pool size (keep it far above the LLC)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    h, i = 2048, 768  # Qwen3-30B-A3B experts
    gu = (torch.randn(args.experts, 2 * i, h) * 0.02).bfloat16()
    dn = (torch.randn(args.experts, h, i) * 0.02).bfloat16()
    read = read_bandwidth(threads=args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for lanes, block in VARIANTS:
            bw = time_variant(build(Path(tmp), lanes, block), gu, dn, args.threads)
            rows.append({"lanes": lanes, "down_block": block, "GBps": bw / 1e9, "of_read": bw / read})
    # The same kernel through the runtime's wrapper, on a pool that is pinned when CUDA is present
    # (bench bw's B_H): the gap to the rows above is what the wrapper and the pool's pages cost.
    bench = Bench(PRESETS["qwen3-30b-a3b"], args.threads)
    runtime = {"pinned": bench.cuda, "GBps": bench.host_bw() / 1e9}
    if bench.cuda:  # and on an unpinned copy of the same experts
        plain = Bench(PRESETS["qwen3-30b-a3b"], args.threads, pin=False)
        runtime["unpinned_GBps"] = plain.host_bw() / 1e9
    doc = {"threads": args.threads, "host_read_GBps": read / 1e9, "variants": rows, "runtime_path": runtime}
    if args.json:
        print(json.dumps(doc, indent=2))
        return
    print(f"host read {read / 1e9:.1f} GB/s, {args.threads} threads")
    print(f"runtime path: {runtime}")
    for r in rows:
        print(
            f"lanes {r['lanes']:3d}  down block {r['down_block']:4d}  {r['GBps']:6.1f} GB/s  "
            f"{r['of_read']:.2f} × read"
        )


if __name__ == "__main__":
    main()
