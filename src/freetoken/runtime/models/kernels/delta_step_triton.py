"""Triton kernel bodies of a gated DeltaNet layer's decode step (launchers and references in
delta_step.py). Each row reads and writes its own slot of the static state blocks; a row whose slot is
< 0 (padding) reads nothing and writes no state.

  causal_conv_step_kernel  program (row, channel block): out = silu(Σ_j w[c, j]·window[c, j]) over the
                           window [state[slot, c, :], x[c]], the state shifted by one, x appended.
  delta_rule_step_kernel   program (row, value head, block of value dims): q, k l2-normed (q scaled by
                           Dk^-1/2), β = sigmoid(b), g = −exp(A_log)·softplus(a + dt_bias) (or, for
                           Kimi Delta Attention, a given log decay per key channel);
                           S ← e^g·S;  S ← S + k ⊗ β(v − Sᵀk);  o = Sᵀq — in fp32, the state fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def causal_conv_step_kernel(
    x_ptr,  # [B, C] the new inputs, C contiguous
    state_ptr,  # [S, C, W - 1] the last W - 1 inputs of each slot, contiguous
    w_ptr,  # [C, W] depthwise weights, contiguous
    slots_ptr,  # [B] int32
    out_ptr,  # [B, C] out, contiguous
    stride_x,
    C: tl.constexpr,
    W: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_W: tl.constexpr,  # >= W
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BC]
    taps = tl.arange(0, BLOCK_W)  # [BW]
    slot = tl.load(slots_ptr + row)
    live = slot >= 0
    c_in = cols < C
    x = tl.load(x_ptr + row * stride_x + cols, mask=c_in, other=0.0)  # [BC]
    base = state_ptr + tl.maximum(slot, 0).to(tl.int64) * (C * (W - 1)) + cols[:, None] * (W - 1)
    past = c_in[:, None] & (taps[None, :] < tl.where(live, W - 1, 0))
    window = tl.load(base + taps[None, :], mask=past, other=0.0).to(tl.float32)  # [BC, BW]: taps < W - 1
    window = tl.where(taps[None, :] == W - 1, x.to(tl.float32)[:, None], window)
    w = tl.load(
        w_ptr + cols[:, None] * W + taps[None, :], mask=c_in[:, None] & (taps[None, :] < W), other=0.0
    )
    conv = tl.sum(window * w.to(tl.float32), axis=1).to(x.dtype).to(tl.float32)  # [BC], rounded as torch's
    out = conv / (1.0 + tl.exp(-conv))
    tl.store(out_ptr + row * C + cols, out.to(x.dtype), mask=c_in)
    # the state keeps the window's last W - 1 inputs: tap j takes tap j + 1
    shifted = tl.load(base + taps[None, :] + 1, mask=past & (taps[None, :] + 1 < W - 1), other=0.0)
    shifted = tl.where(taps[None, :] == W - 2, x[:, None], shifted)
    tl.store(base + taps[None, :], shifted, mask=past)


@triton.jit
def delta_rule_step_kernel(
    mixed_ptr,  # [B, 2 HK DK + HV DV]: the convolved q (all heads), k, v
    b_ptr,  # [B, HV] (row stride stride_b)
    a_ptr,  # [B, HV] (row stride stride_a); CHANNEL_DECAY: the log decay [B, HV, DK] fp32, contiguous
    a_log_ptr,  # [HV] (unread with CHANNEL_DECAY)
    dt_bias_ptr,  # [HV] (unread with CHANNEL_DECAY)
    state_ptr,  # [S, HV, DK, DV] fp32, contiguous
    slots_ptr,  # [B] int32
    out_ptr,  # [B, HV, DV] out, contiguous
    stride_m,
    stride_b,
    stride_a,
    scale,  # DK ** -0.5
    HK: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_K: tl.constexpr,  # >= DK
    BLOCK_V: tl.constexpr,
    CHANNEL_DECAY: tl.constexpr,  # Kimi Delta Attention: a decay per key channel, given
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    vs = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    ks = tl.arange(0, BLOCK_K)
    slot = tl.load(slots_ptr + row)
    live = slot >= 0
    k_in, v_in = ks < DK, vs < DV
    kh = head // (HV // HK)  # the key head this value head shares
    m = mixed_ptr + row * stride_m
    q = tl.load(m + kh * DK + ks, mask=k_in, other=0.0).to(tl.float32)
    k = tl.load(m + HK * DK + kh * DK + ks, mask=k_in, other=0.0).to(tl.float32)
    v = tl.load(m + 2 * HK * DK + head * DV + vs, mask=v_in, other=0.0).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    beta = tl.sigmoid(tl.load(b_ptr + row * stride_b + head).to(tl.float32))
    cells = k_in[:, None] & (vs[None, :] < tl.where(live, DV, 0))  # [BK, BV]
    at = state_ptr + (tl.maximum(slot, 0).to(tl.int64) * HV + head) * (DK * DV)
    at += ks[:, None] * DV + vs[None, :]
    s = tl.load(at, mask=cells, other=0.0)  # [BK, BV]
    if CHANNEL_DECAY:
        g = tl.load(a_ptr + (row * HV + head) * DK + ks, mask=k_in, other=0.0)  # [BK]
        s = s * tl.exp(g)[:, None]
    else:
        x = tl.load(a_ptr + row * stride_a + head).to(tl.float32) + tl.load(dt_bias_ptr + head).to(tl.float32)
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        s = s * tl.exp(-tl.exp(tl.load(a_log_ptr + head).to(tl.float32)) * softplus)
    predicted = tl.sum(s * k[:, None], axis=0)  # [BV]
    s += k[:, None] * (beta * (v - predicted))[None, :]
    o = tl.sum(s * q[:, None], axis=0)
    tl.store(at, s, mask=cells)
    tl.store(out_ptr + (row * HV + head) * DV + vs, o.to(out_ptr.dtype.element_ty), mask=v_in)
