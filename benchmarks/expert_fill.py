"""Expert slot fills from the page-locked host pool: the UVA gather kernel beside copy-engine DMA.

    python benchmarks/expert_fill.py                  # Qwen3-30B-A3B experts, fills of 1, 8, 32, 64
    python benchmarks/expert_fill.py --sweep --json   # also try FillBlocks choices first

One call fills n experts (gate_up + down, 3·H·I elements each) of one MoE layer into n slots:
  uva    fill_slots: one Triton launch reading the host banks in place over PCIe (SMs do the copy)
  dma    dst[slot].copy_(src[e], non_blocking=True) per expert and bank (the copy engines do it), as
         issued from Python today, host issue time included
  graph  fill_slots captured once in a CUDA graph and replayed, the plan rewritten in place before each
         replay (a 1 KB device copy, inside the timing): the fill a graph-captured decode step makes
The plan always has P = max(--fills) rows, count = n, the rest -1 (as the device LRU leaves it). Each
call reads other experts than the one before (the calls cycle through disjoint expert sets), so no
call finds its source in the GPU's L2. Times: CUDA events around `--reps` calls after warm-up, median
of `--rounds`; `GB/s` = n · expert bytes / time; `x dma` over one large pinned host-to-device copy
measured in the same run; `dma/uva` is the DMA time over the UVA kernel's (> 1: the kernel is faster).
Every method's slots are checked bit for bit against the pool afterwards (`ok`).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from freetoken.runtime.moe.kernels.expert_fill import DEFAULT_FILL_BLOCKS, FillBlocks, fill_slots
from freetoken.runtime.moe.pool import HostExpertPool

SWEEP = [
    FillBlocks(block=b, iters=it, num_warps=w)
    for b in (1024, 2048, 4096, 8192)
    for it in (1, 2, 4, 8)
    for w in (4, 8, 16)
]


class Bench:
    """One layer's pool banks (page-locked) and a device slot bank, with the plans each fill size uses."""

    def __init__(self, h: int, i: int, e: int, s: int, pin: str, max_fill: int, seed: int) -> None:
        self.h, self.i, self.e, self.s, self.max_fill = h, i, e, s, max_fill
        self.pool = host_pool(h, i, e, pin, seed)
        self.src_gate_up, self.src_down = self.pool.gate_up[0], self.pool.down[0]  # [E, 2I, H], [E, H, I]
        self.dst_gate_up = torch.empty(s, 2 * i, h, dtype=torch.bfloat16, device="cuda")  # [S, 2I, H]
        self.dst_down = torch.empty(s, h, i, dtype=torch.bfloat16, device="cuda")  # [S, H, I]
        self.expert_bytes = 3 * h * i * 2
        self.generator = torch.Generator().manual_seed(seed)

    def plans(self, n: int) -> tuple[list[list[tuple[int, int]]], torch.Tensor, torch.Tensor]:
        """(rows per variant, plans [V, P, 2] int32, counts [V, 1] int32): V = E // n variants, each n
        (expert, slot) rows, the variants' experts disjoint, slots distinct within one variant."""
        experts = torch.randperm(self.e, generator=self.generator).tolist()
        variants = []
        for v in range(self.e // n):
            slots = torch.randperm(self.s, generator=self.generator)[:n].tolist()
            variants.append(list(zip(experts[v * n : (v + 1) * n], slots, strict=True)))
        plans = torch.full((len(variants), self.max_fill, 2), -1, dtype=torch.int32)
        for v, rows in enumerate(variants):
            plans[v, :n] = torch.tensor(rows, dtype=torch.int32)
        counts = torch.full((len(variants), 1), n, dtype=torch.int32)
        return variants, plans.cuda(), counts.cuda()

    def uva(self, plan: torch.Tensor, count: torch.Tensor, blocks: FillBlocks) -> None:
        fill_slots(
            plan, count, self.src_gate_up, self.src_down, self.dst_gate_up, self.dst_down, blocks=blocks
        )

    def dma(self, rows: list[tuple[int, int]]) -> None:
        for expert, slot in rows:
            self.dst_gate_up[slot].copy_(self.src_gate_up[expert], non_blocking=True)
            self.dst_down[slot].copy_(self.src_down[expert], non_blocking=True)

    def check(self, fill: Callable[[], None], rows: list[tuple[int, int]]) -> bool:
        """Whether `fill` leaves exactly the pool's bits in the slots of `rows` (slots cleared first)."""
        self.dst_gate_up.zero_()
        self.dst_down.zero_()
        fill()
        torch.cuda.synchronize()
        pairs = ((self.dst_gate_up, self.src_gate_up), (self.dst_down, self.src_down))
        return all(
            torch.equal(dst[slot].view(torch.int16), src[expert].cuda().view(torch.int16))
            for expert, slot in rows
            for dst, src in pairs
        )


def host_pool(h: int, i: int, e: int, pin: str, seed: int) -> HostExpertPool:
    """One layer's banks of random bf16 weights, page-locked as the engine does (`register`:
    HostExpertPool.pin, cudaHostRegister in place) or moved into torch's pinned allocator."""
    pool = HostExpertPool.allocate((0,), e, h, i, torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(seed)
    for bank in (pool.gate_up[0], pool.down[0]):
        for expert in range(e):
            bank[expert].copy_(torch.randn(bank.shape[1:], device="cuda", generator=g).bfloat16())
    pool.mark_filled()
    if pin == "register":
        pool.pin()
    else:
        pool.gate_up[0], pool.down[0] = pool.gate_up[0].pin_memory(), pool.down[0].pin_memory()
        pool.pinned = True
    return pool


def event_time(fn: Callable[[int], Any], reps: int, rounds: int, warmup: int) -> float:
    """Seconds per call: fn(0..reps-1) between two CUDA events, median over `rounds`, after `warmup` calls."""
    for k in range(warmup):
        fn(k)
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for k in range(reps):
            fn(k)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / reps)
    return statistics.median(times)


def dma_peak(bench: Bench, reps: int, rounds: int) -> float:
    """Bytes per second of one large copy from the pinned gate_up bank (contiguous experts)."""
    k = min(32, bench.e, bench.s)
    dst, src = bench.dst_gate_up[:k], bench.src_gate_up[:k]
    seconds = event_time(lambda _: dst.copy_(src, non_blocking=True), reps, rounds, warmup=2)
    return dst.numel() * dst.element_size() / seconds


def graph_fill(bench: Bench, blocks: FillBlocks) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
    """(graph, its plan [P, 2], its count [1]): one fill_slots captured; rewrite the two to refill."""
    plan = torch.full((bench.max_fill, 2), -1, dtype=torch.int32, device="cuda")
    count = torch.zeros(1, dtype=torch.int32, device="cuda")
    bench.uva(plan, count, blocks)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        bench.uva(plan, count, blocks)
    return graph, plan, count


def fill_row(bench: Bench, n: int, blocks: FillBlocks, args: argparse.Namespace) -> dict[str, Any]:
    variants, plans, counts = bench.plans(n)
    v = len(variants)
    graph, graph_plan, graph_count = graph_fill(bench, blocks)

    def replay(k: int) -> None:
        graph_plan.copy_(plans[k % v])
        graph_count.copy_(counts[k % v])
        graph.replay()

    timing = timing_of(args)
    seconds = {
        "uva": event_time(lambda k: bench.uva(plans[k % v], counts[k % v], blocks), *timing),
        "dma": event_time(lambda k: bench.dma(variants[k % v]), *timing),
        "graph": event_time(replay, *timing),
    }
    checks = {
        "uva": bench.check(lambda: bench.uva(plans[0], counts[0], blocks), variants[0]),
        "dma": bench.check(lambda: bench.dma(variants[0]), variants[0]),
        "graph": bench.check(lambda: replay(v - 1), variants[v - 1]),
    }
    nbytes = n * bench.expert_bytes
    row: dict[str, Any] = {"experts": n, "bytes": nbytes}
    for method, s in seconds.items():
        row[f"{method}_us"] = s * 1e6
        row[f"{method}_gbps"] = nbytes / s / 1e9
        row[f"{method}_ok"] = checks[method]
    return row


def sweep(bench: Bench, n: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every SWEEP choice timed on fills of n experts (eager launches)."""
    variants, plans, counts = bench.plans(n)
    v = len(variants)
    rows = []
    for blocks in SWEEP:
        s = event_time(lambda k, b=blocks: bench.uva(plans[k % v], counts[k % v], b), *timing_of(args))
        rows.append({**asdict(blocks), "us": s * 1e6, "gbps": n * bench.expert_bytes / s / 1e9})
    return rows


def timing_of(args: argparse.Namespace) -> tuple[int, int, int]:
    return args.reps, args.rounds, args.warmup


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--moe-inter", type=int, default=768)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--fills", default="1,8,32,64", help="experts per call")
    ap.add_argument("--pin", choices=("register", "pin_memory"), default="register")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument(
        "--sweep", action="store_true", help="time every FillBlocks in SWEEP first, keep the best"
    )
    ap.add_argument("--sweep-fill", type=int, default=32, help="experts per call in the sweep")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("expert_fill.py needs a CUDA device")
    fills = [int(n) for n in args.fills.split(",")]
    h, i, e, s = args.hidden, args.moe_inter, args.experts, args.slots
    largest = max(*fills, args.sweep_fill)
    if min(*fills, args.sweep_fill) < 1 or largest > min(e, s):
        raise SystemExit(f"fills must lie in [1, min(--experts, --slots)] = [1, {min(e, s)}]")
    bench = Bench(h, i, e, s, args.pin, largest, seed=0)
    peak = dma_peak(bench, args.reps, args.rounds)
    blocks, sweep_rows = DEFAULT_FILL_BLOCKS, []
    if args.sweep:
        sweep_rows = sweep(bench, args.sweep_fill, args)
        best = min(sweep_rows, key=lambda r: r["us"])
        blocks = FillBlocks(**{f: best[f] for f in asdict(DEFAULT_FILL_BLOCKS)})
    rows = [fill_row(bench, n, blocks, args) for n in fills]
    for r in rows:
        for method in ("uva", "dma", "graph"):
            r[f"{method}_x_dma"] = r[f"{method}_gbps"] * 1e9 / peak
    doc = {
        "shape": {"hidden": h, "moe_inter": i, "experts": e, "slots": s, "dtype": "bfloat16"},
        "device": torch.cuda.get_device_name(),
        "pin": args.pin,
        "dma_peak_gbps": peak / 1e9,
        "blocks": asdict(blocks),
        "rows": rows,
        "sweep": sweep_rows,
    }
    if args.json:
        print(json.dumps(doc, indent=1))
        return
    print_table(doc)


def print_table(doc: dict[str, Any]) -> None:
    for r in sorted(doc["sweep"], key=lambda r: r["us"])[:5]:
        choice = f"block {r['block']} iters {r['iters']} w{r['num_warps']}"
        print(f"sweep {choice}: {r['us']:.1f} us, {r['gbps']:.1f} GB/s")
    shape = " ".join(f"{k} {v}" for k, v in doc["shape"].items())
    peak = f"dma peak {doc['dma_peak_gbps']:.1f} GB/s"
    print(f"{doc['device']} · {shape} · {doc['pin']} · {peak} · blocks {doc['blocks']}")
    head = ("n", "MB", "uva us", "GB/s", "x dma", "dma us", "GB/s", "graph us", "GB/s", "dma/uva", "ok")
    widths = (3, 7, 9, 6, 6, 9, 6, 9, 6, 8, 4)
    print(" ".join(f"{c:>{w}}" for c, w in zip(head, widths, strict=True)))
    for r in doc["rows"]:
        ok = "yes" if r["uva_ok"] and r["dma_ok"] and r["graph_ok"] else "NO"
        print(
            f"{r['experts']:>3} {r['bytes'] / 1e6:>7.1f} {r['uva_us']:>9.1f} {r['uva_gbps']:>6.1f} "
            f"{r['uva_x_dma']:>6.2f} {r['dma_us']:>9.1f} {r['dma_gbps']:>6.1f} {r['graph_us']:>9.1f} "
            f"{r['graph_gbps']:>6.1f} {r['dma_us'] / r['uva_us']:>8.2f} {ok:>4}"
        )


if __name__ == "__main__":
    main()
