"""Triton kernel body of latent attention's decode over the slot cache (launcher in latent_attention.py).

Absorbed MLA is multi-query attention with one shared "head": every query head scores the row's cached
[c ; k_pe] (R + DR numbers a position) and mixes the latents c (the first R). A split program owns one
(row, block of BLOCK_H query heads, split) and one share of the row's positions [0, length): it loads
each block of positions once for all its heads, scores them in two tensor-core products (c with the
heads' absorbed q_c, k_pe with their q_pe), keeps the running softmax, and writes its partial state in
decode_attention_triton's layout, whose combine kernel merges the splits:

  o[b, h, s] = Σ_n p_n c_n / Σ_n p_n,   lse[b, h, s] = max_n t_n + log2 Σ_n p_n,
  t_n = scale·log2(e)·(q_c[b, h] · c_n + q_pe[b, h] · k_pe_n)

A row whose slot is < 0 loads nothing (every split empty: zeros after the combine); lengths are clamped
to [0, CAP].
"""

from __future__ import annotations

import triton
import triton.language as tl

from freetoken.runtime.models.kernels.decode_attention_triton import split_range


@triton.jit
def _latent_block(
    q_c, q_pe, m, denom, acc, base, n0, end, qk_scale, stride_cn, offs_r, mask_r, offs_p, mask_p,
    R: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, COMPILED: tl.constexpr,
):  # fmt: skip
    """Positions [n0, n0 + BLOCK_N) ∩ [.., end) folded into the running (max, sum, acc)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    live = offs_n < end
    rows = base + offs_n[:, None] * stride_cn
    c = tl.load(rows + offs_r[None, :], mask=live[:, None] & mask_r[None, :], other=0.0)  # [BLOCK_N, BLOCK_R]
    pe = tl.load(rows + R + offs_p[None, :], mask=live[:, None] & mask_p[None, :], other=0.0)
    if not COMPILED:  # the interpreter's tl.dot multiplies bf16 bit patterns as integers: go through fp32
        c, pe = c.to(tl.float32), pe.to(tl.float32)
    scores = tl.dot(q_c, tl.trans(c), input_precision=DOT_PRECISION)
    scores = tl.dot(q_pe, tl.trans(pe), scores, input_precision=DOT_PRECISION) * qk_scale  # [H, N], log2
    scores = tl.where(live[None, :], scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))  # finite: a block's first position is always live
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(scores - m_new[:, None])
    p_c = p.to(c.dtype)  # probabilities in the cache dtype, as the torch path mixes them
    acc = acc * alpha[:, None] + tl.dot(p_c, c, input_precision=DOT_PRECISION)
    return m_new, denom * alpha + tl.sum(p, axis=1), acc


@triton.jit
def split_latent_kernel(
    q_ptr,  # [B, NH, R + DR], the last dim contiguous: the heads' absorbed q_c, then q_pe
    cache_ptr,  # [S, CAP, R + DR] (the pool's [S, 1, CAP, R + DR]), the last dim contiguous
    slots_ptr,  # [B] int32, < 0: padding
    lengths_ptr,  # [B] int32
    part_o_ptr,  # [B, NH, SPLITS, R] fp32 out
    part_lse_ptr,  # [B, NH, SPLITS] fp32 out, log2 units
    qk_scale,  # scale * log2(e)
    cap,
    stride_qb,
    stride_qh,
    stride_cs,
    stride_cn,
    NH: tl.constexpr,
    R: tl.constexpr,
    DR: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,  # >= 16 (tl.dot's smallest tile)
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    COMPILED: tl.constexpr,
):
    row = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    slot = tl.load(slots_ptr + row)
    valid = slot >= 0
    length = tl.where(valid, tl.minimum(tl.maximum(tl.load(lengths_ptr + row), 0), cap), 0)
    start, end = split_range(0, length, split, SPLITS, BLOCK_N)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_in = heads < NH
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    mask_r = offs_r < R
    mask_p = offs_p < DR
    q_rows = q_ptr + row * stride_qb + heads[:, None] * stride_qh
    q_c = tl.load(q_rows + offs_r[None, :], mask=head_in[:, None] & mask_r[None, :], other=0.0)
    q_pe = tl.load(q_rows + R + offs_p[None, :], mask=head_in[:, None] & mask_p[None, :], other=0.0)
    if not COMPILED:
        q_c, q_pe = q_c.to(tl.float32), q_pe.to(tl.float32)
    base = cache_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_cs
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    denom = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    if COMPILED:
        for n0 in range(start, end, BLOCK_N):
            m, denom, acc = _latent_block(
                q_c, q_pe, m, denom, acc, base, n0, end, qk_scale, stride_cn, offs_r, mask_r, offs_p, mask_p,
                R, BLOCK_N, DOT_PRECISION, COMPILED,
            )  # fmt: skip
    else:  # the interpreter cannot take loaded values as range() bounds
        n0 = start
        while n0 < end:
            m, denom, acc = _latent_block(
                q_c, q_pe, m, denom, acc, base, n0, end, qk_scale, stride_cn, offs_r, mask_r, offs_p, mask_p,
                R, BLOCK_N, DOT_PRECISION, COMPILED,
            )  # fmt: skip
            n0 += BLOCK_N

    has_keys = denom > 0.0
    lse = tl.where(has_keys, m + tl.log2(tl.where(has_keys, denom, 1.0)), float("-inf"))
    out = acc / tl.where(has_keys, denom, 1.0)[:, None]
    part = (row * NH + heads) * SPLITS + split  # [BLOCK_H]
    tl.store(part_lse_ptr + part, lse, mask=head_in)
    written = heads < tl.where(end > start, NH, 0)  # an empty split leaves its output unwritten (lse -inf)
    tl.store(part_o_ptr + part[:, None] * R + offs_r[None, :], out, mask=written[:, None] & mask_r[None, :])
