"""Triton kernel body of the slot fill (launcher, reference and the word-size choice in expert_fill.py).

Grid (P, gu_chunks + dn_chunks): program (r, c) copies chunk c of plan row r's expert, from the host
banks (read in place through unified virtual addressing) into its slot of the device banks:

  r >= count[0], or plan[r] has an entry out of [0, E) x [0, S)    return (padding rows hold -1)
  c < gu_chunks                                                     gate_up words [c, c + 1) * CHUNK
  else                                                              down words [c', c' + 1) * CHUNK,
                                                                    c' = c - gu_chunks

Each bank is [rows, words] of one integer word type (chosen per bank pair by the launcher), so one
expert's part is a contiguous run of `*_words` words, from the start of its row (a device row may be
longer: `*_slot_words` apart); CHUNK = BLOCK * ITERS, and the last chunk masks its tail. Word offsets
past the expert's base are int64 (a bank can exceed 2**31 words).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _copy_chunk(
    src_ptr,  # [E, n_words] words
    dst_ptr,  # [S, slot_words >= n_words] words
    expert,
    slot,
    n_words,
    slot_words,
    chunk,
    BLOCK: tl.constexpr,
    ITERS: tl.constexpr,
):
    start = chunk.to(tl.int64) * (BLOCK * ITERS)
    src = src_ptr + expert.to(tl.int64) * n_words + start
    dst = dst_ptr + slot.to(tl.int64) * slot_words + start
    # words of this run from the chunk's start on, at most a chunk: int32 masks, whatever the bank's size
    left = tl.minimum(n_words - start, BLOCK * ITERS).to(tl.int32)
    offs = tl.arange(0, BLOCK)
    for it in tl.static_range(ITERS):
        live = offs < left - it * BLOCK
        words = tl.load(src + it * BLOCK + offs, mask=live)
        tl.store(dst + it * BLOCK + offs, words, mask=live)


@triton.jit
def fill_slots_kernel(
    plan_ptr,  # [P, 2] int32, contiguous: (expert, slot) rows
    count_ptr,  # [1] int32: rows [0, count) are live
    src_gu_ptr,  # [E, gu_words] host words
    dst_gu_ptr,  # [S, gu_slot_words] device words
    src_dn_ptr,  # [E, dn_words] host words
    dst_dn_ptr,  # [S, dn_slot_words] device words
    gu_words,
    dn_words,
    gu_slot_words,
    dn_slot_words,
    gu_chunks,  # programs c < gu_chunks copy gate_up; the rest copy down
    num_experts,
    num_slots,
    BLOCK: tl.constexpr,  # words per load and store (a power of two)
    ITERS: tl.constexpr,  # load-store steps per program
):
    row = tl.program_id(0)
    if row >= tl.load(count_ptr):
        return
    expert = tl.load(plan_ptr + 2 * row)
    slot = tl.load(plan_ptr + 2 * row + 1)
    if (expert < 0) | (expert >= num_experts) | (slot < 0) | (slot >= num_slots):
        return
    chunk = tl.program_id(1)
    if chunk < gu_chunks:
        _copy_chunk(src_gu_ptr, dst_gu_ptr, expert, slot, gu_words, gu_slot_words, chunk, BLOCK, ITERS)
    else:
        _copy_chunk(
            src_dn_ptr, dst_dn_ptr, expert, slot, dn_words, dn_slot_words, chunk - gu_chunks, BLOCK, ITERS
        )
