"""Triton kernel bodies of slot decode attention (launcher and reference in decode_attention.py).

Flash decoding over a slot cache: a split program owns one (row, KV head, split), all G query heads
of that KV head, and one share of the row's keys [0, length); it writes its partial softmax state
(output normalised by its own sum, and the log2 of that sum plus its max) to fp32 buffers. A combine
program per (row, query head) merges the SPLITS partials. Each split's key range is computed in the
kernel from the length in device memory, so one launch (or one CUDA graph) serves any lengths.

  split:   o[b, h, s] = Σ_n p_n v_n / Σ_n p_n,  lse[b, h, s] = max_n t_n + log2 Σ_n p_n,
           t_n = scale·log2(e)·(q[b, h] · k[slot, kvh, n]),  p_n = 2^(t_n - max t)
  combine: out[b, h] = Σ_s 2^lse_s o_s / (Σ_s 2^lse_s + 2^sink_h)   (a split with no keys has lse =
           -inf; sink_h = sinks[h]·log2(e), the head's learned sink logit, where the model has them)

With a WINDOW (sliding-window layers) a row sees keys [max(0, length − WINDOW), length) only: the splits
share that range.

A row whose slot is < 0 loads nothing and gets zeros; lengths are clamped to [0, CAP], so a bad one
cannot read past its slot.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def split_range(first, length, split, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Split `split`'s share [start, end) of the keys [first, length): whole blocks, the last split short
    or empty."""
    chunk = tl.cdiv(tl.cdiv(length - first, SPLITS), BLOCK_N) * BLOCK_N
    start = first + split * chunk
    return start, tl.minimum(start + chunk, length)


@triton.jit
def _attend_block(
    q, m, denom, acc, k_base, v_base, n0, end, qk_scale, stride_cn, offs_d, mask_d,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, COMPILED: tl.constexpr,
):  # fmt: skip
    """One block of keys [n0, n0 + BLOCK_N) ∩ [.., end) folded into the running (max, sum, acc)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    key_live = offs_n < end
    kv_mask = key_live[:, None] & mask_d[None, :]
    rows = offs_n[:, None] * stride_cn + offs_d[None, :]
    k = tl.load(k_base + rows, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
    if not COMPILED:  # the interpreter's tl.dot multiplies bf16 bit patterns as integers: go through fp32
        k = k.to(tl.float32)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_H, BLOCK_N], log2
    scores = tl.where(key_live[None, :], scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))  # finite: a block's first key is always live
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(scores - m_new[:, None])
    v = tl.load(v_base + rows, mask=kv_mask, other=0.0)
    p_v = p.to(v.dtype)  # probabilities in the cache dtype, as layers.decode_attention does
    if not COMPILED:
        p_v, v = p_v.to(tl.float32), v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p_v, v, input_precision=DOT_PRECISION)
    return m_new, denom * alpha + tl.sum(p, axis=1), acc


@triton.jit
def split_attention_kernel(
    q_ptr,  # [B, NH, D], D contiguous
    k_ptr,  # [S, KVH, CAP, D], D contiguous
    v_ptr,  # same shape and strides as k
    slots_ptr,  # [B] int32, < 0: padding
    lengths_ptr,  # [B] int32
    part_o_ptr,  # [B, NH, SPLITS, D] fp32 out
    part_lse_ptr,  # [B, NH, SPLITS] fp32 out, log2 units
    qk_scale,  # scale * log2(e)
    cap,  # keys per slot: lengths are clamped to [0, cap]
    window,  # > 0: only the last `window` keys of the row
    stride_qb,
    stride_qh,
    stride_cs,
    stride_ch,
    stride_cn,
    NH: tl.constexpr,
    G: tl.constexpr,  # query heads per KV head
    D: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,  # >= G and >= 16 (tl.dot's smallest tile)
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    COMPILED: tl.constexpr,  # False under Triton's interpreter
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    slot = tl.load(slots_ptr + row)
    valid = slot >= 0
    length = tl.where(valid, tl.minimum(tl.maximum(tl.load(lengths_ptr + row), 0), cap), 0)
    first = tl.where(window > 0, tl.maximum(length - window, 0), 0)
    start, end = split_range(first, length, split, SPLITS, BLOCK_N)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    heads = kv_head * G + offs_h
    head_live = offs_h < tl.where(valid, G, 0)
    q_ptrs = q_ptr + row * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=head_live[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
    if not COMPILED:
        q = q.to(tl.float32)
    base = tl.maximum(slot, 0).to(tl.int64) * stride_cs + kv_head * stride_ch
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    denom = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    if COMPILED:
        for n0 in range(start, end, BLOCK_N):
            m, denom, acc = _attend_block(
                q, m, denom, acc, k_ptr + base, v_ptr + base, n0, end, qk_scale, stride_cn, offs_d, mask_d,
                BLOCK_N, DOT_PRECISION, COMPILED,
            )  # fmt: skip
    else:  # the interpreter cannot take loaded values as range() bounds; the same body in a while loop
        n0 = start
        while n0 < end:
            m, denom, acc = _attend_block(
                q, m, denom, acc, k_ptr + base, v_ptr + base, n0, end, qk_scale, stride_cn, offs_d, mask_d,
                BLOCK_N, DOT_PRECISION, COMPILED,
            )  # fmt: skip
            n0 += BLOCK_N

    has_keys = denom > 0.0
    denom = tl.where(has_keys, denom, 1.0)
    lse = tl.where(has_keys, m + tl.log2(denom), float("-inf"))
    out = acc / denom[:, None]
    part = (row * NH + heads) * SPLITS + split  # [BLOCK_H]
    head_in = offs_h < G
    tl.store(part_lse_ptr + part, lse, mask=head_in)
    written = offs_h < tl.where(end > start, G, 0)  # an empty split leaves its output unwritten
    tl.store(part_o_ptr + part[:, None] * D + offs_d[None, :], out, mask=written[:, None] & mask_d[None, :])


@triton.jit
def combine_splits_kernel(
    part_o_ptr,  # [B, NH, SPLITS, D] fp32
    part_lse_ptr,  # [B, NH, SPLITS] fp32
    sinks_ptr,  # [NH] fp32, natural-log units (read only with HAS_SINKS)
    out_ptr,  # [B, NH * D] in q's dtype
    NH: tl.constexpr,
    D: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    part = (row * NH + head) * SPLITS + offs_s
    lse = tl.load(part_lse_ptr + part, mask=offs_s < SPLITS, other=float("-inf"))
    live = lse > float("-inf")
    top = tl.max(lse, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head) * 1.4426950408889634  # log2(e)
        top = tl.where(top > float("-inf"), tl.maximum(top, sink), top)
    top = tl.where(top > float("-inf"), top, 0.0)  # a padding row: every split empty, weights all 0
    w = tl.where(live, tl.exp2(lse - top), 0.0)
    o_ptrs = part_o_ptr + part[:, None] * D + offs_d[None, :]
    o = tl.load(o_ptrs, mask=live[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
    total = tl.sum(w, axis=0)
    if HAS_SINKS:  # the sink takes its share of the denominator (none on a row with no key)
        total += tl.where(total > 0.0, tl.exp2(sink - top), 0.0)
    out = tl.sum(o * w[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + row * NH * D + head * D + offs_d, out.to(out_ptr.dtype.element_ty), mask=mask_d)
