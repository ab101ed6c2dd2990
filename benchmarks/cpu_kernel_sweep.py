"""Compile variants of the CPU expert kernel and time them at batch 1 beside the host read ceiling.

    python benchmarks/cpu_kernel_sweep.py [--threads 16] [--json]

Each variant is the shipped source with other -D values (accumulator lanes, rows of `down` per work
item, software prefetch distance in elements, the order phase 1 walks the gate and up rows); the table
says which one the machine likes, against a STREAM-like read measured right before each row (a shared
host drifts, so `--passes` goes through the list more than once).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from freetoken.runtime.bandwidth import PRESETS, Bench
from freetoken.runtime.moe.kernels.cpu_experts import cpu_experts, llc_bytes, read_bandwidth
from freetoken.runtime.moe.kernels.loader import FLAGS, SOURCE, find_compiler, load_library

# (lanes, down block, prefetch elements, row order: 0 gate then up, 1 both in one loop, 2 memory order)
VARIANTS = [
    (32, 32, 0, 2),
    (32, 32, 0, 0),
    (32, 32, 0, 1),
    (32, 32, 1024, 2),
    (32, 32, 2048, 2),
    (16, 32, 0, 2),
    (32, 128, 0, 2),
    (32, 128, 2048, 2),
]


def build(folder: Path, lanes: int, block: int, prefetch: int, order: int) -> ctypes.CDLL:
    out = folder / f"k_{lanes}_{block}_{prefetch}_{order}.so"
    subprocess.run(
        [
            find_compiler(),
            *FLAGS,
            f"-DLANES={lanes}",
            f"-DDOWN_BLOCK={block}",
            f"-DPREFETCH={prefetch}",
            f"-DROW_ORDER={order}",
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


def _gbps(nbytes: int, seconds: list[float]) -> tuple[float, float]:
    """(best, median) GB/s over the timed calls."""
    return nbytes / min(seconds) / 1e9, nbytes / statistics.median(seconds) / 1e9


def time_variant(
    lib: ctypes.CDLL, gu: torch.Tensor, dn: torch.Tensor, threads: int, k: int = 8, reps: int = 20
) -> tuple[float, float]:
    """The kernel alone on k fresh experts per call, batch 1: (best, median) GB/s of weights."""
    e, two_i, h = gu.shape
    x = torch.randn(1, h)
    tok = torch.zeros(k, dtype=torch.int32)
    w = torch.full((k,), 1.0 / k)
    off = torch.arange(k + 1, dtype=torch.int32)
    scratch = torch.empty(k, two_i)
    out = torch.zeros(1, h)
    seconds = []
    for rep in range(reps + 2):
        experts = [(rep * k + j) % e for j in range(k)]
        gp = (ctypes.c_void_p * k)(*(gu.data_ptr() + x_ * gu.stride(0) * 2 for x_ in experts))
        dp = (ctypes.c_void_p * k)(*(dn.data_ptr() + x_ * dn.stride(0) * 2 for x_ in experts))
        t0 = time.perf_counter()
        lib.ft_experts_bf16(
            gp,
            dp,
            k,
            h,
            two_i // 2,
            x.data_ptr(),
            tok.data_ptr(),
            w.data_ptr(),
            off.data_ptr(),
            scratch.data_ptr(),
            out.data_ptr(),
            threads,
        )
        if rep >= 2:
            seconds.append(time.perf_counter() - t0)
    return _gbps(k * 3 * h * (two_i // 2) * 2, seconds)


def time_wrapper(
    gu: torch.Tensor, dn: torch.Tensor, threads: int, k: int = 8, reps: int = 20
) -> tuple[float, float]:
    """The same through cpu_experts, the runtime's entry point (routing plan, scratch, output)."""
    e, two_i, h = gu.shape
    x = torch.randn(1, h)
    w = torch.full((1, k), 1.0 / k)
    seconds = []
    for rep in range(reps + 2):
        ids = torch.tensor([[(rep * k + j) % e for j in range(k)]])
        t0 = time.perf_counter()
        cpu_experts(x, ids, w, gu, dn, threads)
        if rep >= 2:
            seconds.append(time.perf_counter() - t0)
    return _gbps(k * 3 * h * (two_i // 2) * 2, seconds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument(
        "--passes", type=int, default=2, help="times through the variant list (a shared host drifts)"
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    bench = Bench(PRESETS["qwen3-30b-a3b"], args.threads)  # a pool of several times the last-level cache
    gu, dn = bench.pool.gate_up[0], bench.pool.down[0]
    rows: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        libs = {v: build(Path(tmp), *v) for v in VARIANTS}
        for _ in range(args.passes):
            for (lanes, block, prefetch, order), lib in libs.items():
                read = read_bandwidth(threads=args.threads)  # right beside each variant
                best, median = time_variant(lib, gu, dn, args.threads)
                rows.append(
                    {
                        "lanes": lanes,
                        "down_block": block,
                        "prefetch": prefetch,
                        "row_order": order,
                        "GBps": best,
                        "median_GBps": median,
                        "read_GBps": read / 1e9,
                        "of_read": best * 1e9 / read,
                    }
                )
    # The shipped kernel three ways beside one read: alone, through cpu_experts, and as bench bw's B_H.
    read = read_bandwidth(threads=args.threads)
    shipped = load_library()
    runtime: dict[str, float] = {"read_GBps": read / 1e9, "llc_MiB": llc_bytes() / 2**20}
    if shipped is not None:
        runtime["kernel_GBps"], runtime["kernel_median_GBps"] = time_variant(shipped, gu, dn, args.threads)
    runtime["cpu_experts_GBps"], runtime["cpu_experts_median_GBps"] = time_wrapper(gu, dn, args.threads)
    runtime["b_h_GBps"] = bench.host_bw() / 1e9
    doc = {"threads": args.threads, "variants": rows, "shipped": runtime}
    if args.json:
        print(json.dumps(doc, indent=2))
        return
    print(f"{args.threads} threads; each row's read ceiling is measured right before it")
    for r in rows:
        print(
            f"lanes {r['lanes']:3d}  down block {r['down_block']:4d}  prefetch {r['prefetch']:5d}  "
            f"row order {r['row_order']}  {r['GBps']:6.1f} GB/s (median {r['median_GBps']:6.1f})  "
            f"read {r['read_GBps']:6.1f}  {r['of_read']:.2f} × read"
        )
    print("shipped: " + "  ".join(f"{k} {v:.1f}" for k, v in runtime.items()))


if __name__ == "__main__":
    main()
