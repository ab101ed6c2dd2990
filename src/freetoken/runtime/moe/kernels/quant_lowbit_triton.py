"""The GGML types beyond Q8_0, Q4_K, Q6_K and MXFP4 read as stored by the Triton expert kernels, a block's
weights computed in registers from its bytes. Most codecs' tiles are shaped by the layout ([N, groups,
weights of a group], at most four dimensions, k order when flattened), so a field shared by a group (a
quant byte holding two weights, a sub-block's scale, a sign byte, a grid entry of 4 or 8 weights read as
int32 words) is loaded once at its group's shape and broadcast to the weights. Q5_K and NVFP4 compute
each weight from its own bits (_q5k, block128_weights). Codebooks and sign patterns
come from one small table on the device (codec_table; its grids at 4-byte aligned offsets). Layouts as
lowbit_dot.h's header comment; numbers as cpu_experts.CODEC_IDS: 8 Q5_K, 10 IQ4_XS, 19 Q2_K, 20 Q3_K,
21 IQ2_XXS, 22 IQ2_XS, 23 IQ3_XXS, 24 IQ3_S (super-blocks of 256: superblock_weights), 17 Q4_0, 18 Q5_0,
25 IQ4_NL, 26 Q4_1, 27 Q5_1 (blocks of 32: legacy_weights), and the safetensors codecs 14 FP8 and 15
NVFP4 (blocks of 128: block128_weights). References: codecs/torch_lowbit.py and gguf's."""

from __future__ import annotations

import triton
import triton.language as tl

from freetoken.runtime.moe.kernels import codec_table
from freetoken.runtime.moe.kernels.block_bits_triton import (
    as_float,
    e2m1_doubled,
    fp16_at,
    fp16_low,
    k4_header,
    k4_scale_min_words,
)

# codec_table's parts, as constants the kernels may read (the grids as int32 word offsets)
IQ4NL_AT = tl.constexpr(codec_table.IQ4NL_AT)
KSIGNS_AT = tl.constexpr(codec_table.KSIGNS_AT)
IQ2XXS_WORD = tl.constexpr(codec_table.IQ2XXS_AT // 4)
IQ2XS_WORD = tl.constexpr(codec_table.IQ2XS_AT // 4)
IQ3XXS_WORD = tl.constexpr(codec_table.IQ3XXS_AT // 4)
IQ3S_WORD = tl.constexpr(codec_table.IQ3S_AT // 4)


@triton.jit
def _u8(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _u32(ptr, mask):
    """Four bytes at any alignment as an int32's bits (read fields by shifting, then masking)."""
    low = _u8(ptr, mask) | (_u8(ptr + 1, mask) << 8)
    return low | (_u8(ptr + 2, mask) << 16) | (_u8(ptr + 3, mask) << 24)


@triton.jit
def _grid_word(table, word, mask):
    """The int32 word at word offset `word` of the codec table (four grid bytes)."""
    return tl.load(table.to(tl.pointer_type(tl.int32)) + word, mask=mask, other=0)


@triton.jit
def _signed(w, signs, bit):
    return tl.where(((signs >> bit) & 1) != 0, -w, w)


@triton.jit
def _q5k(rows, sb, live):
    """Q5_K super-block `sb` of rows `rows` -> [N, 256], each weight gathering its own bits (neighbours
    share the loaded bytes through L1): a [N, 4, 2, 32] tile of this layout ran slower on an H100."""
    e = tl.arange(0, 256)[None, :]
    m = live[:, None]
    base = rows + sb * 176  # Q4_K's header, 32 bytes of fifth bits, 128 of nibbles
    b = base[:, None]
    head, s0, s1, s2 = k4_header(base, live)
    sc, mn = k4_scale_min_words(s0, s1, s2, tl.arange(0, 256) // 32)  # [N, 256]
    low = (_u8(b + 48 + 32 * (e // 64) + e % 32, m) >> (4 * ((e // 32) % 2))) & 15
    high = (_u8(b + 16 + e % 32, m) >> (e // 32)) & 1
    q = (low | (high << 4)).to(tl.float32)
    return fp16_low(head)[:, None] * sc * q - fp16_low(head >> 16)[:, None] * mn


@triton.jit
def _u16(ptr, mask):
    return _u8(ptr, mask) | (_u8(ptr + 1, mask) << 8)


@triton.jit
def _q2k_q3k(rows, sb, live, CODEC: tl.constexpr):
    """Q2_K / Q3_K super-block `sb` of rows `rows` -> [N, 2, 4, 32]: weight 128h + 32s + l holds bits
    2s..2s+1 of quant byte 32h + l (each byte read once, at [N, 2, 1, 32]); its sub-block 8h + 2s + l // 16
    takes its scale from a byte pair read once per (h, s). Four dimensions: a [N, 2, 4, 2, 16] tile computed
    wrong weights when compiled (Triton's interpreter gave the right ones)."""
    h = tl.arange(0, 2)[None, :, None, None]
    s = tl.arange(0, 4)[None, None, :, None]
    lane = tl.arange(0, 32)[None, None, None, :]
    b = rows[:, None, None, None] + sb * (84 if CODEC == 19 else 110)
    m = live[:, None, None, None]
    half = 8 * (lane // 16)  # which byte of a scale pair
    if CODEC == 19:  # Q2_K: 16 scale bytes (scale | min << 4), 64 quant bytes, d, dmin
        q = (_u8(b + 16 + 32 * h + lane, m) >> (2 * s)) & 3
        sc = (_u16(b + 8 * h + 2 * s, m) >> half) & 255  # [N, 2, 4, 32]
        d = fp16_at(rows + sb * 84 + 80, live)[:, None, None, None]
        dmin = fp16_at(rows + sb * 84 + 82, live)[:, None, None, None]
        return d * (sc & 15).to(tl.float32) * as_float(q, 0.0) - dmin * (sc >> 4).to(tl.float32)
    else:  # Q3_K: 32 bytes of third bits (weight k's at byte k % 32, bit k // 32), 64 quant bytes, scales, d
        q = (_u8(b + 32 + 32 * h + lane, m) >> (2 * s)) & 3
        third = (_u8(b + lane, m) >> (4 * h + s)) & 1
        low = (((_u16(b + 96 + 2 * s, m) >> half) & 255) >> (4 * h)) & 15
        high = (((_u16(b + 104 + 2 * (s % 2), m) >> half) & 255) >> (2 * (2 * h + s // 2))) & 3
        scale = as_float(low | (high << 4), 32.0)
        d = fp16_at(rows + sb * 110 + 108, live)[:, None, None, None]
        return d * scale * as_float(q + 4 * third, 4.0)


@triton.jit
def _iq4xs(base, live, table):
    """IQ4_XS at super-blocks `base` -> [N, 8, 2, 16]: weight 32j + 16t + l (nibble t of byte 16j + l, the
    sub-block j's 6-bit scale split over scales_l and scales_h)."""
    j = tl.arange(0, 8)[None, :, None, None]
    t = tl.arange(0, 2)[None, None, :, None]
    lane = tl.arange(0, 16)[None, None, None, :]
    b = base[:, None, None, None]
    m = live[:, None, None, None]
    q = (_u8(b + 8 + 16 * j + lane, m) >> (4 * t)) & 15
    value = tl.load(table + IQ4NL_AT + q, mask=m, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    low = (_u8(b + 4 + j // 2, m) >> (4 * (j % 2))) & 15
    high = ((_u8(b + 2, m) | (_u8(b + 3, m) << 8)) >> (2 * j)) & 3
    return value * (fp16_at(base, live)[:, None, None, None] * ((low | (high << 4)) - 32).to(tl.float32))


@triton.jit
def _iq2(base, live, table, CODEC: tl.constexpr):
    """IQ2_XXS / IQ2_XS at super-blocks `base` -> [N, 16, 2, 8]: weight 16i + 8g + w, its group of eight
    (index 2i + g) one 8-byte grid entry (two int32 words), one ksigns byte."""
    i = tl.arange(0, 16)[None, :, None, None]
    g = tl.arange(0, 2)[None, None, :, None]
    w = tl.arange(0, 8)[None, None, None, :]
    b = base[:, None, None, None]
    m = live[:, None, None, None]
    d = fp16_at(base, live)[:, None, None, None]
    if CODEC == 21:  # IQ2_XXS: per 32 weights (ib = i // 2) four index bytes then an aux word
        ib, group = i // 2, 2 * (i % 2) + g
        index = _u8(b + 2 + 8 * ib + group, m)  # [N, 16, 2, 1]
        aux = _u32(b + 6 + 8 * ib, m)  # [N, 16, 1, 1]
        signs = _u8(table + KSIGNS_AT + ((aux >> (7 * group)) & 127), m)
        scale = d * (0.5 + ((aux >> 28) & 15).to(tl.float32)) * 0.25
        word = IQ2XXS_WORD + 2 * index
    else:  # IQ2_XS: a uint16 per group (9-bit grid index, 7-bit sign index), then a nibble scale per 16
        at = b + 2 + 2 * (2 * i + g)
        q = _u8(at, m) | (_u8(at + 1, m) << 8)
        signs = _u8(table + KSIGNS_AT + (q >> 9), m)
        ls = (_u8(b + 66 + i // 2, m) >> (4 * (i % 2))) & 15
        scale = d * (0.5 + ls.to(tl.float32)) * 0.25
        word = IQ2XS_WORD + 2 * (q & 511)
    packed = tl.where(w < 4, _grid_word(table, word, m), _grid_word(table, word + 1, m))
    return _signed(as_float((packed >> (8 * (w % 4))) & 255, 0.0) * scale, signs, w)


@triton.jit
def _iq3(base, live, table, CODEC: tl.constexpr):
    """IQ3_XXS / IQ3_S at super-blocks `base` -> [N, 8, 8, 4]: weight 32ib + 4q + w, its four one grid word
    (index byte 8ib + q), its sign bit 4(q % 2) + w of sign byte 4ib + q // 2."""
    ib = tl.arange(0, 8)[None, :, None, None]
    q = tl.arange(0, 8)[None, None, :, None]
    w = tl.arange(0, 4)[None, None, None, :]
    b = base[:, None, None, None]
    m = live[:, None, None, None]
    d = fp16_at(base, live)[:, None, None, None]
    index = _u8(b + 2 + 8 * ib + q, m)  # [N, 8, 8, 1]
    if CODEC == 23:  # IQ3_XXS: an aux word per 32 (four 7-bit ksigns indices, a 4-bit scale)
        aux = _u32(b + 66 + 4 * ib, m)  # [N, 8, 1, 1]
        signs = _u8(table + KSIGNS_AT + ((aux >> (7 * (q // 2))) & 127), m)
        scale = d * (0.5 + ((aux >> 28) & 15).to(tl.float32)) * 0.5
        packed = _grid_word(table, IQ3XXS_WORD + index, m)
    else:  # IQ3_S: a ninth index bit per four (qh), explicit sign bytes, a nibble scale per 32
        index = index | (((_u8(b + 66 + ib, m) >> q) & 1) << 8)
        signs = _u8(b + 74 + 4 * ib + q // 2, m)
        ls = (_u8(b + 106 + ib // 2, m) >> (4 * (ib % 2))) & 15
        scale = d * (1 + 2 * ls).to(tl.float32)
        packed = _grid_word(table, IQ3S_WORD + index, m)
    return _signed(as_float((packed >> (8 * w)) & 255, 0.0) * scale, signs, 4 * (q % 2) + w)


@triton.jit
def superblock_weights(rows, sb, live, table, CODEC: tl.constexpr):
    """Super-block `sb` of rows `rows` ([BLOCK_N] byte pointers; `live` [BLOCK_N]) as fp32 weights
    [BLOCK_N, 256] in k order."""
    if CODEC == 8:
        w = _q5k(rows, sb, live)
    elif CODEC == 19 or CODEC == 20:
        w = tl.reshape(_q2k_q3k(rows, sb, live, CODEC), [live.shape[0], 256])
    elif CODEC == 10:
        w = tl.reshape(_iq4xs(rows + sb * 136, live, table), [live.shape[0], 256])
    elif CODEC == 21:
        w = tl.reshape(_iq2(rows + sb * 66, live, table, CODEC), [live.shape[0], 256])
    elif CODEC == 22:
        w = tl.reshape(_iq2(rows + sb * 74, live, table, CODEC), [live.shape[0], 256])
    elif CODEC == 23:
        w = tl.reshape(_iq3(rows + sb * 98, live, table, CODEC), [live.shape[0], 256])
    else:  # 24, IQ3_S
        w = tl.reshape(_iq3(rows + sb * 110, live, table, CODEC), [live.shape[0], 256])
    return w


@triton.jit
def legacy_weights(rows, block, live, table, CODEC: tl.constexpr):
    """Blocks `block` ([NB]) of rows `rows` ([BLOCK_N] byte pointers; `live` [BLOCK_N, NB]) as fp32
    weights [BLOCK_N, NB, 32]: Q4_0, Q5_0, IQ4_NL, Q4_1, Q5_1 (weights l and l + 16 in byte l's low and
    high nibble, built as [BLOCK_N, NB, 2, 16] from each byte read once)."""
    t = tl.arange(0, 2)[None, None, :, None]
    lane = tl.arange(0, 16)[None, None, None, :]
    m = live[:, :, None, None]
    if CODEC == 18:  # Q5_0: d, 32 fifth bits, 16 bytes of nibbles
        base = rows[:, None] + block[None, :] * 22
        b = base[:, :, None, None]
        low = (_u8(b + 6 + lane, m) >> (4 * t)) & 15
        q = low | (((_u32(b + 2, m) >> (16 * t + lane)) & 1) << 4)
        w = fp16_at(base, live)[:, :, None, None] * as_float(q, 16.0)
    elif CODEC == 27:  # Q5_1: d, m, 32 fifth bits, 16 bytes of nibbles
        base = rows[:, None] + block[None, :] * 24
        b = base[:, :, None, None]
        low = (_u8(b + 8 + lane, m) >> (4 * t)) & 15
        q = low | (((_u32(b + 4, m) >> (16 * t + lane)) & 1) << 4)
        d, offset = fp16_at(base, live)[:, :, None, None], fp16_at(base + 2, live)[:, :, None, None]
        w = as_float(q, 0.0) * d + offset
    elif CODEC == 26:  # Q4_1: d, m, 16 bytes of nibbles
        base = rows[:, None] + block[None, :] * 20
        q = (_u8(base[:, :, None, None] + 4 + lane, m) >> (4 * t)) & 15
        d, offset = fp16_at(base, live)[:, :, None, None], fp16_at(base + 2, live)[:, :, None, None]
        w = as_float(q, 0.0) * d + offset
    else:
        base = rows[:, None] + block[None, :] * 18
        q = (_u8(base[:, :, None, None] + 2 + lane, m) >> (4 * t)) & 15
        if CODEC == 25:  # IQ4_NL
            value = tl.load(table + IQ4NL_AT + q, mask=m, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        else:
            value = as_float(q, 8.0)
        w = fp16_at(base, live)[:, :, None, None] * value
    return tl.reshape(w, [live.shape[0], live.shape[1], 32])


@triton.jit
def _e4m3(byte):
    """e4m3 bytes (int32) as fp32: the byte's bits moved into an fp16's (sign to bit 15, the rest to
    bits 13..7) are its value / 256, subnormals included."""
    bits = ((byte & 0x80) << 8) | ((byte & 0x7F) << 7)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def block128_weights(rows, block, live, CODEC: tl.constexpr):
    """Blocks `block` ([NB]) of 128 weights of rows `rows` ([BLOCK_N] byte pointers; `live` [BLOCK_N, NB])
    as fp32 weights [BLOCK_N, NB, 128]: FP8 (an fp32 scale, 128 e4m3), NVFP4 (an fp32 multiplier, eight
    e4m3 scales of 16, then per 16 eight bytes: weights i and i + 8 in byte i's low and high nibble)."""
    if CODEC == 14:
        j = tl.arange(0, 128)[None, None, :]
        base = rows[:, None] + block[None, :] * 132
        scale = tl.load(base.to(tl.pointer_type(tl.float32)), mask=live, other=0.0)[:, :, None]
        return _e4m3(_u8(base[:, :, None] + 4 + j, live[:, :, None])) * scale
    else:
        j = tl.arange(0, 128)[None, None, :]
        m = live[:, :, None]
        base = rows[:, None] + block[None, :] * 76
        b = base[:, :, None]
        multiplier = tl.load(base.to(tl.pointer_type(tl.float32)), mask=live, other=0.0)[:, :, None]
        scale = _e4m3(_u8(b + 4 + j // 16, m)) * multiplier
        code = (_u8(b + 12 + 8 * (j // 16) + j % 8, m) >> (4 * ((j % 16) // 8))) & 15
        return e2m1_doubled(code) * 0.5 * scale
