"""Triton kernel bodies of the fused MoE decode step (launchers in moe_decode.py).

A gate_up program owns one (token, choice) pair and a block of rows, a down program one token and a
block of output rows over all its choices; each reads its experts' weights
in place from the bank by id: no `bank[ids]` copies. A pair whose id is -1 (computed by another
branch) loads nothing (its loads are masked off) and contributes zero.

  gate_up_act: act[p, n] = glu(W_gu[e, n] · x[t] + b[p, n], W_gu[e, I + n] · x[t] + b[p, I + n])
                                                                                  W_gu [S, 2I, H]
  down_sum:    out[t, n] = Σ_k w[p] * (W_d[e, n] · act[p])                       W_d  [S, H, I]

with p = t·K + k and e = ids[p]; glu is the experts' function (ACT: 0 silu(g)·u, 1 gpt-oss's clamped form,
2 silu(g')·u' of the clamped g', u': expert_fn.py) and b[p] the pair's expert's gate/up bias (bias [E, 2I]
at expert id bias_ids[p], when HAS_BIAS). Banks hold values (CODEC 0) or a codec's blocks as stored (uint8
rows, strides in bytes, dequantised in registers: quant_dot_triton.py). Accumulation in fp32; the sum over
k and the cast to the output dtype happen in the down kernel (no reduction launches after it).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from freetoken.runtime.moe.kernels.glu_triton import glu
from freetoken.runtime.moe.kernels.quant_dot_triton import quant_row_part, quant_row_sums


@triton.jit
def gate_up_act_kernel(
    x_ptr,  # [T, H]
    ids_ptr,  # [T * K] int
    w_ptr,  # [S, 2I, H], rows contiguous
    act_ptr,  # [T * K, I] fp32 out
    bias_ptr,  # [E, 2I] fp32 (HAS_BIAS)
    bias_ids_ptr,  # [T * K] int: expert ids of the pairs (HAS_BIAS)
    table_ptr,  # uint8: quant_lowbit_triton.codec_table (the codebook types read it)
    stride_we,
    stride_wn,
    alpha,
    limit,
    H: tl.constexpr,  # constants per model: loop bounds known to the compiler
    INTER: tl.constexpr,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    CODEC: tl.constexpr,
    PDL: tl.constexpr,  # the down kernel is its programmatic dependent: let it launch now
):
    if PDL:
        gdc_launch_dependents()
    pair = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < INTER
    expert = tl.load(ids_ptr + pair)
    rows_live = offs_n < tl.where(expert >= 0, INTER, 0)  # a skipped pair reads nothing
    base = w_ptr + tl.maximum(expert, 0).to(tl.int64) * stride_we
    token = pair // K
    if CODEC == 0:
        acc_gate = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < H
            xk = tl.load(x_ptr + token * H + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            mask = rows_live[:, None] & mask_k[None, :]
            rows = base + offs_n[:, None] * stride_wn
            gate = tl.load(rows + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
            up = tl.load(rows + INTER * stride_wn + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
            acc_gate += tl.sum(gate * xk[None, :], axis=1)
            acc_up += tl.sum(up * xk[None, :], axis=1)
    else:
        gate_rows = base + offs_n * stride_wn
        up_rows = gate_rows + INTER * stride_wn
        xt = x_ptr + token * H
        part_gate = quant_row_part(gate_rows, xt, 0, rows_live, H, table_ptr, CODEC, BLOCK_K)
        part_up = quant_row_part(up_rows, xt, 0, rows_live, H, table_ptr, CODEC, BLOCK_K)
        for k0 in range(BLOCK_K, H, BLOCK_K):
            part_gate += quant_row_part(gate_rows, xt, k0, rows_live, H, table_ptr, CODEC, BLOCK_K)
            part_up += quant_row_part(up_rows, xt, k0, rows_live, H, table_ptr, CODEC, BLOCK_K)
        acc_gate = quant_row_sums(part_gate)
        acc_up = quant_row_sums(part_up)
    if HAS_BIAS:
        row = bias_ptr + tl.maximum(tl.load(bias_ids_ptr + pair), 0).to(tl.int64) * (2 * INTER)
        acc_gate += tl.load(row + offs_n, mask=mask_n, other=0.0)
        acc_up += tl.load(row + INTER + offs_n, mask=mask_n, other=0.0)
    act = glu(acc_gate, acc_up, alpha, limit, ACT)
    tl.store(act_ptr + pair * INTER + offs_n, act, mask=mask_n)


@triton.jit
def _down_pair(act_ptr, ids_ptr, weights_ptr, w_ptr, table_ptr, pair, offs_n, stride_we, stride_wn, H, INTER,
               BLOCK_K, CODEC, WAIT: tl.constexpr):  # fmt: skip
    """[BLOCK_N] fp32: rows offs_n of pair's expert's down projection times its activation, times the
    pair's routing weight (0 for a skipped pair); WAIT: for the gate_up kernel (PDL) before the first
    activation is read."""
    expert = tl.load(ids_ptr + pair)
    rows_live = offs_n < tl.where(expert >= 0, H, 0)
    base = w_ptr + tl.maximum(expert, 0).to(tl.int64) * stride_we
    if WAIT:
        gdc_wait()
    if CODEC == 0:
        acc = tl.zeros(offs_n.shape, dtype=tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < INTER
            a = tl.load(act_ptr + pair * INTER + offs_k, mask=mask_k, other=0.0)
            mask = rows_live[:, None] & mask_k[None, :]
            rows = base + offs_n[:, None] * stride_wn
            w = tl.load(rows + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
            acc += tl.sum(w * a[None, :], axis=1)
    else:
        rows = base + offs_n * stride_wn
        a = act_ptr + pair * INTER
        part = quant_row_part(rows, a, 0, rows_live, INTER, table_ptr, CODEC, BLOCK_K)
        for k0 in range(BLOCK_K, INTER, BLOCK_K):
            part += quant_row_part(rows, a, k0, rows_live, INTER, table_ptr, CODEC, BLOCK_K)
        acc = quant_row_sums(part)
    return acc * tl.where(expert >= 0, tl.load(weights_ptr + pair).to(tl.float32), 0.0)


@triton.jit
def down_sum_kernel(
    act_ptr,  # [T * K, I] fp32
    ids_ptr,  # [T * K] int
    weights_ptr,  # [T * K] routing weights
    w_ptr,  # [S, H, I], rows contiguous
    out_ptr,  # [T, H] in the activations' dtype; with SPLIT, [T * K, H] fp32 weighted partials
    table_ptr,  # uint8: quant_lowbit_triton.codec_table
    stride_we,
    stride_wn,
    H: tl.constexpr,
    INTER: tl.constexpr,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CODEC: tl.constexpr,
    SPLIT: tl.constexpr,  # one program per (token, rows, choice): more reads in flight, a sum after
    PDL: tl.constexpr,  # a programmatic dependent of the gate_up kernel
):
    if PDL:
        gdc_launch_dependents()
    token = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    if SPLIT:
        pair = token * K + tl.program_id(2)
        acc = _down_pair(
            act_ptr, ids_ptr, weights_ptr, w_ptr, table_ptr, pair, offs_n, stride_we, stride_wn, H, INTER,
            BLOCK_K, CODEC, PDL,
        )  # fmt: skip
        tl.store(out_ptr + pair * H + offs_n, acc, mask=mask_n)
    else:
        total = tl.zeros([BLOCK_N], dtype=tl.float32)
        for choice in range(K):
            total += _down_pair(
                act_ptr, ids_ptr, weights_ptr, w_ptr, table_ptr, token * K + choice, offs_n, stride_we,
                stride_wn, H, INTER, BLOCK_K, CODEC, PDL,
            )  # fmt: skip
        tl.store(out_ptr + token * H + offs_n, total.to(out_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def sum_choices_kernel(
    partial_ptr,  # [T * K, H] fp32
    out_ptr,  # [T, H] in the activations' dtype
    H: tl.constexpr,
    K: tl.constexpr,
    K_POW2: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,  # a programmatic dependent of the down kernel
):
    """out[t] = Σ_k partial[t·K + k] (one fixed order: replays give the same bits)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    token = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    choices = tl.arange(0, K_POW2)
    mask = (choices[:, None] < K) & (offs_n[None, :] < H)
    parts = tl.load(partial_ptr + (token * K + choices[:, None]) * H + offs_n[None, :], mask=mask, other=0.0)
    tl.store(
        out_ptr + token * H + offs_n, tl.sum(parts, axis=0).to(out_ptr.dtype.element_ty), mask=offs_n < H
    )
