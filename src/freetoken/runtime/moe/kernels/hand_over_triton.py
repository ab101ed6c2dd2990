"""Triton kernel bodies of the CPU branch's hand-over (launchers and references in hand_over.py).

stage_kernel, one program: the hand-over's ids [PAIRS] decide. Any id >= 0: the header (ROWS, row), x as
fp32 [ROWS, H], the ids (int64) and the weights (fp32) are stored into the page-locked stage through
unified addressing, the program's threads meet at a barrier, and the submit word is set to 1 with a
release at system scope (the stage's bytes are visible to the host before the word is). No id >= 0: the
stage is left alone and the done word is set to 1 the same way: the hand-over answers itself. With COUNT,
either way the number of distinct ids >= 0 (a pair compared with every earlier one) is added to two
words of a counters row (COL_A, COL_B): the no-slot decode counts its misses here, with no node of its own.

merge_kernel, grid (cdiv(N, BLOCK),): dst = out + result rounded to out's dtype where the hand-over had a
CPU pair, else out (the result buffer then holds an older layer's numbers, never read); with OUT_IS_ZERO
out is taken as zero and not read. On CUDA the result is the branch's page-locked output, read in place
through unified addressing once the stream's wait for the done word has passed: no copy back. Its loads
bypass the caches (.cv), since every layer's answer comes at the same addresses.

Stage layout (byte offsets, rows = ROWS): header int64 [2] at 0, x fp32 [rows, H] at 16, ids int64
[rows, K] at 16 + 4·rows·H (8-aligned: H is even), weights fp32 [rows, K] after the ids.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _has_pairs(ids_ptr, PAIRS: tl.constexpr, PAIRS_P2: tl.constexpr):
    p = tl.arange(0, PAIRS_P2)
    ids = tl.load(ids_ptr + p, mask=p < PAIRS, other=-1)
    return tl.max((ids >= 0).to(tl.int32), axis=0) > 0


@triton.jit
def _distinct_ids(ids_ptr, PAIRS: tl.constexpr, PAIRS_P2: tl.constexpr):
    p = tl.arange(0, PAIRS_P2)
    ids = tl.load(ids_ptr + p, mask=p < PAIRS, other=-1)
    earlier = (ids[:, None] == ids[None, :]) & (p[None, :] < p[:, None])  # [P, P]: pair j before pair i
    first = (tl.sum(earlier.to(tl.int32), axis=1) == 0) & (ids >= 0)
    return tl.sum(first.to(tl.int64), axis=0)


@triton.jit
def stage_kernel(
    x_ptr,  # [ROWS, H] any float dtype, contiguous
    ids_ptr,  # [ROWS, K] int64 (-1: not the CPU's pair)
    w_ptr,  # [ROWS, K] float
    stage64_ptr,  # the stage as int64 words
    stage32_ptr,  # the stage as fp32 words (the same bytes)
    flags_ptr,  # int32 [2]: submit, done
    row,  # the layer's row in the branch
    counts_ptr,  # int64 counters row (read only with COUNT)
    ROWS: tl.constexpr,
    H: tl.constexpr,
    K: tl.constexpr,
    PAIRS_P2: tl.constexpr,
    BLOCK: tl.constexpr,
    COUNT: tl.constexpr,
    COL_A: tl.constexpr,
    COL_B: tl.constexpr,
):
    PAIRS: tl.constexpr = ROWS * K
    if COUNT:  # one program: a plain read-modify-write is exact
        n = _distinct_ids(ids_ptr, PAIRS, PAIRS_P2)
        tl.store(counts_ptr + COL_A, tl.load(counts_ptr + COL_A) + n)
        tl.store(counts_ptr + COL_B, tl.load(counts_ptr + COL_B) + n)
    if _has_pairs(ids_ptr, PAIRS, PAIRS_P2):
        two = tl.arange(0, 2)
        header = tl.where(two == 0, ROWS, row).to(tl.int64)
        tl.store(stage64_ptr + two, header)
        for start in tl.static_range(0, ROWS * H, BLOCK):
            o = start + tl.arange(0, BLOCK)
            m = o < ROWS * H
            tl.store(stage32_ptr + 4 + o, tl.load(x_ptr + o, mask=m).to(tl.float32), mask=m)
        p = tl.arange(0, PAIRS_P2)
        pm = p < PAIRS
        ids_at: tl.constexpr = (16 + 4 * ROWS * H) // 8
        tl.store(stage64_ptr + ids_at + p, tl.load(ids_ptr + p, mask=pm), mask=pm)
        w_at: tl.constexpr = (16 + 4 * ROWS * H + 8 * PAIRS) // 4
        tl.store(stage32_ptr + w_at + p, tl.load(w_ptr + p, mask=pm).to(tl.float32), mask=pm)
        tl.debug_barrier()
        tl.atomic_xchg(flags_ptr, 1, sem="release", scope="sys")
    else:
        tl.atomic_xchg(flags_ptr + 1, 1, sem="release", scope="sys")


@triton.jit
def merge_kernel(
    out_ptr,  # [N] the device's part, contiguous
    result_ptr,  # [N] fp32, the CPU's part (page-locked host memory on CUDA)
    ids_ptr,  # [PAIRS] int64, the hand-over's ids
    dst_ptr,  # [N] out's dtype
    N,
    PAIRS: tl.constexpr,
    PAIRS_P2: tl.constexpr,
    BLOCK: tl.constexpr,
    OUT_IS_ZERO: tl.constexpr,  # out's values not read: the device's part is zero
):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < N
    if OUT_IS_ZERO:
        out = tl.zeros((BLOCK,), dtype=dst_ptr.dtype.element_ty)
    else:
        out = tl.load(out_ptr + o, mask=m, other=0.0)
    if _has_pairs(ids_ptr, PAIRS, PAIRS_P2):
        # as torch adds two tensors of out's dtype: the result rounded to it, the sum in fp32, rounded
        part = tl.load(result_ptr + o, mask=m, other=0.0, cache_modifier=".cv")
        part = part.to(dst_ptr.dtype.element_ty).to(tl.float32)
        out = (out.to(tl.float32) + part).to(dst_ptr.dtype.element_ty)
    tl.store(dst_ptr + o, out, mask=m)
