"""Triton kernel bodies of the fused MoE decode step with int8 activations (launcher: moe_decode_int8.py):
the same two GEMVs as moe_decode_triton.py, each pair's expert read in place by id, but the vector each
program multiplies is the quantized one (quant_dot_int8_triton.quantize_blocks_kernel: x before gate_up,
the activation before down), met by dp4a. A gate_up program whose rows are whole blocks of 32 quantizes its
activations itself (no launch between the two kernels); with SPLITS > 1 a gate_up program takes a part of
its rows' length, and glu_parts_kernel adds the parts, applies the activation and quantizes it for down
(more programs, fewer bytes each: Q8_0's rows). With JOINT a program's gate and up rows are one tile of
twice the rows (interleaved, split after the dots), so the loads of both are asked for before either's
dots, where gate's dots would otherwise come before up's loads. The down kernel runs a program per
(token, rows, choice) writing weighted fp32 partials that sum_choices_kernel adds in one fixed order
(SPLIT), or a program per (token, rows) over every choice, unrolled, in the same order.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from freetoken.runtime.moe.kernels.glu_triton import glu
from freetoken.runtime.moe.kernels.quant_dot_int8_triton import (
    int8_row_part,
    int8_row_sums,
    q4k_tile_dot,
    q4k_tile_load,
    store_quantized,
)


@triton.jit
def _row_dot(rows, live, q_ptr, d_ptr, s_ptr, start, limit, SPAN: tl.constexpr, CODEC: tl.constexpr,
             BLOCK_K: tl.constexpr, EMULATE: tl.constexpr, TILE: tl.constexpr,
             WAIT: tl.constexpr):  # fmt: skip
    """[N] fp32: rows · ṽ over the weights [start, min(start + SPAN, limit)) (start a multiple of the
    codec's granule); WAIT: for the kernel before (PDL) once the first chunk's weights are asked for."""
    part, mins = int8_row_part(rows, live, q_ptr, d_ptr, s_ptr, start, limit, CODEC, BLOCK_K, EMULATE, TILE,
                               WAIT)  # fmt: skip
    for k0 in range(BLOCK_K, SPAN, BLOCK_K):
        p, m = int8_row_part(rows, live, q_ptr, d_ptr, s_ptr, start + k0, limit, CODEC, BLOCK_K, EMULATE,
                             TILE, False)  # fmt: skip
        part += p
        mins += m
    return int8_row_sums(part, mins)


@triton.jit
def gate_up_int8_kernel(
    xq_ptr,  # [T, H / 4] int32: x's quants
    xd_ptr,  # [T, H / 32] fp32: their scales
    xs_ptr,  # [T, H / 32] fp32: the blocks' sums
    ids_ptr,  # [T * K] int
    w_ptr,  # [S, 2I, row bytes] uint8
    act_ptr,  # [T * K, I] fp32 out; with QUANT_ACT the activations' quants [T * K, I / 4] int32; with
    # SPLITS > 1 the rows' partial sums [SPLITS, T * K, 2I] fp32 (gate, then up; glu_parts_kernel ends them)
    act_d_ptr,  # [T * K, I / 32] fp32 out (QUANT_ACT): their scales
    act_s_ptr,  # [T * K, I / 32] fp32 out (QUANT_ACT): their blocks' sums
    bias_ptr,  # [E, 2I] fp32 (HAS_BIAS)
    bias_ids_ptr,  # [T * K] int (HAS_BIAS)
    stride_we,
    stride_wn,
    alpha,
    limit,
    H: tl.constexpr,
    INTER: tl.constexpr,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    CODEC: tl.constexpr,
    EMULATE: tl.constexpr,
    QUANT_ACT: tl.constexpr,  # the program's rows are whole blocks of 32 (BLOCK_N % 32 == 0): quantized here
    TILE: tl.constexpr,  # Q4_K: a chunk's super-blocks as one tile (quant_dot_int8_triton._q4k_int8_tile)
    PDL: tl.constexpr,  # a programmatic dependent of the quantize kernel: ids and weights read before its end
    SPLITS: tl.constexpr,  # the rows cut in SPLITS parts of H / SPLITS weights, a program (axis 2) each
    ROUNDS: tl.constexpr,  # > 1: Q4_K whole-row tiles, ROUNDS row groups a program (_streamed_q4k_gate_up)
    JOINT: tl.constexpr,  # a row's gate and up as one tile of 2 · BLOCK_N rows: their loads asked for at once
):
    if PDL:
        gdc_launch_dependents()
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair)
    token = pair // K
    q, d, s = xq_ptr + token * (H // 4), xd_ptr + token * (H // 32), xs_ptr + token * (H // 32)
    rows_here = tl.where(expert >= 0, INTER, 0)  # a skipped pair reads nothing
    base = w_ptr + tl.maximum(expert, 0).to(tl.int64) * stride_we  # the pair's expert
    if ROUNDS > 1:
        _streamed_q4k_gate_up(
            base, rows_here, q, d, s, act_ptr, act_d_ptr, act_s_ptr, bias_ptr, bias_ids_ptr, pair, stride_wn,
            alpha, limit, H, INTER, BLOCK_N, BLOCK_K, ACT, HAS_BIAS, EMULATE, QUANT_ACT, PDL, ROUNDS,
        )  # fmt: skip
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < INTER
    span: tl.constexpr = H // SPLITS
    start = tl.program_id(2) * span
    if JOINT:  # [2N] rows: gate row n at 2n, up row n at 2n + 1
        r = tl.arange(0, 2 * BLOCK_N)
        n = tl.program_id(1) * BLOCK_N + r // 2
        both = _row_dot(base + (n + (r % 2) * INTER) * stride_wn, n < rows_here, q, d, s, start, start + span,
                        span, CODEC, BLOCK_K, EMULATE, TILE, PDL)  # fmt: skip
        gate, up = tl.split(tl.reshape(both, [BLOCK_N, 2]))
    else:
        live = offs_n < rows_here
        gate_rows = base + offs_n * stride_wn
        up_rows = gate_rows + INTER * stride_wn
        gate = _row_dot(gate_rows, live, q, d, s, start, start + span, span, CODEC, BLOCK_K, EMULATE, TILE,
                        PDL)  # fmt: skip
        up = _row_dot(up_rows, live, q, d, s, start, start + span, span, CODEC, BLOCK_K, EMULATE, TILE, False)
    if SPLITS > 1:  # partial sums; the bias and the activation where they are added (glu_parts_kernel)
        at = part_ptr(act_ptr, tl.program_id(2), pair, tl.num_programs(0), INTER)
        tl.store(at + offs_n, gate, mask=mask_n)
        tl.store(at + INTER + offs_n, up, mask=mask_n)
        return
    _store_act(gate, up, tl.program_id(1), offs_n, pair, act_ptr, act_d_ptr, act_s_ptr, bias_ptr,
               bias_ids_ptr, alpha, limit, INTER, BLOCK_N, ACT, HAS_BIAS, QUANT_ACT)  # fmt: skip


@triton.jit
def _store_act(gate, up, group, offs_n, pair, act_ptr, act_d_ptr, act_s_ptr, bias_ptr, bias_ids_ptr, alpha,
               limit, INTER: tl.constexpr, BLOCK_N: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
               QUANT_ACT: tl.constexpr):  # fmt: skip
    """The activations of rows offs_n (group `group` of BLOCK_N) of `pair` from their gate and up sums:
    fp32, or quantized where the group is whole blocks of 32 (QUANT_ACT)."""
    mask_n = offs_n < INTER
    act = _biased_glu(gate, up, bias_ptr, bias_ids_ptr, pair, offs_n, mask_n, alpha, limit, INTER, ACT,
                      HAS_BIAS)  # fmt: skip
    if QUANT_ACT:  # no quantize launch between the kernels
        nb: tl.constexpr = BLOCK_N // 32
        block = group * nb + tl.arange(0, nb)
        at = pair * (INTER // 32)
        store_quantized(
            tl.reshape(act, [nb, 32]),
            block,
            block * 32 < INTER,
            act_ptr + at * 8,
            act_d_ptr + at,
            act_s_ptr + at,
        )
    else:
        tl.store(act_ptr + pair * INTER + offs_n, act, mask=mask_n)


@triton.jit
def _streamed_q4k_gate_up(base, rows_here, q, d, s, act_ptr, act_d_ptr, act_s_ptr, bias_ptr, bias_ids_ptr,
                          pair, stride_wn, alpha, limit, H: tl.constexpr, INTER: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ACT: tl.constexpr,
                          HAS_BIAS: tl.constexpr, EMULATE: tl.constexpr, QUANT_ACT: tl.constexpr,
                          PDL: tl.constexpr, ROUNDS: tl.constexpr):  # fmt: skip
    """A program's ROUNDS groups of BLOCK_N Q4_K rows (groups g, g + G, ..., G the programs along axis 1),
    each row one tile of whole super-blocks (BLOCK_K >= H): the next group's weights are asked for before
    the current group's dots, so a program waits on memory once, not once a group. `base`: the pair's
    expert; `rows_here`: INTER, or 0 for a skipped pair."""
    S: tl.constexpr = BLOCK_K // 256
    groups = tl.num_programs(1)
    group = tl.program_id(1)
    offs_n = group * BLOCK_N + tl.arange(0, BLOCK_N)
    live = offs_n < rows_here
    g0, g1, g2, g3, g4, g5 = q4k_tile_load(base + offs_n * stride_wn, live, 0, H, S)
    u0, u1, u2, u3, u4, u5 = q4k_tile_load(base + (offs_n + INTER) * stride_wn, live, 0, H, S)
    if PDL:  # the first group's weights are in flight; the vector is the kernel before's output
        gdc_wait()
    for _ in range(ROUNDS):
        after = offs_n + groups * BLOCK_N
        live = after < rows_here  # past the last group: nothing read
        n0, n1, n2, n3, n4, n5 = q4k_tile_load(base + after * stride_wn, live, 0, H, S)
        m0, m1, m2, m3, m4, m5 = q4k_tile_load(base + (after + INTER) * stride_wn, live, 0, H, S)
        part, mins = q4k_tile_dot(g0, g1, g2, g3, g4, g5, q, d, s, 0, H, S, EMULATE)
        gate = int8_row_sums(part, mins)
        part, mins = q4k_tile_dot(u0, u1, u2, u3, u4, u5, q, d, s, 0, H, S, EMULATE)
        up = int8_row_sums(part, mins)
        _store_act(gate, up, group, offs_n, pair, act_ptr, act_d_ptr, act_s_ptr, bias_ptr, bias_ids_ptr,
                   alpha, limit, INTER, BLOCK_N, ACT, HAS_BIAS, QUANT_ACT)  # fmt: skip
        g0, g1, g2, g3, g4, g5 = n0, n1, n2, n3, n4, n5
        u0, u1, u2, u3, u4, u5 = m0, m1, m2, m3, m4, m5
        offs_n = after
        group += groups


@triton.jit
def _biased_glu(gate, up, bias_ptr, bias_ids_ptr, pair, offs, mask, alpha, limit, INTER: tl.constexpr,
                ACT: tl.constexpr, HAS_BIAS: tl.constexpr):  # fmt: skip
    """glu(gate + b_gate, up + b_up) at activations `offs` (any shape) of `pair`, its expert's biases where
    HAS_BIAS."""
    if HAS_BIAS:
        row = bias_ptr + tl.maximum(tl.load(bias_ids_ptr + pair), 0).to(tl.int64) * (2 * INTER)
        gate += tl.load(row + offs, mask=mask, other=0.0)
        up += tl.load(row + INTER + offs, mask=mask, other=0.0)
    return glu(gate, up, alpha, limit, ACT)


@triton.jit
def part_ptr(parts_ptr, split, pair, pairs, INTER: tl.constexpr):
    """Where pair's partial sums of split `split` start in [SPLITS, pairs, 2I]: gate's I, then up's."""
    return parts_ptr + (split * pairs + pair).to(tl.int64) * (2 * INTER)


@triton.jit
def glu_parts_kernel(
    parts_ptr,  # [SPLITS, T * K, 2I] fp32: gate_up_int8_kernel's partial sums
    act_ptr,  # [T * K, I] fp32 out; with QUANT the activations' quants [T * K, I / 4] int32
    act_d_ptr,  # [T * K, I / 32] fp32 out (QUANT): their scales
    act_s_ptr,  # [T * K, I / 32] fp32 out (QUANT): their blocks' sums
    bias_ptr,  # [E, 2I] fp32 (HAS_BIAS)
    bias_ids_ptr,  # [T * K] int (HAS_BIAS)
    alpha,
    limit,
    INTER: tl.constexpr,
    SPLITS: tl.constexpr,
    NB: tl.constexpr,  # blocks of 32 a program
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    QUANT: tl.constexpr,  # quantized for the int8 down kernel (INTER a multiple of 32)
    PDL: tl.constexpr,  # a programmatic dependent of the gate_up kernel
):
    """act = glu(Σ_s parts[s] + b) for a program's NB blocks of 32 of a pair's activations, the parts
    added in split order (one fixed order: the same bits every run)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    pair, pairs = tl.program_id(0), tl.num_programs(0)
    offs = (tl.program_id(1) * NB + tl.arange(0, NB))[:, None] * 32 + tl.arange(0, 32)[None, :]  # [NB, 32]
    here = offs < INTER
    gate = tl.zeros([NB, 32], dtype=tl.float32)
    up = tl.zeros([NB, 32], dtype=tl.float32)
    for split in tl.static_range(SPLITS):
        at = part_ptr(parts_ptr, split, pair, pairs, INTER)
        gate += tl.load(at + offs, mask=here, other=0.0)
        up += tl.load(at + INTER + offs, mask=here, other=0.0)
    act = _biased_glu(gate, up, bias_ptr, bias_ids_ptr, pair, offs, here, alpha, limit, INTER, ACT, HAS_BIAS)
    if QUANT:
        block = tl.program_id(1) * NB + tl.arange(0, NB)
        at = pair * (INTER // 32)
        store_quantized(act, block, block * 32 < INTER, act_ptr + at * 8, act_d_ptr + at, act_s_ptr + at)
    else:
        tl.store(act_ptr + pair * INTER + offs, act, mask=here)


@triton.jit
def down_int8_kernel(
    aq_ptr,  # [T * K, I / 4] int32: the activations' quants
    ad_ptr,  # [T * K, I / 32] fp32
    as_ptr,  # [T * K, I / 32] fp32
    ids_ptr,  # [T * K] int
    weights_ptr,  # [T * K] routing weights
    w_ptr,  # [S, H, row bytes] uint8
    out_ptr,  # [T * K, H] fp32 weighted partials; unsplit, [T, H] in the activations' dtype
    stride_we,
    stride_wn,
    H: tl.constexpr,
    INTER: tl.constexpr,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CODEC: tl.constexpr,
    EMULATE: tl.constexpr,
    SPLIT: tl.constexpr,  # a program per (token, rows, choice), a sum after; else a program sums its choices
    TILE: tl.constexpr,
    PDL: tl.constexpr,  # a programmatic dependent of the kernel that writes the activations
):
    if PDL:
        gdc_launch_dependents()
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if SPLIT:
        pair = tl.program_id(0) * K + tl.program_id(2)
        acc = _down_pair(aq_ptr, ad_ptr, as_ptr, ids_ptr, weights_ptr, w_ptr, pair, offs_n, stride_we,
                         stride_wn, H, INTER, BLOCK_K, CODEC, EMULATE, TILE, PDL)  # fmt: skip
        tl.store(out_ptr + pair * H + offs_n, acc, mask=offs_n < H)
    else:
        token = tl.program_id(0)
        # unrolled: every choice's loads may be in flight at once; only the first waits (PDL), since a wait
        # is also a fence the later choices' loads cannot cross
        total = _down_pair(aq_ptr, ad_ptr, as_ptr, ids_ptr, weights_ptr, w_ptr, token * K, offs_n, stride_we,
                           stride_wn, H, INTER, BLOCK_K, CODEC, EMULATE, TILE, PDL)  # fmt: skip
        for choice in tl.static_range(1, K):
            total += _down_pair(aq_ptr, ad_ptr, as_ptr, ids_ptr, weights_ptr, w_ptr, token * K + choice,
                                offs_n, stride_we, stride_wn, H, INTER, BLOCK_K, CODEC, EMULATE,
                                TILE, False)  # fmt: skip
        tl.store(out_ptr + token * H + offs_n, total.to(out_ptr.dtype.element_ty), mask=offs_n < H)


@triton.jit
def _down_pair(aq_ptr, ad_ptr, as_ptr, ids_ptr, weights_ptr, w_ptr, pair, offs_n, stride_we, stride_wn,
               H, INTER, BLOCK_K, CODEC, EMULATE, TILE, WAIT):  # fmt: skip
    """[BLOCK_N] fp32: w[pair] · rows offs_n of pair's expert's down projection times its quantized
    activation (0 for a skipped pair)."""
    expert = tl.load(ids_ptr + pair)
    live = offs_n < tl.where(expert >= 0, H, 0)
    rows = w_ptr + tl.maximum(expert, 0).to(tl.int64) * stride_we + offs_n * stride_wn
    q, d, s = aq_ptr + pair * (INTER // 4), ad_ptr + pair * (INTER // 32), as_ptr + pair * (INTER // 32)
    acc = _row_dot(rows, live, q, d, s, 0, INTER, INTER, CODEC, BLOCK_K, EMULATE, TILE, WAIT)
    return acc * tl.where(expert >= 0, tl.load(weights_ptr + pair).to(tl.float32), 0.0)
