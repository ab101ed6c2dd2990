"""The GGML types beyond Q8_0, Q4_K, Q6_K and MXFP4 read as stored by the Triton expert kernels: a block's
weights computed in registers by index arithmetic (each weight gathers its own bits; neighbours share
the loaded bytes through L1), codebooks and sign patterns read from one small table on the device
(codec_table). Layouts as lowbit_dot.h's header comment; numbers as cpu_experts.CODEC_IDS: 8 Q5_K,
10 IQ4_XS, 19 Q2_K, 20 Q3_K, 21 IQ2_XXS, 22 IQ2_XS, 23 IQ3_XXS, 24 IQ3_S (super-blocks of 256:
superblock_weights), 17 Q4_0, 18 Q5_0, 25 IQ4_NL, 26 Q4_1, 27 Q5_1 (blocks of 32: legacy_weights), and the
safetensors codecs 14 FP8 and 15 NVFP4 (blocks of 128: block128_weights). References:
codecs/torch_lowbit.py and gguf's."""

from __future__ import annotations

import triton
import triton.language as tl

from freetoken.runtime.moe.kernels import codec_table
from freetoken.runtime.moe.kernels.block_bits_triton import (
    e2m1_doubled,
    fp16_at,
    fp16_low,
    k4_header,
    k4_scale_min_words,
)

# codec_table's parts, as constants the kernels may read
IQ4NL_AT = tl.constexpr(codec_table.IQ4NL_AT)
KSIGNS_AT = tl.constexpr(codec_table.KSIGNS_AT)
IQ2XXS_AT = tl.constexpr(codec_table.IQ2XXS_AT)
IQ2XS_AT = tl.constexpr(codec_table.IQ2XS_AT)
IQ3XXS_AT = tl.constexpr(codec_table.IQ3XXS_AT)
IQ3S_AT = tl.constexpr(codec_table.IQ3S_AT)


@triton.jit
def _u8(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _u32(ptr, mask):
    """Four bytes at any alignment as an int32's bits (read fields by shifting, then masking)."""
    low = _u8(ptr, mask) | (_u8(ptr + 1, mask) << 8)
    return low | (_u8(ptr + 2, mask) << 16) | (_u8(ptr + 3, mask) << 24)


@triton.jit
def _signed(w, signs, bit):
    return tl.where(((signs >> bit) & 1) != 0, -w, w)


@triton.jit
def superblock_weights(rows, sb, live, table, CODEC: tl.constexpr):
    """Super-block `sb` of rows `rows` ([BLOCK_N] byte pointers; `live` [BLOCK_N]) as fp32 weights
    [BLOCK_N, 256] in k order."""
    e = tl.arange(0, 256)[None, :]
    m = live[:, None]
    if CODEC == 8:  # Q5_K: Q4_K's header, 32 bytes of fifth bits, 128 of nibbles
        base = rows + sb * 176
        b = base[:, None]
        head, s0, s1, s2 = k4_header(base, live)
        j = tl.arange(0, 256) // 32
        sc, mn = k4_scale_min_words(s0, s1, s2, j)  # [BLOCK_N, 256]
        low = (_u8(b + 48 + 32 * (e // 64) + e % 32, m) >> (4 * ((e // 32) % 2))) & 15
        high = (_u8(b + 16 + e % 32, m) >> (e // 32)) & 1
        q = (low | (high << 4)).to(tl.float32)
        return fp16_low(head)[:, None] * sc * q - fp16_low(head >> 16)[:, None] * mn
    elif CODEC == 10:  # IQ4_XS
        base = rows + sb * 136
        b = base[:, None]
        j = e // 32
        q = (_u8(b + 8 + 16 * j + e % 16, m) >> (4 * ((e % 32) // 16))) & 15
        low = (_u8(b + 4 + j // 2, m) >> (4 * (j % 2))) & 15
        high = ((_u8(b + 2, m) | (_u8(b + 3, m) << 8)) >> (2 * j)) & 3
        value = tl.load(table + IQ4NL_AT + q, mask=m, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        return fp16_at(base, live)[:, None] * ((low | (high << 4)) - 32).to(tl.float32) * value
    elif CODEC == 19:  # Q2_K
        base = rows + sb * 84
        b = base[:, None]
        q = (_u8(b + 16 + 32 * (e // 128) + e % 32, m) >> (2 * ((e % 128) // 32))) & 3
        sc = _u8(b + e // 16, m)
        d, dmin = fp16_at(base + 80, live)[:, None], fp16_at(base + 82, live)[:, None]
        return d * (sc & 15).to(tl.float32) * q.to(tl.float32) - dmin * (sc >> 4).to(tl.float32)
    elif CODEC == 20:  # Q3_K
        base = rows + sb * 110
        b = base[:, None]
        sub = e // 16
        q = (_u8(b + 32 + 32 * (e // 128) + e % 32, m) >> (2 * ((e % 128) // 32))) & 3
        h = (_u8(b + e % 32, m) >> (e // 32)) & 1
        low = (_u8(b + 96 + sub % 8, m) >> (4 * (sub // 8))) & 15
        high = (_u8(b + 104 + sub % 4, m) >> (2 * (sub // 4))) & 3
        scale = ((low | (high << 4)) - 32).to(tl.float32)
        return fp16_at(base + 108, live)[:, None] * scale * (q - 4 + 4 * h).to(tl.float32)
    elif CODEC == 21:  # IQ2_XXS
        base = rows + sb * 66
        b = base[:, None]
        ib, group = e // 32, (e % 32) // 8
        index = _u8(b + 2 + 8 * ib + group, m)
        aux = _u32(b + 6 + 8 * ib, m)
        signs = _u8(table + KSIGNS_AT + ((aux >> (7 * group)) & 127), m)
        grid = _u8(table + IQ2XXS_AT + 8 * index + e % 8, m).to(tl.float32)
        scale = fp16_at(base, live)[:, None] * (0.5 + ((aux >> 28) & 15).to(tl.float32)) * 0.25
        return _signed(scale * grid, signs, e % 8)
    elif CODEC == 22:  # IQ2_XS
        base = rows + sb * 74
        b = base[:, None]
        i = e // 8
        q = _u8(b + 2 + 2 * i, m) | (_u8(b + 3 + 2 * i, m) << 8)
        grid = _u8(table + IQ2XS_AT + 8 * (q & 511) + e % 8, m).to(tl.float32)
        signs = _u8(table + KSIGNS_AT + (q >> 9), m)
        ls = (_u8(b + 66 + i // 4, m) >> (4 * ((i // 2) % 2))) & 15
        scale = fp16_at(base, live)[:, None] * (0.5 + ls.to(tl.float32)) * 0.25
        return _signed(scale * grid, signs, e % 8)
    elif CODEC == 23:  # IQ3_XXS
        base = rows + sb * 98
        b = base[:, None]
        index = _u8(b + 2 + e // 4, m)
        grid = _u8(table + IQ3XXS_AT + 4 * index + e % 4, m).to(tl.float32)
        aux = _u32(b + 66 + 4 * (e // 32), m)
        signs = _u8(table + KSIGNS_AT + ((aux >> (7 * ((e % 32) // 8))) & 127), m)
        scale = fp16_at(base, live)[:, None] * (0.5 + ((aux >> 28) & 15).to(tl.float32)) * 0.5
        return _signed(scale * grid, signs, e % 8)
    else:  # 24, IQ3_S
        base = rows + sb * 110
        b = base[:, None]
        i, g = e // 4, e // 8
        index = _u8(b + 2 + i, m) | (((_u8(b + 66 + i // 8, m) >> (i % 8)) & 1) << 8)
        grid = _u8(table + IQ3S_AT + 4 * index + e % 4, m).to(tl.float32)
        ls = (_u8(b + 106 + g // 8, m) >> (4 * ((g // 4) % 2))) & 15
        scale = fp16_at(base, live)[:, None] * (1 + 2 * ls).to(tl.float32)
        return _signed(scale * grid, _u8(b + 74 + g, m), e % 8)


@triton.jit
def legacy_weights(rows, block, live, table, CODEC: tl.constexpr):
    """Blocks `block` ([NB]) of rows `rows` ([BLOCK_N] byte pointers; `live` [BLOCK_N, NB]) as fp32
    weights [BLOCK_N, NB, 32]: Q4_0, Q5_0, IQ4_NL, Q4_1, Q5_1."""
    j = tl.arange(0, 32)[None, None, :]
    m = live[:, :, None]
    if CODEC == 18:  # Q5_0: d, 32 fifth bits, 16 bytes of nibbles
        base = rows[:, None] + block[None, :] * 22
        b = base[:, :, None]
        low = (_u8(b + 6 + j % 16, m) >> (4 * (j // 16))) & 15
        q = low | (((_u32(b + 2, m) >> j) & 1) << 4)
        return fp16_at(base, live)[:, :, None] * (q - 16).to(tl.float32)
    elif CODEC == 27:  # Q5_1: d, m, 32 fifth bits, 16 bytes of nibbles
        base = rows[:, None] + block[None, :] * 24
        b = base[:, :, None]
        low = (_u8(b + 8 + j % 16, m) >> (4 * (j // 16))) & 15
        q = low | (((_u32(b + 4, m) >> j) & 1) << 4)
        d, offset = fp16_at(base, live)[:, :, None], fp16_at(base + 2, live)[:, :, None]
        return d * q.to(tl.float32) + offset
    elif CODEC == 26:  # Q4_1: d, m, 16 bytes of nibbles
        base = rows[:, None] + block[None, :] * 20
        b = base[:, :, None]
        q = (_u8(b + 4 + j % 16, m) >> (4 * (j // 16))) & 15
        d, offset = fp16_at(base, live)[:, :, None], fp16_at(base + 2, live)[:, :, None]
        return d * q.to(tl.float32) + offset
    else:
        base = rows[:, None] + block[None, :] * 18
        b = base[:, :, None]
        q = (_u8(b + 2 + j % 16, m) >> (4 * (j // 16))) & 15
        if CODEC == 25:  # IQ4_NL
            value = tl.load(table + IQ4NL_AT + q, mask=m, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        else:
            value = (q - 8).to(tl.float32)
        return fp16_at(base, live)[:, :, None] * value


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
    j = tl.arange(0, 128)[None, None, :]
    m = live[:, :, None]
    if CODEC == 14:
        base = rows[:, None] + block[None, :] * 132
        scale = tl.load(base.to(tl.pointer_type(tl.float32)), mask=live, other=0.0)[:, :, None]
        return _e4m3(_u8(base[:, :, None] + 4 + j, m)) * scale
    else:
        base = rows[:, None] + block[None, :] * 76
        b = base[:, :, None]
        multiplier = tl.load(base.to(tl.pointer_type(tl.float32)), mask=live, other=0.0)[:, :, None]
        scale = _e4m3(_u8(b + 4 + j // 16, m)) * multiplier
        code = (_u8(b + 12 + 8 * (j // 16) + j % 8, m) >> (4 * ((j % 16) // 8))) & 15
        return e2m1_doubled(code) * 0.5 * scale
