"""Compile variants of the CPU expert kernel and time them at batch 1 beside the host read ceiling.

    python benchmarks/cpu_kernel_sweep.py [--threads 16] [--json]

Each variant is the shipped source with other -D values (accumulator lanes, rows of `down` per work
item, software prefetch distance in elements, gate and up rows in one loop); the table says which one
the machine likes, against a STREAM-like read measured right before each row (a shared host drifts).
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
from freetoken.runtime.moe.kernels.cpu_experts import cpu_experts, read_bandwidth
from freetoken.runtime.moe.kernels.loader import FLAGS, SOURCE, find_compiler, load_library

# (lanes, down block, prefetch elements, gate and up in one loop)
VARIANTS = [
    (32, 32, 0, 0),
    (32, 32, 0, 1),
    (16, 32, 0, 1),
    (32, 32, 256, 0),
    (32, 32, 1024, 0),
    (32, 32, 512, 1),
    (64, 32, 0, 0),
    (32, 128, 0, 0),
    (32, 128, 0, 1),
]


def build(folder: Path, lanes: int, block: int, prefetch: int, fuse: int) -> ctypes.CDLL:
    out = folder / f"k_{lanes}_{block}_{prefetch}_{fuse}.so"
    subprocess.run(
        [
            find_compiler(),
            *FLAGS,
            f"-DLANES={lanes}",
            f"-DDOWN_BLOCK={block}",
            f"-DPREFETCH={prefetch}",
            f"-DFUSE_GATE_UP={fuse}",
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


def time_wrapper(gu: torch.Tensor, dn: torch.Tensor, threads: int, k: int = 8) -> float:
    e, two_i, h = gu.shape
    x = torch.randn(1, h)
    w = torch.full((1, k), 1.0 / k)
    best = float("inf")
    for rep in range(12):
        ids = torch.tensor([[(rep * k + j) % e for j in range(k)]])
        t0 = time.perf_counter()
        cpu_experts(x, ids, w, gu, dn, threads)
        if rep >= 2:
            best = min(best, time.perf_counter() - t0)
    return k * 3 * h * (two_i // 2) * 2 / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--experts", type=int, default=96, help="pool size (keep it far above the LLC)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    h, i = 2048, 768  # Qwen3-30B-A3B experts
    gu = (torch.randn(args.experts, 2 * i, h) * 0.02).bfloat16()
    dn = (torch.randn(args.experts, h, i) * 0.02).bfloat16()
    rows: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for lanes, block, prefetch, fuse in VARIANTS:
            lib = build(Path(tmp), lanes, block, prefetch, fuse)
            # The read ceiling right beside each variant: on a shared host it drifts between minutes.
            read = read_bandwidth(threads=args.threads)
            bw = time_variant(lib, gu, dn, args.threads)
            rows.append(
                {
                    "lanes": lanes,
                    "down_block": block,
                    "prefetch": prefetch,
                    "fuse_gate_up": fuse,
                    "GBps": bw / 1e9,
                    "read_GBps": read / 1e9,
                    "of_read": bw / read,
                }
            )
    # The same kernel through the runtime's wrapper, on a pool that is pinned when CUDA is present
    # (bench bw's B_H): the gap to the rows above is what the wrapper and the pool's pages cost.
    bench = Bench(PRESETS["qwen3-30b-a3b"], args.threads)
    read = read_bandwidth(threads=args.threads)
    runtime = {"pinned": bench.cuda, "GBps": bench.host_bw() / 1e9, "read_GBps": read / 1e9}
    if bench.cuda:  # and on an unpinned copy of the same experts
        plain = Bench(PRESETS["qwen3-30b-a3b"], args.threads, pin=False)
        runtime["unpinned_GBps"] = plain.host_bw() / 1e9
    # Where a gap between the two comes from: the shipped kernel called directly on the pool's banks,
    # and the runtime's wrapper on the plain tensors of the rows above.
    shipped = load_library()
    if shipped is not None:
        pool = bench.pool
        runtime["kernel_on_pool_GBps"] = (
            time_variant(shipped, pool.gate_up[0], pool.down[0], args.threads) / 1e9
        )
    runtime["wrapper_on_plain_GBps"] = time_wrapper(gu, dn, args.threads) / 1e9
    doc = {"threads": args.threads, "variants": rows, "runtime_path": runtime}
    if args.json:
        print(json.dumps(doc, indent=2))
        return
    print(f"{args.threads} threads; each row's read ceiling is measured right before it")
    print(f"runtime path: {runtime}")
    for r in rows:
        print(
            f"lanes {r['lanes']:3d}  down block {r['down_block']:4d}  prefetch {r['prefetch']:5d}  "
            f"fused g/u {r['fuse_gate_up']}  "
            f"{r['GBps']:6.1f} GB/s  read {r['read_GBps']:6.1f}  {r['of_read']:.2f} × read"
        )


if __name__ == "__main__":
    main()
