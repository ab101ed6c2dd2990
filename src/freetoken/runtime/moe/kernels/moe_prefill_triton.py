"""Triton kernel bodies of the grouped MoE step for many tokens (launchers in moe_prefill.py).

The (token, choice) pairs come sorted by expert and padded to whole blocks of BLOCK_M rows per expert
(`sorted_pairs`, the padding holding P = the number of pairs; `block_expert[b]` the expert of block b, E
for blocks past the last). A program owns one block and BLOCK_N output columns: it gathers its pairs'
rows of the input, reads its expert's weight tiles from the bank by id (values, or a codec's blocks
dequantised in registers: quant_dot_triton.quant_tile) and multiplies them on the tensor cores, so
every expert's weights are read once per block of its tokens, not once per pair.

  gate_up_act: act[p, n] = glu(x[p // K] · W_gu[e, n] + b[p, n], x[p // K] · W_gu[e, I + n] + b[p, I + n])
  down:        part[p, n] = w[p] · (act[p] · W_d[e, n])         (the sum over a token's K pairs after)

Products accumulate in fp32; act and the parts are stored in the activations' dtype (as the torch
reference computes a bf16 model). fp32 inputs multiply in IEEE fp32 (no TF32).
"""

from __future__ import annotations

import triton
import triton.language as tl

from freetoken.runtime.moe.kernels.glu_triton import glu
from freetoken.runtime.moe.kernels.quant_dot_triton import quant_tile


@triton.jit
def _weight_tile(w_ptr, table_ptr, expert, stride_we, stride_wn, offs_n, n_live, k0, K_LEN, BLOCK_K, CODEC):
    """[BLOCK_K, BLOCK_N] of W[expert, offs_n, k0 : k0 + BLOCK_K]ᵀ (zeros past the row or n_live): a
    bank's own dtype, fp32 from a codec's blocks."""
    base = w_ptr + expert.to(tl.int64) * stride_we
    if CODEC == 0:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        ptrs = base + offs_n[None, :] * stride_wn + offs_k[:, None]
        return tl.load(ptrs, mask=n_live[None, :] & (offs_k < K_LEN)[:, None], other=0.0)
    else:
        return tl.trans(quant_tile(base + offs_n * stride_wn, k0, n_live, K_LEN, table_ptr, CODEC, BLOCK_K))


@triton.jit
def _program_block(sorted_ptr, block_expert_ptr, P, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's block: (its expert, E past the last; its pairs [BLOCK_M]; which are real; its
    output columns [BLOCK_N])."""
    block = tl.program_id(0)
    pairs = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return tl.load(block_expert_ptr + block), pairs, pairs < P, offs_n


@triton.jit
def _dot(a, b, acc, FP32: tl.constexpr):
    """acc + a @ b: in IEEE fp32 for fp32 activations, else in the activations' dtype (b rounded to it,
    as the reference dequantises into it)."""
    if FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b.to(a.dtype), acc)


@triton.jit
def gate_up_act_kernel(
    x_ptr,  # [T, H]
    sorted_ptr,  # [M] int32: pair ids grouped by expert, padding = P
    block_expert_ptr,  # [M // BLOCK_M] int32: E past the last block
    w_ptr,  # [S, 2I, H] (values, or codec blocks: strides in bytes)
    act_ptr,  # [P, I] out, in x's dtype
    bias_ptr,  # [E, 2I] fp32 (HAS_BIAS)
    bias_ids_ptr,  # [P] int: expert ids of the pairs (HAS_BIAS)
    table_ptr,  # uint8: quant_lowbit_triton.codec_table
    stride_we,
    stride_wn,
    alpha,
    limit,
    P,
    E,
    H: tl.constexpr,
    INTER: tl.constexpr,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    CODEC: tl.constexpr,
    FP32: tl.constexpr,
):
    expert, pairs, live_m, offs_n = _program_block(sorted_ptr, block_expert_ptr, P, BLOCK_M, BLOCK_N)
    if expert < E:
        tokens = tl.where(live_m, pairs // K, 0)
        n_live = offs_n < INTER
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(
                x_ptr + tokens[:, None].to(tl.int64) * H + offs_k[None, :],
                mask=live_m[:, None] & (offs_k < H)[None, :], other=0.0,
            )  # fmt: skip
            gate = _weight_tile(
                w_ptr, table_ptr, expert, stride_we, stride_wn, offs_n, n_live, k0, H, BLOCK_K, CODEC
            )
            up = _weight_tile(
                w_ptr, table_ptr, expert, stride_we, stride_wn, offs_n + INTER, n_live, k0, H, BLOCK_K, CODEC
            )
            acc_gate = _dot(a, gate, acc_gate, FP32)
            acc_up = _dot(a, up, acc_up, FP32)
        if HAS_BIAS:
            row = bias_ptr + tl.load(bias_ids_ptr + pairs, mask=live_m, other=0).to(tl.int64) * (2 * INTER)
            mask = live_m[:, None] & n_live[None, :]
            acc_gate += tl.load(row[:, None] + offs_n[None, :], mask=mask, other=0.0)
            acc_up += tl.load(row[:, None] + INTER + offs_n[None, :], mask=mask, other=0.0)
        act = glu(acc_gate, acc_up, alpha, limit, ACT)
        out = act_ptr + pairs[:, None].to(tl.int64) * INTER + offs_n[None, :]
        tl.store(out, act.to(act_ptr.dtype.element_ty), mask=live_m[:, None] & n_live[None, :])


@triton.jit
def down_kernel(
    act_ptr,  # [P, I]
    sorted_ptr,
    block_expert_ptr,
    weights_ptr,  # [P] routing weights
    w_ptr,  # [S, H, I]
    part_ptr,  # [P, H] out, in the activations' dtype
    table_ptr,  # uint8: quant_lowbit_triton.codec_table
    stride_we,
    stride_wn,
    P,
    E,
    H: tl.constexpr,
    INTER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CODEC: tl.constexpr,
    FP32: tl.constexpr,
):
    expert, pairs, live_m, offs_n = _program_block(sorted_ptr, block_expert_ptr, P, BLOCK_M, BLOCK_N)
    if expert < E:
        rows = tl.where(live_m, pairs, 0).to(tl.int64)
        n_live = offs_n < H
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(
                act_ptr + rows[:, None] * INTER + offs_k[None, :],
                mask=live_m[:, None] & (offs_k < INTER)[None, :], other=0.0,
            )  # fmt: skip
            w = _weight_tile(
                w_ptr, table_ptr, expert, stride_we, stride_wn, offs_n, n_live, k0, INTER, BLOCK_K, CODEC
            )
            acc = _dot(a, w, acc, FP32)
        weight = tl.load(weights_ptr + rows, mask=live_m, other=0.0).to(tl.float32)
        out = part_ptr + rows[:, None] * H + offs_n[None, :]
        mask = live_m[:, None] & n_live[None, :]
        tl.store(out, (acc * weight[:, None]).to(part_ptr.dtype.element_ty), mask=mask)
