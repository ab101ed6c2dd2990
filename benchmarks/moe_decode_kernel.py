"""The fused MoE decode kernel beside the memory floor and the torch paths it replaces.

    python benchmarks/moe_decode_kernel.py                  # Qwen3-30B-A3B experts, batch 1..16
    python benchmarks/moe_decode_kernel.py --sweep --json   # also try tile sizes
    python benchmarks/moe_decode_kernel.py --codec Q4_K     # experts kept as Q4_K blocks (Q8_0, MXFP4 too)
    python benchmarks/moe_decode_kernel.py --codec Q4_K --kernels   # each kernel's device time at batch 1

One MoE layer's routed experts for T tokens: bytes = the distinct experts' weights (gate_up + down)
read once, in the bytes the banks hold (bf16, or a codec's blocks as stored). Times are CUDA-graph
replays (no launch overhead), median of repeats, each captured call routing to a different set of
experts (none left in L2 by the call before); `GB/s` = bytes / time, `x read` = that over a plain
reduction's read bandwidth measured in the same run; `x peak` over the card's data-sheet HBM bandwidth.
`int8 us`: Q4_K and Q8_0 banks through the int8-activation sides as well (moe_decode_int8.py; its tiles
swept with --sweep), `int8_rel_err` in --json its error against fp32. `--kernels`: each kernel of the
step alone (the profiler's device time, launch gaps excluded), the two GEMVs with the bytes they read,
and beside them one plain launch reading the same bytes (torch's reduction; a Triton kernel of 16-byte
loads): the floor a kernel of that size meets on this card, its ramp and tail included.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict
from typing import Any

import numpy as np
import torch
from random_gguf import block_scale

from freetoken.codecs import get_codec
from freetoken.codecs.torch_dequant import DEVICE_CODECS, dequantize_rows
from freetoken.runtime.moe.experts import gathered_experts, grouped_experts
from freetoken.runtime.moe.kernels.moe_decode import (
    DEFAULT_BLOCKS,
    DecodeBlocks,
    codec_blocks,
    fused_moe_decode,
    int8_blocks,
)
from freetoken.runtime.moe.kernels.moe_decode_int8 import int8_side

SWEEP = [
    DecodeBlocks(gate_up_n=n1, gate_up_k=k1, down_n=n2, down_k=k2, num_warps=4, num_stages=st)
    for n1, k1 in ((2, 256), (4, 128), (4, 256), (8, 128), (8, 256), (16, 64))
    for n2, k2 in ((4, 256), (8, 128), (8, 256), (16, 128), (32, 64))
    for st in (1, 2, 3)
] + [DecodeBlocks(4, 256, 8, 256, num_warps=4, pdl=1), DecodeBlocks(8, 128, 8, 128, num_warps=4, pdl=1)]
SWEEP_CODEC = [  # banks of codec blocks: chunks of whole blocks, up to a whole row per step; stages > 1
    # pipeline a row's chunks (more loads in flight: at batch 1 the kernel waits on memory, not arithmetic)
    DecodeBlocks(
        gate_up_n=n1, gate_up_k=k1, down_n=n2, down_k=k2, num_warps=4, num_stages=st, split_choices=1
    )
    for n1, k1 in ((8, 512), (16, 256), (4, 2048))
    for n2, k2 in ((4, 1024), (8, 512))
    for st in (1, 3)  # split_choices 1: the faster at every codec measured
] + [  # the kernels after the first launched as programmatic dependents of the one before
    DecodeBlocks(n1, k1, 8, 512, num_warps=4, split_choices=1, pdl=1) for n1, k1 in ((8, 512), (16, 256))
]
# the int8-activation sides: rows x warps such that a thread holds whole chunks (8 rows a warp), whole rows a
# program; gate_up of 32 rows quantizes the activations; down split or not (caps on registers a thread, 168
# and 128, never won: Q4_K 25.7 against 18.9 us on an H200, 2026-12-06)
INT8_ROWS = [
    DecodeBlocks(n1, k1, n2, 1024, num_warps=w1, split_choices=sp, down_warps=w2)
    for n1, k1, w1 in ((8, 2048, 1), (16, 2048, 2), (32, 2048, 4), (8, 512, 1))
    for n2, w2, sp in ((8, 1, 1), (16, 2, 1), (8, 1, 0))
]
# more warps a program (Q8_0's rows are one tile already: a thread then holds fewer words)
INT8_WARPS = [
    DecodeBlocks(n1, 2048, 8, 1024, num_warps=w1, split_choices=1, down_warps=1)
    for n1, w1 in ((8, 4), (16, 8))
]
# each kernel after the step's first a programmatic dependent of the one before (pdl)
INT8_PDL = [DecodeBlocks(8, 2048, 8, 1024, num_warps=1, split_choices=s, down_warps=1, pdl=1) for s in (1, 0)]
# a Q4_K chunk's super-blocks as one tile (its loads at once, fewer registers: more warps); with pdl a kernel
# asks for its first chunk's weights before it waits for the one before (40 such tiles swept on an H100,
# 2026-12-06: 18.0 us at best against 17.0 without the tile; the four fastest kept)
INT8_TILES = [
    DecodeBlocks(n1, 2048, n2, k2, num_warps=w1, split_choices=1, down_warps=w2, chunk_tile=1, pdl=pdl)
    for n1, w1, n2, k2, w2, pdl in ((8, 1, 8, 256, 1, 0), (8, 2, 8, 1024, 1, 1), (16, 4, 8, 256, 1, 1))
]
# gate_up's rows cut along H into 2-8 parts, a program each (more programs, fewer bytes each), their sums
# added by the launch that quantizes the activations for down
INT8_SPLITS = [
    DecodeBlocks(n1, 2048, 8, 1024, num_warps=w1, split_choices=1, down_warps=1, pdl=1, gate_up_splits=s)
    for n1, w1 in ((8, 1), (16, 2), (32, 4))
    for s in (2, 4, 8)
] + [
    DecodeBlocks(
        8, 2048, 8, 1024, num_warps=1, split_choices=1, down_warps=1, pdl=1, chunk_tile=1, gate_up_splits=s
    )
    for s in (2, 4)
]
# a row or two a program (fewer registers, more programs an SM: Q8_0's gate_up 14.5 -> 13.0 us on an H100,
# 2026-12-06), and Q4_K gate_up programs streaming through 2-4 groups of whole-row tiles (gate_up_rounds)
INT8_FEW_ROWS = [
    DecodeBlocks(n1, 2048, 4, 1024, num_warps=1, split_choices=1, down_warps=1, pdl=1) for n1 in (1, 2)
] + [
    DecodeBlocks(1, 2048, 8, 1024, 1, split_choices=1, down_warps=1, chunk_tile=2, pdl=1, gate_up_rounds=r)
    for r in (2, 3, 4)
]
# a program's gate and up rows as one tile (gate_up_joint): sm_90 SASS of Q8_0's one-row program asks for
# 57 of its 59 loads before its first dp4a (31 with gate, then up), in 66 registers; Q4_K's rows as chunk
# tiles too (chunk_tile 2): every 16-byte load of 1 / 2 / 4 rows' gate and up before the first dp4a in
# 62 / 69 / 125 registers, where the shipped 8-row program asks for 31 of its 64 first
INT8_JOINT = [
    DecodeBlocks(n1, 2048, n2, 1024, num_warps=1, split_choices=1, down_warps=1, pdl=1, gate_up_joint=1)
    for n1, n2 in ((1, 4), (2, 4), (4, 8))
] + [
    DecodeBlocks(n1, 2048, 8, 1024, 1, split_choices=1, down_warps=1, chunk_tile=2, pdl=1, gate_up_joint=1)
    for n1 in (1, 2, 4)
]
SWEEP_INT8 = INT8_ROWS + INT8_WARPS + INT8_PDL + INT8_TILES + INT8_SPLITS + INT8_FEW_ROWS + INT8_JOINT
HBM_PEAK = {"NVIDIA H200": 4.8e12, "NVIDIA H100 80GB HBM3": 3.35e12}  # bytes/s, the data sheets


def random_banks(
    codec: str, experts: int, h: int, i: int, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Random CUDA expert banks [E, 2I, H] / [E, H, I]: bf16 values, or a codec's random blocks (small
    finite scales) -> (gate_up, down, their fp32 values)."""
    if codec == "bf16":
        gate_up = (torch.randn(experts, 2 * i, h, device="cuda", generator=g) / h**0.5).bfloat16()
        down = (torch.randn(experts, h, i, device="cuda", generator=g) / i**0.5).bfloat16()
        return gate_up, down, (gate_up.float(), down.float())
    c, rng = get_codec(codec), np.random.default_rng(0)
    scale = block_scale(codec, std=0.3)
    blocks = [np.empty((experts, rows, c.row_bytes(n)), np.uint8) for rows, n in ((2 * i, h), (h, i))]
    gate_up, down = (torch.from_numpy(c.random_blocks(b, rng, scale)).cuda() for b in blocks)
    return gate_up, down, (dequantize_rows(gate_up, codec, h), dequantize_rows(down, codec, i))


def graph_time(fn: Any, reps: int = 50, rounds: int = 7) -> float:
    """Seconds per call: `reps` calls captured in one CUDA graph, median over `rounds` replays."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / reps)
    return statistics.median(times)


def cycling(run: Any, sets: list[torch.Tensor]) -> Any:
    """A call of `run` on the next id set each time (captured calls route to other experts in turn)."""
    calls = iter(range(1 << 30))
    return lambda: run(sets[next(calls) % len(sets)])


def kernel_times(fn: Any, calls: int = 48) -> dict[str, float]:
    """Device seconds per call of each kernel `fn` launches (the profiler's durations on the GPU: launch
    gaps excluded), by kernel name."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times = {}
    for ev in prof.key_averages():
        total = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
        if ev.count >= calls and total > 0:
            times[ev.key] = total / 1e6 / calls
    return times


def kernel_rows(times: dict[str, float], gate_up_bytes: int, down_bytes: int) -> list[dict[str, Any]]:
    """Per kernel: its time, and for the two GEMVs the bytes of the experts it reads over that time."""
    rows = []
    for name, s in sorted(times.items(), key=lambda kv: -kv[1]):
        nbytes = gate_up_bytes if "gate_up" in name else down_bytes if "down" in name else 0
        rows.append({"kernel": name, "us": s * 1e6, "gbps": nbytes / s / 1e9 if nbytes else None})
    return rows


def _read_kernel() -> Any:
    """A Triton launch that only reads: each program loads BLOCK 16-byte words and stores one number."""
    import triton
    import triton.language as tl

    @triton.jit
    def read_words(src, out, BLOCK: tl.constexpr):  # src [n, 4] int32: a 16-byte word a row
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        words = tl.load(src + rows[:, None] * 4 + tl.arange(0, 4)[None, :])
        tl.store(out + tl.program_id(0), tl.sum(tl.sum(words, axis=1), axis=0))

    return read_words


def same_bytes_read(nbytes: int, total: int = 256 << 20) -> dict[str, float]:
    """One launch reading `nbytes` (a fresh buffer each call, so none comes from L2), as torch's reduction
    and as a Triton kernel of 16-byte loads (a program per 4 KiB): microseconds a call in a graph of such
    calls and of device time alone (the profiler), as the kernels' rows measure theirs — what one launch
    reading that many bytes reaches on this card, ramp and tail included."""
    block = 256  # 16-byte words a program
    nbytes -= nbytes % (16 * block)
    bufs = [torch.ones(nbytes // 4, dtype=torch.int32, device="cuda") for _ in range(max(4, total // nbytes))]
    out = torch.empty(nbytes // (16 * block), dtype=torch.int32, device="cuda")
    kernel, calls = _read_kernel(), iter(range(1 << 30))

    def reduction() -> None:
        torch.sum(bufs[next(calls) % len(bufs)], dim=0, dtype=torch.int32, out=out[:1].view(()))

    def loads() -> None:
        kernel[(out.numel(),)](bufs[next(calls) % len(bufs)], out, BLOCK=block, num_warps=4)

    found: dict[str, float] = {"bytes": nbytes}
    for name, read in (("sum", reduction), ("loads", loads)):
        found[f"{name}_device_us"] = sum(kernel_times(read).values()) * 1e6
        found[f"{name}_graph_us"] = graph_time(read) * 1e6
    return found


def read_bandwidth(nbytes: int = 4 << 30) -> float:
    """Bytes per second a plain reduction reads (what a streaming read reaches on this card)."""
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    out = torch.empty((), dtype=torch.float32, device="cuda")
    return nbytes / graph_time(lambda: torch.sum(src, dim=0, dtype=torch.float32, out=out), reps=3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--moe-inter", type=int, default=768)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--sweep", action="store_true", help="time every tile size in SWEEP at batch 1 first")
    ap.add_argument("--codec", choices=("bf16", *DEVICE_CODECS), default="bf16", help="the banks' form")
    ap.add_argument("--kernels", action="store_true", help="each kernel's device time at batch 1 (profiler)")
    ap.add_argument(
        "--shard",
        default="0/1",
        help="I/N: sweep only every N-th tile from the I-th (N processes at once compile the tiles into one "
        "Triton cache; their times share the GPU and mean nothing)",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    shard, shards = (int(v) for v in args.shard.split("/"))
    h, i, e, k = args.hidden, args.moe_inter, args.experts, args.top_k
    g = torch.Generator(device="cuda").manual_seed(0)
    codecs = None if args.codec == "bf16" else (args.codec, args.codec)
    gate_up, down, (plain_gate_up, plain_down) = random_banks(args.codec, e, h, i, g)
    if codecs is None:
        expert_bytes = 3 * h * i * 2
    else:
        codec = get_codec(args.codec)
        expert_bytes = codec.tensor_bytes(2 * i, h) + codec.tensor_bytes(h, i)
    copy = read_bandwidth()
    blocks, sweep_rows = DEFAULT_BLOCKS if codecs is None else codec_blocks(codecs[0]), []
    int8 = codecs is not None and int8_side(args.codec, h) > 0
    int8_tiles = int8_blocks(args.codec, args.hidden) if int8 else None
    if args.sweep:  # batch 1, each captured call routed to other experts, as the rows below
        x = torch.randn(1, h, device="cuda").bfloat16()
        sets = [torch.randperm(e, device="cuda", generator=g)[:k][None] for _ in range(16)]
        w = torch.rand(1, k, device="cuda")
        for candidate in (SWEEP if codecs is None else SWEEP_CODEC)[shard::shards]:
            try:
                s = graph_time(
                    cycling(
                        lambda ids, c=candidate: fused_moe_decode(x, ids, w, gate_up, down, c, codecs=codecs),
                        sets,
                    )
                )
            except Exception as exc:  # a tile the compiler cannot fit (registers, shared memory): skipped
                print(f"sweep {asdict(candidate)}: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)
                continue
            sweep_rows.append({**asdict(candidate), "us": s * 1e6, "x_read": k * expert_bytes / s / copy})
        best = min(sweep_rows, key=lambda r: r["us"])
        blocks = DecodeBlocks(**{f: best[f] for f in asdict(DEFAULT_BLOCKS)})
        if int8:
            timed, tiles = [], [c for c in SWEEP_INT8 if args.codec == "Q4_K" or not c.chunk_tile]
            for candidate in tiles[shard::shards]:
                try:
                    timed.append(
                        (
                            graph_time(
                                cycling(
                                    lambda ids, c=candidate: fused_moe_decode(
                                        x, ids, w, gate_up, down, c, codecs=codecs, int8_act=True
                                    ),
                                    sets,
                                )
                            ),
                            candidate,
                        )
                    )
                except Exception as exc:
                    print(
                        f"sweep int8 {asdict(candidate)}: {type(exc).__name__}: {str(exc)[:120]}",
                        file=sys.stderr,
                    )
            int8_tiles = min(timed, key=lambda r: r[0])[1]
            sweep_rows += [
                {**asdict(c), "us": us * 1e6, "x_read": k * expert_bytes / us / copy, "int8": 1}
                for us, c in timed
            ]
    rows = []
    for t in [int(b) for b in args.batches.split(",")]:
        x = torch.randn(t, h, device="cuda").bfloat16()
        id_sets = [  # a different set each captured call: the experts are not in L2 from the call before
            torch.stack([torch.randperm(e, device="cuda", generator=g)[:k] for _ in range(t)])
            for _ in range(16)
        ]
        ids = id_sets[0]
        w = torch.rand(t, k, device="cuda")
        nbytes = int(torch.unique(ids).numel()) * expert_bytes

        fused = graph_time(
            cycling(
                lambda ids, x=x, w=w: fused_moe_decode(x, ids, w, gate_up, down, blocks, codecs=codecs),
                id_sets,
            )
        )
        gathered = (  # the torch path a stored bank takes dequantises what it uses: not graph-capturable
            graph_time(
                cycling(lambda ids, x=x, w=w: gathered_experts(x, ids, w, gate_up, down), id_sets), reps=5
            )
            if codecs is None
            else float("nan")
        )
        ref = grouped_experts(x.float(), ids, w, plain_gate_up, plain_down)
        got = fused_moe_decode(x, ids, w, gate_up, down, blocks, codecs=codecs).float()
        err = float((got - ref).norm() / ref.norm())
        int8_s, int8_err = float("nan"), float("nan")
        if int8:
            int8_s = graph_time(
                cycling(
                    lambda ids, x=x, w=w: fused_moe_decode(
                        x, ids, w, gate_up, down, int8_tiles, codecs=codecs, int8_act=True
                    ),
                    id_sets,
                )
            )
            got8 = fused_moe_decode(
                x, ids, w, gate_up, down, int8_tiles, codecs=codecs, int8_act=True
            ).float()
            int8_err = float((got8 - ref).norm() / ref.norm())
        rows.append(
            {
                "tokens": t,
                "experts_read": nbytes // expert_bytes,
                "fused_us": fused * 1e6,
                "fused_gbps": nbytes / fused / 1e9,
                "fused_x_read": nbytes / fused / copy,
                "gathered_us": gathered * 1e6,
                "speedup_vs_gathered": gathered / fused,
                "fused_x_hbm_peak": nbytes / fused / HBM_PEAK.get(torch.cuda.get_device_name(), float("nan")),
                "rel_err": err,
                "int8_us": int8_s * 1e6,
                "int8_x_read": nbytes / int8_s / copy,
                "int8_rel_err": int8_err,
            }
        )
    kernels, same_reads = {}, {}
    if args.kernels:  # batch 1, each call routed to other experts
        x = torch.randn(1, h, device="cuda").bfloat16()
        sets = [torch.randperm(e, device="cuda", generator=g)[:k][None] for _ in range(16)]
        w = torch.rand(1, k, device="cuda")
        part_bytes = (
            (2 * i * h * 2, h * i * 2)
            if codecs is None
            else (get_codec(args.codec).tensor_bytes(2 * i, h), get_codec(args.codec).tensor_bytes(h, i))
        )
        paths = {"float": (blocks, False)} | ({"int8": (int8_tiles, True)} if int8 else {})
        for path, (tiles, on) in paths.items():
            times = kernel_times(
                cycling(
                    lambda ids, tiles=tiles, on=on: fused_moe_decode(
                        x, ids, w, gate_up, down, tiles, codecs=codecs, int8_act=on
                    ),
                    sets,
                )
            )
            kernels[path] = kernel_rows(times, k * part_bytes[0], k * part_bytes[1])
        same_reads = {
            part: same_bytes_read(nbytes)
            for part, nbytes in (
                ("gate_up", k * part_bytes[0]),
                ("down", k * part_bytes[1]),
                ("step", k * sum(part_bytes)),
            )
        }
    doc = {
        "shape": {"hidden": h, "moe_inter": i, "experts": e, "top_k": k},
        "codec": args.codec,
        "device": torch.cuda.get_device_name(),
        "read_gbps": copy / 1e9,
        "blocks": asdict(blocks),
        "rows": rows,
        "sweep": sweep_rows,
        "kernels": kernels,
        "same_bytes_read": same_reads,
    }
    if args.json:
        print(json.dumps(doc, indent=1))
        return
    if sweep_rows:
        fastest = sorted(sweep_rows, key=lambda r: r["us"])
        for r in [r for r in fastest if not r.get("int8")][:5] + [r for r in fastest if r.get("int8")][:5]:
            print(
                f"sweep {r['gate_up_n']}x{r['gate_up_k']} / {r['down_n']}x{r['down_k']} w{r['num_warps']}"
                f"/{r['down_warps'] or r['num_warps']} s{r['num_stages']}{' int8' if r.get('int8') else ''}"
                f"{' regs ' + str(r['max_registers']) if r['max_registers'] else ''}"
                f"{' tile' if r['chunk_tile'] else ''}{' pdl' if r['pdl'] else ''}"
                f"{' parts ' + str(r['gate_up_splits']) if r['gate_up_splits'] > 1 else ''}"
                f"{' rounds ' + str(r['gate_up_rounds']) if r['gate_up_rounds'] > 1 else ''}"
                f"{' joint' if r['gate_up_joint'] else ''}"
                f"{' split' if r['split_choices'] else ''}: "
                f"{r['us']:.1f} us ({r['x_read']:.2f} x read)"
            )
        best = asdict(blocks).values()
        variable = "FREETOKEN_MOE_DECODE_BLOCKS" if codecs is None else "FREETOKEN_MOE_DECODE_CODEC_BLOCKS"
        print(f"best: {variable}={','.join(str(v) for v in best)}")
        if int8:
            print(f"best int8: {','.join(str(v) for v in asdict(int8_tiles).values())}")
    shape = f"H {h} I {i} E {e} K {k} {args.codec}"
    print(f"{doc['device']} · read {copy / 1e9:.0f} GB/s · {shape} · blocks {asdict(blocks)}")
    head = (
        "T",
        "experts",
        "fused us",
        "GB/s",
        "x read",
        "x peak",
        "gathered us",
        "speedup",
        "int8 us",
        "x read",
    )
    print(" ".join(f"{c:>{w}}" for c, w in zip(head, (3, 7, 9, 7, 7, 7, 12, 8, 8, 7), strict=True)))
    for r in rows:
        print(
            f"{r['tokens']:>3} {r['experts_read']:>7} {r['fused_us']:>9.1f} {r['fused_gbps']:>7.0f} "
            f"{r['fused_x_read']:>7.2f} {r['fused_x_hbm_peak']:>7.2f} {r['gathered_us']:>12.1f} "
            f"{r['speedup_vs_gathered']:>8.1f} {r['int8_us']:>8.1f} {r['int8_x_read']:>7.2f}"
        )
    for path, found in kernels.items():  # the GEMVs alone: device time, no launch gaps
        for r in found:
            share = f"{r['gbps']:7.0f} GB/s {r['gbps'] * 1e9 / copy:5.2f} x read" if r["gbps"] else ""
            print(f"{path:>5} kernel {r['us']:7.2f} us {share}  {r['kernel'][:60]}")
    for part, r in same_reads.items():  # the floor at this size: one plain launch reading the same bytes
        for name in ("sum", "loads"):
            device = r[f"{name}_device_us"]
            print(
                f"plain read ({name}) of {part}'s {r['bytes'] / 1e6:.1f} MB: {device:.2f} us device "
                f"({r['bytes'] / device * 1e6 / copy:.2f} x read), {r[f'{name}_graph_us']:.2f} us in a graph"
            )


if __name__ == "__main__":
    main()
