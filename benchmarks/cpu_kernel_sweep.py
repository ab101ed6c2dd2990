"""Compile variants of the CPU expert kernel and time them at batch 1 beside the host read ceiling.

    python benchmarks/cpu_kernel_sweep.py [--threads 14,16] [--passes 2] [--rounds 5] [--json]

Each variant is the shipped source with other -D values (accumulator lanes, how phase 2 splits the rows
of `down`, software prefetch distance in elements, the order phase 1 walks the gate and up rows), run on
a pool in 4 KiB pages and on one in transparent huge pages, each against a STREAM-like read of the same
kind of pages measured right before it (a shared host drifts, so `--passes` goes through the list more
than once). Then the shipped kernel three ways, interleaved with the read over `--rounds`: alone, through
cpu_experts (the runtime's entry point) and as `bench bw` measures B_H; the ratios are medians of each
round's own ratio.
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
from freetoken.runtime.moe.pool import HUGE_PAGES

# (lanes, down split: 0 blocks of 128 rows dealt out, 1 one even run per thread, 2 dynamic runs of 32;
#  prefetch elements; row order: 0 gate then up, 1 both in one loop, 2 memory order; fused multiply-add)
VARIANTS = [
    (32, 1, 2048, 2, 0),
    (32, 1, 0, 2, 0),
    (64, 1, 0, 2, 0),
    (32, 2, 0, 2, 0),
    (32, 1, 0, 2, 1),
    (32, 2, 0, 2, 1),
    (64, 2, 0, 2, 1),
]


def build(folder: Path, lanes: int, split: int, prefetch: int, order: int, fma: int) -> ctypes.CDLL:
    out = folder / f"k_{lanes}_{split}_{prefetch}_{order}_{fma}.so"
    subprocess.run(
        [
            find_compiler(),
            *FLAGS,
            f"-DLANES={lanes}",
            f"-DDOWN_SPLIT={split}",
            f"-DPREFETCH={prefetch}",
            f"-DROW_ORDER={order}",
            *(["-ffp-contract=fast"] if fma else []),
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


def sweep(libs: dict, pools: dict[bool, Bench], threads: int, passes: int) -> list[dict]:
    rows = []
    for _ in range(passes):
        for (lanes, split, prefetch, order, fma), lib in libs.items():
            for huge, bench in pools.items():
                read = read_bandwidth(threads=threads, huge_pages=huge)  # right beside each variant
                best, median = time_variant(lib, bench.pool.gate_up[0], bench.pool.down[0], threads)
                rows.append(
                    {
                        "threads": threads,
                        "lanes": lanes,
                        "down_split": split,
                        "prefetch": prefetch,
                        "row_order": order,
                        "fma": fma,
                        "huge_pages": huge,
                        "GBps": best,
                        "median_GBps": median,
                        "read_GBps": read / 1e9,
                        "of_read": best * 1e9 / read,
                    }
                )
    return rows


def paths(pools: dict[bool, Bench], threads: int, rounds: int) -> list[dict]:
    """The shipped kernel alone, through cpu_experts and as B_H, each round beside its own read."""
    shipped = load_library()
    out = []
    for huge, bench in pools.items():
        bench.threads = threads
        gu, dn = bench.pool.gate_up[0], bench.pool.down[0]
        ratios: dict[str, list[float]] = {"kernel": [], "cpu_experts": [], "b_h": []}
        reads = []
        for _ in range(rounds):
            read = read_bandwidth(threads=threads, huge_pages=huge)
            reads.append(read / 1e9)
            if shipped is not None:
                ratios["kernel"].append(time_variant(shipped, gu, dn, threads)[0] * 1e9 / read)
            ratios["cpu_experts"].append(time_wrapper(gu, dn, threads)[0] * 1e9 / read)
            ratios["b_h"].append(bench.host_bw() / read)
        row = {"threads": threads, "huge_pages": huge, "read_GBps": statistics.median(reads)}
        row.update({f"{k}_of_read": statistics.median(v) for k, v in ratios.items() if v})
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default=str(torch.get_num_threads()), help="thread counts, comma-separated")
    ap.add_argument(
        "--passes", type=int, default=2, help="times through the variant list (a shared host drifts)"
    )
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the shipped kernel's paths")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    counts = [int(t) for t in args.threads.split(",")]
    # pools of several times the last-level cache, in both kinds of pages
    pools = {huge: Bench(PRESETS["qwen3-30b-a3b"], counts[0], huge_pages=huge) for huge in (False, True)}
    with tempfile.TemporaryDirectory() as tmp:
        libs = {v: build(Path(tmp), *v) for v in VARIANTS}
        rows = [row for t in counts for row in sweep(libs, pools, t, args.passes)]
    shipped = [row for t in counts for row in paths(pools, t, args.rounds)]
    doc = {
        "llc_MiB": llc_bytes() / 2**20,
        "pool_huge_pages_default": HUGE_PAGES,
        "variants": rows,
        "shipped": shipped,
    }
    if args.json:
        print(json.dumps(doc, indent=2))
        return
    print("each row's read ceiling is measured right before it, in the same kind of pages")
    for r in rows:
        print(
            f"{r['threads']:3d} thr  lanes {r['lanes']:3d}  split {r['down_split']}  "
            f"prefetch {r['prefetch']:5d}  order {r['row_order']}  fma {r['fma']}  huge {r['huge_pages']:d}  "
            f"{r['GBps']:6.1f} GB/s "
            f"(median {r['median_GBps']:6.1f})  read {r['read_GBps']:6.1f}  {r['of_read']:.2f} × read"
        )
    print("shipped kernel, median of per-round ratios to the read beside it:")
    for r in shipped:
        print("  " + "  ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()))


if __name__ == "__main__":
    main()
