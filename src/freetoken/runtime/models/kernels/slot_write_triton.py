"""Triton kernel body of the row write (launcher and reference in slot_write.py): program b copies row b
into cache[slots[b], 0, positions[b], :W] unless the slot is < 0 or the position outside [0, cap)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def slot_write_kernel(
    rows_ptr,  # [B, W], W contiguous
    cache_ptr,  # [S, H, CAP, W'], W' >= W contiguous
    slots_ptr,  # [B] int32
    positions_ptr,  # [B] int32
    stride_row,
    stride_cs,
    stride_cn,
    cap,
    W: tl.constexpr,
    BLOCK: tl.constexpr,  # >= W
):
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row)
    position = tl.load(positions_ptr + row)
    writes = (slot >= 0) & (position >= 0) & (position < cap)
    offs = tl.arange(0, BLOCK)
    live = offs < tl.where(writes, W, 0)
    at = tl.maximum(slot, 0).to(tl.int64) * stride_cs + tl.maximum(position, 0).to(tl.int64) * stride_cn
    values = tl.load(rows_ptr + row * stride_row + offs, mask=live, other=0.0)
    tl.store(cache_ptr + at + offs, values, mask=live)
