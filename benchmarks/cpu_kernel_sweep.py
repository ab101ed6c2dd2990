"""Compile variants of the CPU expert kernel and time them at batch 1 beside the host read ceiling.

    python benchmarks/cpu_kernel_sweep.py [--threads 14,16] [--rounds 5] [--huge-pages] [--json]

Each variant is the shipped source with other -D values (accumulator lanes, bytes per unit of work,
software prefetch distance in elements). A shared host's read drifts from one second to the next, so
every round measures the STREAM-like read ceiling first and then each variant, and each variant's
figure is the median over rounds of its ratio to that round's read. Each round also times the shipped
kernel the three ways the runtime reaches it (alone, through cpu_experts, as `bench bw` measures B_H)
and traces one call: when each thread took its first unit and finished its last, how long it waited.
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

from freetoken.runtime.measure.bandwidth import PRESETS, Bench
from freetoken.runtime.moe.kernels.cpu_experts import cpu_experts, llc_bytes, read_bandwidth, run_kernel
from freetoken.runtime.moe.kernels.loader import FLAGS, SOURCES, declare, find_compiler, load_library

# (accumulator lanes, KiB of weights per unit of work, prefetch distance in bf16 elements); first: the
# source defaults (the loader builds with PREFETCH 0 where more than 4 cores are allowed)
VARIANTS = [(32, 256, 1024), (32, 256, 0), (32, 64, 1024), (32, 1024, 1024), (32, 256, 2048), (64, 256, 1024)]
K = 8  # experts per call: a Qwen3 layer step with every routed expert on the CPU


def build(folder: Path, lanes: int, unit_kib: int, prefetch: int) -> ctypes.CDLL:
    out = folder / f"k_{lanes}_{unit_kib}_{prefetch}.so"
    defines = [f"-DLANES={lanes}", f"-DUNIT_BYTES=({unit_kib}<<10)", f"-DPREFETCH={prefetch}"]
    cmd = [find_compiler(), *FLAGS, *defines, *map(str, SOURCES), "-o", str(out), "-lm", "-lpthread"]
    subprocess.run(cmd, check=True)
    lib = ctypes.CDLL(str(out))
    declare(lib)
    return lib


class Calls:
    """Batch-1 layer steps of K experts, rotating through a pool larger than the caches."""

    def __init__(self, bench: Bench, threads: int) -> None:
        self.gu, self.dn = bench.pool.gate_up[0], bench.pool.down[0]
        self.threads = threads
        self.x = torch.randn(1, self.gu.shape[2])
        self.w = torch.full((1, K), 1.0 / K)
        self.out = torch.empty(1, self.gu.shape[2])
        self.nbytes = K * (self.gu[0].numel() + self.dn[0].numel()) * 2
        self._next = 0

    def ids(self) -> torch.Tensor:
        e = self.gu.shape[0]
        ids = torch.tensor([[(self._next + j) % e for j in range(K)]])
        self._next = (self._next + K) % e
        return ids

    def gbps(self, call, reps: int = 20) -> float:
        """Best GB/s of weights over `reps` calls (two more first, untimed)."""
        best = float("inf")
        for rep in range(reps + 2):
            ids = self.ids()
            t0 = time.perf_counter()
            call(ids)
            if rep >= 2:
                best = min(best, time.perf_counter() - t0)
        return self.nbytes / best / 1e9

    def kernel(self, lib: ctypes.CDLL) -> float:
        return self.gbps(
            lambda ids: run_kernel(lib, self.x, ids, self.w, self.gu, self.dn, self.out, self.threads)
        )

    def wrapper(self) -> float:
        return self.gbps(lambda ids: cpu_experts(self.x, ids, self.w, self.gu, self.dn, self.threads))

    def trace(self, lib: ctypes.CDLL) -> dict[str, float]:
        """One traced call: the spread of the threads' first and last moments, waits and units."""
        trace = torch.zeros(self.threads, 4, dtype=torch.float64)
        for _ in range(3):  # the last of three, warm
            t0 = time.perf_counter()
            run_kernel(lib, self.x, self.ids(), self.w, self.gu, self.dn, self.out, self.threads, 0, trace)
            call = time.perf_counter() - t0
        start, end, wait, units = trace.unbind(1)
        return {
            "call_us": call * 1e6,
            "last_start_us": float(start.max()) * 1e6,
            "first_end_us": float(end.min()) * 1e6,
            "last_end_us": float(end.max()) * 1e6,
            "max_wait_us": float(wait.max()) * 1e6,
            "units_min": int(units.min()),
            "units_max": int(units.max()),
        }


def rounds(libs: dict, bench: Bench, threads: int, n: int, huge: bool) -> dict:
    calls = Calls(bench, threads)
    shipped = load_library()
    bench.threads = threads
    ratios: dict[str, list[float]] = {str(v): [] for v in libs}
    paths: dict[str, list[float]] = {"kernel": [], "cpu_experts": [], "b_h": []}
    reads, traces = [], []
    for _ in range(n):
        read = read_bandwidth(threads=threads, huge_pages=huge) / 1e9
        reads.append(read)
        for variant, lib in libs.items():
            ratios[str(variant)].append(calls.kernel(lib) / read)
        paths["kernel"].append(calls.kernel(shipped) / read)
        paths["cpu_experts"].append(calls.wrapper() / read)
        paths["b_h"].append(bench.host_bw() / 1e9 / read)
        traces.append(calls.trace(shipped))
    return {
        "threads": threads,
        "read_GBps": {"min": min(reads), "median": statistics.median(reads), "max": max(reads)},
        "variants_of_read": {k: statistics.median(v) for k, v in ratios.items()},
        "paths_of_read": {k: statistics.median(v) for k, v in paths.items()},
        "paths_GBps": {k: statistics.median(v) * statistics.median(reads) for k, v in paths.items()},
        "trace": {k: statistics.median(t[k] for t in traces) for k in traces[0]},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default=str(torch.get_num_threads()), help="thread counts, comma-separated")
    ap.add_argument("--rounds", type=int, default=5, help="rounds, each beside its own read")
    ap.add_argument(
        "--huge-pages", action="store_true", help="pool and read buffer in transparent huge pages"
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    counts = [int(t) for t in args.threads.split(",")]
    bench = Bench(PRESETS["qwen3-30b-a3b"], counts[0], huge_pages=args.huge_pages)
    with tempfile.TemporaryDirectory() as tmp:
        libs = {v: build(Path(tmp), *v) for v in VARIANTS}
        results = [rounds(libs, bench, t, args.rounds, args.huge_pages) for t in counts]
    doc = {
        "llc_MiB": llc_bytes() / 2**20,
        "huge_pages": args.huge_pages,
        "variants": VARIANTS,
        "runs": results,
    }
    if args.json:
        print(json.dumps(doc, indent=2))
        return
    print("median over rounds of each figure's ratio to the read measured at the start of its round")
    print("variant (lanes, KiB per unit, prefetch); the first is the shipped build")
    for r in results:
        read = r["read_GBps"]
        print(
            f"{r['threads']} threads, read {read['min']:.1f}-{read['max']:.1f} GB/s "
            f"(median {read['median']:.1f})"
        )
        for name, ratio in r["variants_of_read"].items():
            print(f"  {name:18s} {ratio:.2f} x read")
        for name, ratio in r["paths_of_read"].items():
            print(f"  {name:18s} {ratio:.2f} x read  ({r['paths_GBps'][name]:.1f} GB/s)")
        print("  trace: " + "  ".join(f"{k} {v:.0f}" for k, v in r["trace"].items()))


if __name__ == "__main__":
    main()
