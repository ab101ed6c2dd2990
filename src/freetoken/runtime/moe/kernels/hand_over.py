"""The CPU branch's hand-over as device work that decides by itself whether the CPU is needed.

A decode step hands each MoE layer's CPU pairs over (stream_branch.py). Most layers of a well-cached
step have none; a round trip through the coordinator for those (flag, thread, kernel call, flag) costs
tens of microseconds a layer. So the stage is written by a kernel that looks at the ids first:

  stage    any CPU pair: header, x, ids and weights into the page-locked stage, then submit = 1 (the
           coordinator serves it); none: done = 1 at once (the stream's wait passes, the coordinator never
           hears of it). One program; its stores reach host memory through unified addressing, ordered
           before the flag by a barrier and a system-scope release.
           Optionally it also counts the step's distinct experts into a counters row (the no-slot decode's
           misses), so that count costs no node of its own.
  merge    out + the CPU's result (read where the coordinator wrote it) where the hand-over had a CPU
           pair, else out.

`stage_reference` / `merge_reference` do the same in torch: the cpu device standing in runs them (with
the coordinator's own signal and answer), and the tests compare the kernels with them (Triton's
interpreter runs the kernel bodies on CPU tensors without CUDA).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType

import torch

from freetoken.runtime.triton_support import next_pow2

HEADER_BYTES = 16  # int64 rows, int64 layer row
STAGE_BLOCK = 1024  # x values per store step of the stage kernel
MERGE_BLOCK = 1024
COUNT_MAX_PAIRS = 256  # the stage kernel compares every pair with every other; above, torch counts


@dataclass(frozen=True)
class DistinctCount:
    """Where a hand-over adds its number of distinct expert ids (0 <= id < num_experts): two words of an
    int64 row."""

    row: torch.Tensor  # int64 [C], on the hand-over's device
    cols: tuple[int, int]
    num_experts: int


def add_distinct_reference(ids: torch.Tensor, count: DistinctCount) -> None:
    """Adds the distinct ids >= 0 of `ids` to both words, by device ops (no read-back)."""
    e = count.num_experts
    seen = torch.zeros(e + 1, dtype=torch.int64, device=ids.device)  # [E + 1]: slot 0 for "no pair"
    seen.scatter_(0, (ids.reshape(-1) + 1).clamp(0, e), 1)
    distinct = seen[1:].sum()
    for col in count.cols:
        count.row[col] += distinct


def stage_bytes(rows: int, hidden: int, top_k: int) -> int:
    """Bytes of one hand-over: header, x fp32 [rows, H], ids int64 [rows, K], weights fp32 [rows, K]."""
    return HEADER_BYTES + rows * (4 * hidden + 12 * top_k)


def has_cpu_pairs(ids: torch.Tensor) -> bool:
    return bool((ids >= 0).any())


@functools.cache
def _body() -> tuple[ModuleType, bool]:
    from triton.runtime.interpreter import InterpretedFunction

    from freetoken.runtime.moe.kernels import hand_over_triton as body

    return body, isinstance(body.stage_kernel, InterpretedFunction)


def stage_hand_over(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    stage: torch.Tensor,
    flags: torch.Tensor,
    row: int,
    count: DistinctCount | None = None,
) -> None:
    """x [T, H], ids [T, K] int64, weights [T, K] on the device; `stage` uint8 (the page-locked region's
    stage, its length a multiple of 8) and `flags` int32 [2] (submit, done) in page-locked host memory;
    `count` where to add the distinct ids (in the kernel up to COUNT_MAX_PAIRS pairs)."""
    body, _ = _body()
    t, h = x.shape
    k = ids.shape[1]
    ids = ids.contiguous()
    fused = count is not None and t * k <= COUNT_MAX_PAIRS
    cols = count.cols if fused else (0, 0)
    body.stage_kernel[(1,)](
        x.contiguous(), ids, weights.contiguous(), stage.view(torch.int64), stage.view(torch.float32),
        flags, row, count.row if fused else flags, ROWS=t, H=h, K=k, PAIRS_P2=next_pow2(t * k),
        BLOCK=STAGE_BLOCK, COUNT=fused, COL_A=cols[0], COL_B=cols[1],
    )  # fmt: skip
    if count is not None and not fused:
        add_distinct_reference(ids, count)


def merge_hand_over(
    out: torch.Tensor, result: torch.Tensor, ids: torch.Tensor, out_is_zero: bool = False
) -> torch.Tensor:
    """out [T, H] + result [>= T, H] fp32 (rounded to out's dtype) where `ids` [T, K] has a CPU pair;
    `result` on the device or page-locked host memory the device maps. `out_is_zero`: the device had no
    part (every pair the CPU's): out's values are not read, only its shape and dtype (no zeroing node)."""
    body, _ = _body()
    t, h = out.shape
    out = out.contiguous()
    dst = torch.empty_like(out)
    n = t * h
    body.merge_kernel[(-(-n // MERGE_BLOCK),)](
        out, result, ids.contiguous(), dst, n, PAIRS=ids.numel(), PAIRS_P2=next_pow2(ids.numel()),
        BLOCK=MERGE_BLOCK, OUT_IS_ZERO=out_is_zero,
    )  # fmt: skip
    return dst


def stage_reference(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    stage: torch.Tensor,
    row: int,
    count: DistinctCount | None = None,
) -> bool:
    """The stage kernel's bytes, written by torch when the hand-over has a CPU pair; returns whether it
    has (the caller then signals submit, else answers done)."""
    if count is not None:
        add_distinct_reference(ids, count)
    if not has_cpu_pairs(ids):
        return False
    t, h = x.shape
    k = ids.shape[1]
    stage[:HEADER_BYTES].view(torch.int64).copy_(torch.tensor([t, row], dtype=torch.int64))
    a = HEADER_BYTES
    stage[a : a + 4 * t * h].view(torch.float32).view(t, h).copy_(x)
    a += 4 * t * h
    stage[a : a + 8 * t * k].view(torch.int64).view(t, k).copy_(ids)
    a += 8 * t * k
    stage[a : a + 4 * t * k].view(torch.float32).view(t, k).copy_(weights)
    return True


def merge_reference(
    out: torch.Tensor, result: torch.Tensor, ids: torch.Tensor, out_is_zero: bool = False
) -> torch.Tensor:
    if out_is_zero:
        out = torch.zeros_like(out)
    if not has_cpu_pairs(ids):
        return out
    return out + result[: out.shape[0]].to(out.device, out.dtype)
