"""Dots of weight rows kept as a codec's blocks with a vector, for the fused decode kernels
(moe_decode_triton.py): W[rows, k0 : k0 + BLOCK_K] · v[k0 : k0 + BLOCK_K] in fp32, the blocks read as
stored and widened in registers.

The work is shaped by the blocks, not by the weights: a tile is [BLOCK_N rows, blocks, weights of a
block], so each block's scale is read once (not once per weight) and the quants of a block are one
contiguous run of bytes. A chunk's products stay a tile (quant_row_part) that the caller adds to the
previous chunks' elementwise; rows are summed once, at the end (quant_row_sums): summing every chunk
crossed the warps through shared memory, and that, not HBM, bounded the kernel (the L1 at 80 % of its
throughput, DRAM at 12 %). Quants become fp32 by their bits under 2^23's exponent (as_float).

Codecs by the CPU kernel's numbers (cpu_experts.CODEC_IDS): 1 Q8_0 (34-byte blocks of 32: fp16 scale,
int8 quants), 3 Q4_K (144-byte super-blocks of 256: fp16 d and dmin, 12 bytes of 6-bit scales and mins
for eight sub-blocks of 32, 128 bytes of nibbles, chunk c of 64 weights in bytes 32c.. as low then high
nibbles: sub-blocks 2c and 2c + 1), 4 Q6_K (210-byte super-blocks of 256: 128 bytes of low nibbles, 64
of 2-bit highs, 16 int8 scales of 16 weights, fp16 d last; weight 128h + 32g + l has its low nibble in
byte 64h + 32(g % 2) + l shifted by 4(g // 2) and its high bits in byte 128 + 32h + l shifted by 2g,
minus 32), 12 MXFP4 (17-byte blocks of 32: an e8m0 scale 2^(e − 128), 16 bytes, weights j and j + 16
in byte j's low and high nibble, doubled e2m1 values). BLOCK_K is a multiple of the codec's block (32;
256 for the K-quants, whose rows are whole super-blocks); a block at or past `limit` (the row length, a
multiple of 32) reads nothing. References: codecs/torch_dequant.py and gguf's.
"""

from __future__ import annotations

import triton
import triton.language as tl

from freetoken.runtime.moe.kernels.block_bits_triton import (
    as_float,
    e2m1_doubled,
    fp16_at,
    fp16_low,
    k4_header,
    k4_scale_min_words,
    unaligned_words,
)
from freetoken.runtime.moe.kernels.quant_lowbit_triton import (
    block128_weights,
    legacy_weights,
    superblock_weights,
)


@triton.jit
def _q4k_halves(base, live):
    """The super-blocks at `base` ([BLOCK_N] byte pointers; rows `live`) as fp32 weights: two [BLOCK_N, 4,
    32], chunk c's byte j's low nibble (weight 64c + j) and high nibble (weight 64c + 32 + j)."""
    c = tl.arange(0, 4)
    j = tl.arange(0, 32)
    quants = tl.load(
        base[:, None, None] + (16 + 32 * c[:, None] + j[None, :])[None, :, :],
        mask=live[:, None, None],
        other=0,
    ).to(tl.int32)  # [BLOCK_N, 4, 32]
    head, s0, s1, s2 = k4_header(base, live)
    d = fp16_low(head)[:, None]
    dmin = fp16_low(head >> 16)[:, None]
    sc_lo, min_lo = k4_scale_min_words(s0, s1, s2, 2 * c)  # [BLOCK_N, 4]
    sc_hi, min_hi = k4_scale_min_words(s0, s1, s2, 2 * c + 1)
    w_lo = as_float(quants & 15, 0.0) * (d * sc_lo)[:, :, None] - (dmin * min_lo)[:, :, None]
    w_hi = as_float(quants >> 4, 0.0) * (d * sc_hi)[:, :, None] - (dmin * min_hi)[:, :, None]
    return w_lo, w_hi


@triton.jit
def _q6k_weights(base, live):
    """The super-blocks at `base` as fp32 weights [BLOCK_N, 8, 2, 16]: weight 32·hg + 16m + i (half h = hg //
    4 of 128 weights, group g = hg % 4 of 32, m the 16-weight sub-block with its own scale) = k order."""
    hg = tl.arange(0, 8)
    m = tl.arange(0, 2)
    i = tl.arange(0, 16)
    group = hg % 4
    lane = (16 * m[:, None] + i[None, :])[None, :, :]  # [1, 2, 16]: weight l of its group
    low_at = (64 * (hg // 4) + 32 * (group % 2))[:, None, None] + lane  # [8, 2, 16] byte of ql
    high_at = (128 + 32 * (hg // 4))[:, None, None] + lane  # byte of qh
    mask = live[:, None, None, None]
    ql = tl.load(base[:, None, None, None] + low_at[None], mask=mask, other=0).to(tl.int32)
    qh = tl.load(base[:, None, None, None] + high_at[None], mask=mask, other=0).to(tl.int32)
    q6 = ((ql >> (4 * (group // 2))[None, :, None, None]) & 15) | (
        ((qh >> (2 * group)[None, :, None, None]) & 3) << 4
    )  # [BLOCK_N, 8, 2, 16]
    sub = (2 * hg[:, None] + m[None, :])[None]  # [1, 8, 2]: the sub-block's scale byte
    scales = tl.load(base[:, None, None] + 192 + sub, mask=live[:, None, None], other=0)
    ds = fp16_at(base + 208, live)[:, None, None] * scales.to(tl.int8, bitcast=True).to(tl.float32)
    return as_float(q6, 32.0) * ds[:, :, :, None]


@triton.jit
def _q8_weights(rows, block, live):
    """Blocks `block` ([NB]) of rows `rows` ([BLOCK_N] byte pointers; `live` [BLOCK_N, NB]) as fp32
    weights [BLOCK_N, NB, 32]."""
    j = tl.arange(0, 32)
    base = rows[:, None] + block[None, :] * 34
    quants = tl.load(base[:, :, None] + 2 + j[None, None, :], mask=live[:, :, None], other=0)
    return as_float(quants.to(tl.int32) ^ 128, 128.0) * fp16_at(base, live)[:, :, None]


@triton.jit
def _mxfp4_halves(rows, block, live):
    """Blocks `block` of rows `rows` as fp32 weights: two [BLOCK_N, NB, 16], weights j and j + 16 of each
    block (byte j's low and high nibble)."""
    base = rows[:, None] + block[None, :] * 17
    words = unaligned_words(base + 1, live)  # [BLOCK_N, NB, 4]: four aligned-word reads, not 16 byte reads
    codes = (words[:, :, :, None] >> (8 * tl.arange(0, 4))[None, None, None, :]) & 255  # [.., 4, 4]
    codes = tl.reshape(codes, [codes.shape[0], codes.shape[1], 16])  # byte j = 4w + b
    scale = tl.exp2(tl.load(base, mask=live, other=0).to(tl.float32) - 128.0)[:, :, None]
    return e2m1_doubled(codes & 15) * scale, e2m1_doubled(codes >> 4) * scale


@triton.jit
def quant_row_sums(part):
    """[BLOCK_N] fp32: the row sums of a quant_row_part accumulation."""
    return tl.sum(tl.sum(part, axis=2), axis=1)


@triton.jit
def quant_row_part(rows, v_ptr, k0, live, limit, table, CODEC: tl.constexpr, BLOCK_K: tl.constexpr):
    """rows: [BLOCK_N] byte pointers to row starts; live: [BLOCK_N] rows to read; v_ptr: the vector's
    first element -> an fp32 tile [BLOCK_N, A, B] whose row sums are Σ over k in [k0, k0 + BLOCK_K) of
    W[row, k] · v[k]. The caller adds the tiles of successive chunks elementwise and sums rows once at the
    end (quant_row_sums): a reduction per chunk crossed the warps through shared memory every block.
    `table`: quant_lowbit_triton.codec_table's bytes on the device (read by the codebook types)."""
    if (
        CODEC == 3 or CODEC == 4
    ):  # K-quants: BLOCK_K // 256 super-blocks -> [BLOCK_N, 4, 32] / [BLOCK_N, 16, 16]
        if CODEC == 3:
            part = tl.zeros([live.shape[0], 4, 32], dtype=tl.float32)
        else:
            part = tl.zeros([live.shape[0], 8, 2, 16], dtype=tl.float32)
        for s in tl.static_range(BLOCK_K // 256):
            k = k0 + 256 * s
            rows_here = live & (k + tl.zeros(live.shape, tl.int32) < limit)
            if CODEC == 3:
                w_lo, w_hi = _q4k_halves(rows + (k // 256) * 144, rows_here)
                offs = k + 64 * tl.arange(0, 4)[:, None] + tl.arange(0, 32)[None, :]  # [4, 32]
                v_lo = tl.load(v_ptr + offs, mask=offs < limit, other=0.0).to(tl.float32)
                v_hi = tl.load(v_ptr + offs + 32, mask=offs < limit, other=0.0).to(tl.float32)
                part += w_lo * v_lo[None, :, :] + w_hi * v_hi[None, :, :]
            else:
                hg, m, i = tl.arange(0, 8), tl.arange(0, 2), tl.arange(0, 16)
                offs = k + 32 * hg[:, None, None] + 16 * m[None, :, None] + i[None, None, :]  # [8, 2, 16]
                v = tl.load(v_ptr + offs, mask=offs < limit, other=0.0).to(tl.float32)
                part += _q6k_weights(rows + (k // 256) * 210, rows_here) * v[None]
        if CODEC == 3:
            return part
        else:
            return tl.reshape(part, [live.shape[0], 16, 16])  # rows stay rows (a reordering one mixed them)
    elif CODEC == 8 or CODEC == 10 or (CODEC >= 19 and CODEC <= 24):  # quant_lowbit_triton's super-blocks
        part = tl.zeros([live.shape[0], 256], dtype=tl.float32)
        for s in tl.static_range(BLOCK_K // 256):
            k = k0 + 256 * s
            rows_here = live & (k + tl.zeros(live.shape, tl.int32) < limit)
            offs = k + tl.arange(0, 256)
            v = tl.load(v_ptr + offs, mask=offs < limit, other=0.0).to(tl.float32)
            part += superblock_weights(rows, k // 256, rows_here, table, CODEC) * v[None, :]
        return tl.reshape(part, [live.shape[0], 16, 16])
    elif CODEC == 14 or CODEC == 15:  # FP8 / NVFP4: BLOCK_K // 128 blocks -> [BLOCK_N, BLOCK_K // 128, 128]
        block = k0 // 128 + tl.arange(0, BLOCK_K // 128)
        block_live = block * 128 < limit
        j = tl.arange(0, 128)
        v = tl.load(v_ptr + block[:, None] * 128 + j[None, :], mask=block_live[:, None], other=0.0)
        weights = block128_weights(rows, block, live[:, None] & block_live[None, :], CODEC)
        return weights * v.to(tl.float32)[None, :, :]
    elif CODEC == 17 or CODEC == 18 or CODEC >= 25:  # its blocks of 32 -> [BLOCK_N, BLOCK_K // 32, 32]
        block = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        block_live = block * 32 < limit
        j = tl.arange(0, 32)
        v = tl.load(v_ptr + block[:, None] * 32 + j[None, :], mask=block_live[:, None], other=0.0)
        weights = legacy_weights(rows, block, live[:, None] & block_live[None, :], table, CODEC)
        return weights * v.to(tl.float32)[None, :, :]
    else:  # Q8_0 (1) / MXFP4 (12): BLOCK_K // 32 blocks -> [BLOCK_N, BLOCK_K // 32, 32 or 16]
        block = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        block_live = block * 32 < limit
        mask = live[:, None] & block_live[None, :]  # [BLOCK_N, NB]
        if CODEC == 1:
            j = tl.arange(0, 32)
            v = tl.load(v_ptr + block[:, None] * 32 + j[None, :], mask=block_live[:, None], other=0.0)
            return _q8_weights(rows, block, mask) * v.to(tl.float32)[None, :, :]
        else:
            j = tl.arange(0, 16)
            v_lo = tl.load(v_ptr + block[:, None] * 32 + j[None, :], mask=block_live[:, None], other=0.0)
            v_hi = tl.load(v_ptr + block[:, None] * 32 + 16 + j[None, :], mask=block_live[:, None], other=0.0)
            lo, hi = _mxfp4_halves(rows, block, mask)
            return lo * v_lo.to(tl.float32)[None, :, :] + hi * v_hi.to(tl.float32)[None, :, :]


@triton.jit
def quant_tile(rows, k0, live, limit, table, CODEC: tl.constexpr, BLOCK_K: tl.constexpr):
    """The weights W[rows, k0 : k0 + BLOCK_K] dequantised in registers -> fp32 [BLOCK_N, BLOCK_K] in k
    order (for the prefill kernels' tensor-core dots). rows, live, limit as in quant_row_part; BLOCK_K is
    one super-block (256) for the K-quants and quant_lowbit_triton's super-block types, a multiple of 32 for
    the codecs of 32-weight blocks."""
    if CODEC == 8 or CODEC == 10 or (CODEC >= 19 and CODEC <= 24):
        rows_here = live & (k0 + tl.zeros(live.shape, tl.int32) < limit)
        return superblock_weights(rows, k0 // 256, rows_here, table, CODEC)
    elif CODEC == 14 or CODEC == 15:
        block = k0 // 128 + tl.arange(0, BLOCK_K // 128)
        mask = live[:, None] & (block * 128 < limit)[None, :]
        return tl.reshape(block128_weights(rows, block, mask, CODEC), [live.shape[0], BLOCK_K])
    elif CODEC == 17 or CODEC == 18 or CODEC >= 25:
        block = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        mask = live[:, None] & (block * 32 < limit)[None, :]
        return tl.reshape(legacy_weights(rows, block, mask, table, CODEC), [live.shape[0], BLOCK_K])
    elif CODEC == 3 or CODEC == 4:
        rows_here = live & (k0 + tl.zeros(live.shape, tl.int32) < limit)
        if CODEC == 3:
            w_lo, w_hi = _q4k_halves(rows + (k0 // 256) * 144, rows_here)
            w = tl.permute(tl.join(w_lo, w_hi), (0, 1, 3, 2))  # [BLOCK_N, 4, 2, 32]: weight 64c + 32h + j
        else:
            w = _q6k_weights(rows + (k0 // 256) * 210, rows_here)
        return tl.reshape(w, [live.shape[0], 256])
    else:
        block = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        mask = live[:, None] & (block * 32 < limit)[None, :]  # [BLOCK_N, NB]
        if CODEC == 1:
            return tl.reshape(_q8_weights(rows, block, mask), [live.shape[0], BLOCK_K])
        else:
            lo, hi = _mxfp4_halves(rows, block, mask)
            w = tl.permute(tl.join(lo, hi), (0, 1, 3, 2))  # [BLOCK_N, NB, 2, 16]
            return tl.reshape(w, [live.shape[0], BLOCK_K])
