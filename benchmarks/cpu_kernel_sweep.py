"""Compile variants of the CPU expert kernel and time them at batch 1 beside the host read ceiling.

    python benchmarks/cpu_kernel_sweep.py [--threads 14,16] [--rounds 5] [--huge-pages] [--json]
    python benchmarks/cpu_kernel_sweep.py --codec Q4_K --int8-act --threads 16   # experts kept as Q4_K

Each variant is the shipped source with other -D values (accumulator lanes, bytes per unit of work,
software prefetch distance in elements; the K-quant dots' prefetch distance in bytes). A shared host's
read drifts from one second to the next, so every round measures the STREAM-like read ceiling first and
then each variant, and each variant's figure is the median over rounds of its ratio to that round's
read. Each round also times the shipped kernel the ways the runtime reaches it (alone, through
cpu_experts, and for bf16 banks as `bench bw` measures B_H) and traces one call: when each thread took
its first unit and finished its last, how long it waited. `--codec` (with `--int8-act`): random banks
of that codec's blocks instead of bf16 values.
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

import numpy as np
import torch
from codec_bandwidth import random_bank

from freetoken.runtime.measure.bandwidth import PRESETS, Bench
from freetoken.runtime.moe.kernels.cpu_experts import (
    beyond_cache_bytes,
    cpu_experts,
    llc_bytes,
    read_bandwidth,
    run_kernel,
)
from freetoken.runtime.moe.kernels.loader import FLAGS, SOURCES, declare, find_compiler, load_library

# (accumulator lanes, KiB of weights per unit of work (0: the kernel's own, a call's bytes over 20 units a
# thread), prefetch distance in bf16 elements, the K-quant dots' in bytes[, more -D definitions]); first: the
# source defaults (the
# loader builds with PREFETCH 0 where more than 4 cores are allowed or AVX-512 is present)
VARIANTS = [
    (32, 0, 1024, 2048), (32, 256, 1024, 2048), (32, 0, 0, 2048), (32, 256, 0, 2048), (32, 64, 1024, 2048),
    (32, 1024, 1024, 2048), (64, 0, 1024, 2048), (32, 0, 1024, 2048, "PREFETCH_HINT=2"),
    (32, 0, 0, 2048, "SUM_AFTER_BARRIER=1"),
]  # fmt: skip
# banks of codec blocks: first what the loader builds on a many-core host (PREFETCH 0 but the
# Q8_0 dots' 2,048 bytes ahead into L2, the K-quant dots 2,048 bytes ahead into L2, Q4_K / Q5_K rows two at a
# time), then other builds: a fifth value holds more -D definitions (the K-quant prefetch's locality: 0
# non-temporal, 3 into L1 too; the rows one at a time; Q8_0's prefetch off, or non-temporal; the sum over
# pairs after a barrier, as before 2026-12-06)
Q8 = "Q8_PREFETCH=2048 Q8_PREFETCH_HINT=2"
CODEC_VARIANTS = [
    (32, 0, 0, 2048, Q8), (32, 0, 0, 2048, Q8 + " KQ_PREFETCH_HINT=0"),
    (32, 0, 0, 2048, Q8 + " KQ_PREFETCH_HINT=3"),
    (32, 0, 0, 2048, Q8 + " PAIRED_ROWS=0"), (32, 0, 0, 0, Q8), (32, 0, 0, 1024, Q8), (32, 0, 0, 4096, Q8),
    (32, 0, 0, 2048), (32, 0, 1024, 2048), (32, 0, 0, 2048, Q8 + " SUM_AFTER_BARRIER=1"),
]  # fmt: skip
K = 8  # experts per call: a Qwen3 layer step with every routed expert on the CPU


def build(
    folder: Path, lanes: int, unit_kib: int, prefetch: int, kq_prefetch: int, more: str = ""
) -> ctypes.CDLL:
    out = folder / f"k_{lanes}_{unit_kib}_{prefetch}_{kq_prefetch}_{more.replace(' ', '_')}.so"
    defines = [f"-DLANES={lanes}", f"-DPREFETCH={prefetch}"]
    defines += [f"-DUNIT_BYTES=({unit_kib}<<10)"] if unit_kib else []  # 0: the kernel's own unit a call
    defines += [f"-DKQ_PREFETCH={kq_prefetch}", *(f"-D{d}" for d in more.split())]
    cmd = [find_compiler(), *FLAGS, *defines, *map(str, SOURCES), "-o", str(out), "-lm", "-lpthread"]
    subprocess.run(cmd, check=True)
    lib = ctypes.CDLL(str(out))
    declare(lib)
    return lib


class Calls:
    """Batch-1 layer steps of K experts, rotating through a pool larger than the caches: banks [E, 2I, H] /
    [E, H, I] of bf16 values, or of `codec`'s blocks (rows of bytes) met by int8 activations or not."""

    def __init__(
        self,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        threads: int,
        codec: str = "bf16",
        int8_act: bool = False,
    ) -> None:
        self.gu, self.dn = gate_up, down
        self.threads = threads
        self.codec = {} if codec == "bf16" else {"codecs": (codec, codec), "int8_act": int8_act}
        hidden = down.shape[1]
        self.x = torch.randn(1, hidden)
        self.w = torch.full((1, K), 1.0 / K)
        self.out = torch.empty(1, hidden)
        self.nbytes = K * (
            gate_up[0].numel() * gate_up.element_size() + down[0].numel() * down.element_size()
        )
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
            lambda ids: run_kernel(
                lib, self.x, ids, self.w, self.gu, self.dn, self.out, self.threads, **self.codec
            )
        )

    def wrapper(self) -> float:
        return self.gbps(
            lambda ids: cpu_experts(self.x, ids, self.w, self.gu, self.dn, self.threads, **self.codec)
        )

    def trace(self, lib: ctypes.CDLL) -> dict[str, float]:
        """One traced call: the spread of the threads' first and last moments, waits and units."""
        trace = torch.zeros(self.threads + 1, 4, dtype=torch.float64)
        for _ in range(3):  # the last of three, warm
            t0 = time.perf_counter()
            ids = self.ids()
            run_kernel(
                lib, self.x, ids, self.w, self.gu, self.dn, self.out, self.threads, trace=trace, **self.codec
            )
            call = time.perf_counter() - t0
        start, end, wait, units = trace[: self.threads].unbind(1)
        return {
            "call_us": call * 1e6,
            "last_start_us": float(start.max()) * 1e6,
            "first_end_us": float(end.min()) * 1e6,
            "last_end_us": float(end.max()) * 1e6,
            "max_wait_us": float(wait.max()) * 1e6,
            "units_min": int(units.min()),
            "units_max": int(units.max()),
            "joined_us": float(trace[-1, 0]) * 1e6,
        }


def rounds(libs: dict, bench: Bench, calls: Calls, threads: int, n: int, huge: bool) -> dict:
    """`n` rounds at `threads`, each beside its own read; `bench.host_bw` (what `bench bw` reports) is
    timed for bf16 banks only."""
    calls.threads = threads
    shipped = load_library()
    bench.threads = threads
    ratios: dict[str, list[float]] = {str(v): [] for v in libs}
    paths: dict[str, list[float]] = {"kernel": [], "cpu_experts": []} | ({} if calls.codec else {"b_h": []})
    reads, traces = [], []
    for _ in range(n):
        read = read_bandwidth(threads=threads, huge_pages=huge) / 1e9
        reads.append(read)
        for variant, lib in libs.items():
            ratios[str(variant)].append(calls.kernel(lib) / read)
        paths["kernel"].append(calls.kernel(shipped) / read)
        paths["cpu_experts"].append(calls.wrapper() / read)
        if "b_h" in paths:
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
    ap.add_argument("--codec", default="bf16", help="the banks' form: bf16, or a codec the CPU kernel reads")
    ap.add_argument("--int8-act", action="store_true", help="a codec's rows against int8 activations")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    counts = [int(t) for t in args.threads.split(",")]
    shape = PRESETS["qwen3-30b-a3b"]
    bench = Bench(shape, counts[0], huge_pages=args.huge_pages)
    if args.codec == "bf16":
        calls, variants = Calls(bench.pool.gate_up[0], bench.pool.down[0], counts[0]), VARIANTS
    else:
        experts = max(2 * K, -(-beyond_cache_bytes() // (3 * shape.hidden * shape.intermediate)))
        rng = np.random.default_rng(0)
        banks = (
            random_bank(args.codec, experts, 2 * shape.intermediate, shape.hidden, rng),
            random_bank(args.codec, experts, shape.hidden, shape.intermediate, rng),
        )
        calls, variants = Calls(*banks, counts[0], args.codec, args.int8_act), CODEC_VARIANTS
    with tempfile.TemporaryDirectory() as tmp:
        libs = {v: build(Path(tmp), *v) for v in variants}
        results = [rounds(libs, bench, calls, t, args.rounds, args.huge_pages) for t in counts]
    doc = {
        "llc_MiB": llc_bytes() / 2**20,
        "huge_pages": args.huge_pages,
        "codec": args.codec,
        "int8_act": args.int8_act,
        "variants": variants,
        "runs": results,
    }
    if args.json:
        print(json.dumps(doc, indent=2))
        return
    print("median over rounds of each figure's ratio to the read measured at the start of its round")
    print("variant (lanes, KiB per unit, prefetch, K-quant prefetch bytes[, -D more]); first: shipped")
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
