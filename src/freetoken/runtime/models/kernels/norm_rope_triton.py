"""Triton kernel bodies of the decode step's norms and rotary (launchers and references in norm_rope.py).

Every value the torch reference rounds to the model dtype is rounded here at the same point (compute in
fp32, round once), so results match torch bit for bit wherever fp32 sums and rsqrt agree:

  add_rms_norm:   s = x + r (rounded);  normed = w * (s · rsqrt(mean(s²) + eps)) (rounded, then rounded)
  qk_norm_rope:   per head: n = rms_norm(x, w) (or zero-centred: round(x̂·(1 + w)));  on the rotary dims
                  out = n·cos + rotate_half(n)·sin (each product and the sum rounded), the dims past
                  them n itself; key heads go to the cache at [slot, head, position] with the raw values.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _round(x, dtype: tl.constexpr, COMPILED: tl.constexpr):
    """fp32 -> dtype, to nearest even. Triton's interpreter truncates fp32 -> bf16 casts, so there bf16
    is rounded on the bits (finite values); compiled, this is the plain cast."""
    if COMPILED or dtype != tl.bfloat16:
        out = x.to(dtype)
    else:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        out = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return out


@triton.jit
def _in(x, dtype: tl.constexpr, COMPILED: tl.constexpr):
    """fp32 -> rounded to dtype -> fp32: a value as torch holds it in the model dtype."""
    return _round(x, dtype, COMPILED).to(tl.float32)


@triton.jit
def add_rms_norm_kernel(
    x_ptr,  # [B, H]
    res_ptr,  # [B, H] (unused without HAS_RESIDUAL)
    w_ptr,  # [H]
    normed_ptr,  # [B, H] out, contiguous
    summed_ptr,  # [B, H] out, contiguous (unused without HAS_RESIDUAL)
    stride_x,
    stride_r,
    eps,
    H: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ZERO_CENTRED: tl.constexpr,  # the weight w scales by (1 + w), rounded once (Qwen3.5's norms)
    COMPILED: tl.constexpr,  # False under Triton's interpreter
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = _round(x.to(tl.float32) + r.to(tl.float32), x.dtype, COMPILED)
        tl.store(summed_ptr + row * H + offs, x, mask=mask)
    h = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / H + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTRED:  # noqa: SIM108 (a constexpr branch: only one side is compiled)
        normed = h * rstd * (1.0 + w)
    else:
        normed = w * _in(h * rstd, x.dtype, COMPILED)
    tl.store(normed_ptr + row * H + offs, _round(normed, x.dtype, COMPILED), mask=mask)


@triton.jit
def _normed(
    h, w_ptr, offs, mask, rstd, dtype: tl.constexpr, ZERO_CENTRED: tl.constexpr, COMPILED: tl.constexpr
):
    """One piece of a head, RMS-normed: w·round(h·rstd) rounded (RMSNorm), or round(h·rstd·(1 + w)) where
    the weight is zero-centred (Qwen3.5's q/k norms)."""
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTRED:
        out = _in(h * rstd * (1.0 + w), dtype, COMPILED)
    else:
        out = _in(w * _in(h * rstd, dtype, COMPILED), dtype, COMPILED)
    return out


@triton.jit
def _norm_rope_head(
    x_ptr, w_ptr, cos_ptr, sin_ptr, eps, offs, mask, offs_r, mask_r,
    D: tl.constexpr, HALF: tl.constexpr, REST: tl.constexpr, NORM: tl.constexpr,
    ZERO_CENTRED: tl.constexpr, COMPILED: tl.constexpr,
):  # fmt: skip
    """One head -> (first, second) half of its rotary dims and the REST dims after them (passed through),
    of rotary(rms_norm(x)) (rotary(x) without NORM), in x's dtype. The norm spans all D dims."""
    x1 = tl.load(x_ptr + offs, mask=mask, other=0.0)
    x2 = tl.load(x_ptr + HALF + offs, mask=mask, other=0.0)
    x3 = tl.load(x_ptr + 2 * HALF + offs_r, mask=mask_r, other=0.0)
    dtype = x1.dtype
    h1, h2, h3 = x1.to(tl.float32), x2.to(tl.float32), x3.to(tl.float32)
    if NORM:
        squares = tl.sum(h1 * h1, axis=0) + tl.sum(h2 * h2, axis=0) + tl.sum(h3 * h3, axis=0)
        rstd = tl.rsqrt(squares / D + eps)
        n1 = _normed(h1, w_ptr, offs, mask, rstd, dtype, ZERO_CENTRED, COMPILED)
        n2 = _normed(h2, w_ptr + HALF, offs, mask, rstd, dtype, ZERO_CENTRED, COMPILED)
        n3 = _normed(h3, w_ptr + 2 * HALF, offs_r, mask_r, rstd, dtype, ZERO_CENTRED, COMPILED)
    else:  # the values themselves (exact in fp32)
        n1, n2, n3 = h1, h2, h3
    c1 = tl.load(cos_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1): each product rounded, then the sum
    out1 = _round(_in(n1 * c1, dtype, COMPILED) + _in(-n2 * s1, dtype, COMPILED), dtype, COMPILED)
    out2 = _round(_in(n2 * c2, dtype, COMPILED) + _in(n1 * s2, dtype, COMPILED), dtype, COMPILED)
    return out1, out2, _round(n3, dtype, COMPILED)


@triton.jit
def _store_head(out, out1, out2, out3, offs, mask, offs_r, mask_r, HALF: tl.constexpr):
    tl.store(out + offs, out1, mask=mask)
    tl.store(out + HALF + offs, out2, mask=mask)
    tl.store(out + 2 * HALF + offs_r, out3, mask=mask_r)


@triton.jit
def qk_norm_rope_kv_write_kernel(
    q_ptr,  # [B, NH, D], D contiguous (heads `stride_qh` apart)
    k_ptr,  # [B, KVH * D]
    v_ptr,  # [B, KVH * D]
    q_w_ptr,  # [D]
    k_w_ptr,  # [D]
    cos_ptr,  # [B, 2 * HALF]: the rotary dims (the first 2 * HALF of each head)
    sin_ptr,  # [B, 2 * HALF]
    k_cache_ptr,  # [S, KVH, CAP, D], D contiguous
    v_cache_ptr,  # same shape and strides
    slots_ptr,  # [B] int32, < 0: write nothing
    positions_ptr,  # [B] int32
    q_out_ptr,  # [B, NH, D] out, contiguous
    stride_q,
    stride_qh,
    stride_k,
    stride_v,
    stride_cos,
    stride_sin,
    stride_cs,
    stride_ch,
    stride_cn,
    eps,
    cap,  # positions per slot: a position outside [0, cap) writes nothing
    NH: tl.constexpr,
    D: tl.constexpr,
    HALF: tl.constexpr,  # half the rotary dims
    REST: tl.constexpr,  # D - 2 * HALF: dims past the rotary ones, normed and passed through
    BLOCK: tl.constexpr,  # >= HALF
    BLOCK_R: tl.constexpr,  # >= REST (>= 1)
    NORM: tl.constexpr,  # False: no q/k norm (the weights are not read)
    ZERO_CENTRED: tl.constexpr,  # norm weights w scale by (1 + w)
    COMPILED: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)  # [0, NH): a query head; [NH, NH + KVH): a key head and its value
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < REST
    cos = cos_ptr + row * stride_cos
    sin = sin_ptr + row * stride_sin
    if head < NH:
        x = q_ptr + row * stride_q + head * stride_qh
        out1, out2, out3 = _norm_rope_head(
            x, q_w_ptr, cos, sin, eps, offs, mask, offs_r, mask_r, D, HALF, REST, NORM, ZERO_CENTRED, COMPILED
        )
        _store_head(q_out_ptr + (row * NH + head) * D, out1, out2, out3, offs, mask, offs_r, mask_r, HALF)
    else:
        kv_head = head - NH
        x = k_ptr + row * stride_k + kv_head * D
        out1, out2, out3 = _norm_rope_head(
            x, k_w_ptr, cos, sin, eps, offs, mask, offs_r, mask_r, D, HALF, REST, NORM, ZERO_CENTRED, COMPILED
        )
        slot = tl.load(slots_ptr + row)
        position = tl.load(positions_ptr + row)
        writes = (slot >= 0) & (position >= 0) & (position < cap)  # a padding row writes nothing
        live = offs < tl.where(writes, HALF, 0)
        live_r = offs_r < tl.where(writes, REST, 0)
        at = tl.maximum(slot, 0).to(tl.int64) * stride_cs + kv_head * stride_ch
        at += tl.maximum(position, 0).to(tl.int64) * stride_cn
        _store_head(k_cache_ptr + at, out1, out2, out3, offs, live, offs_r, live_r, HALF)
        v = v_ptr + row * stride_v + kv_head * D
        v1 = tl.load(v + offs, mask=live, other=0.0)
        v2 = tl.load(v + HALF + offs, mask=live, other=0.0)
        v3 = tl.load(v + 2 * HALF + offs_r, mask=live_r, other=0.0)
        _store_head(v_cache_ptr + at, v1, v2, v3, offs, live, offs_r, live_r, HALF)
