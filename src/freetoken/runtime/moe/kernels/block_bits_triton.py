"""Bit-level helpers the Triton codec kernels share: fp16 scales read from block bytes, small ints made
fp32 without a conversion instruction, Q4_K/Q5_K's packed 6-bit scales and mins, and byte runs at any
alignment read as 32-bit words (MXFP4's 17-byte blocks)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def fp16_at(ptr, mask):
    """The little-endian fp16 at byte pointers `ptr` (2-byte aligned: every codec's scales are), as fp32."""
    return tl.load(ptr.to(tl.pointer_type(tl.float16)), mask=mask, other=0.0).to(tl.float32)


@triton.jit
def unaligned_words(first, mask):
    """The four little-endian int32 words of the 16 bytes from byte pointers `first` ([N, NB], any
    alignment) -> [N, NB, 4]: word w from the aligned words w and w + 1 around them, shifted by `first`'s
    offset s in its aligned word (word w + 1 read only where s > 0: it then still holds one of the 16
    bytes, so no read passes the last aligned word that does)."""
    w = tl.arange(0, 4)[None, None, :]
    address = first.to(tl.int64)
    offset = (address & 3)[:, :, None]
    aligned = (address[:, :, None] - offset).to(tl.pointer_type(tl.int32)) + w
    mask = mask[:, :, None]
    low = tl.load(aligned, mask=mask, other=0).to(tl.uint32, bitcast=True)
    high = tl.load(aligned + 1, mask=mask & (offset > 0), other=0).to(tl.uint32, bitcast=True)
    shift = (8 * offset).to(tl.uint32)
    return tl.where(shift == 0, low, (low >> shift) | (high << (32 - shift))).to(tl.int32, bitcast=True)


@triton.jit
def fp16_low(word):
    """The fp16 in the low half of int32 words, as fp32."""
    return (word & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def as_float(small, offset: tl.constexpr):
    """Small non-negative ints (int32, < 2^23) as fp32 minus `offset`, exact, without a conversion
    instruction: 2^23 + n is n's bits under 2^23's exponent (the int-to-float unit runs at a quarter of
    the FMA rate)."""
    return (small | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + offset)


@triton.jit
def k4_scale_min(s0, s1, s2, sub):
    """Q4_K's 6-bit scales and mins of sub-blocks `sub` (in 0..7) from a super-block's 12 scale bytes as
    three int32 words (bytes 0-3, 4-7, 8-11), all broadcast to one shape -> two fp32 of that shape
    (gguf's get_scale_min_k4)."""
    shift = 8 * (sub & 3)
    low = sub < 4
    b0 = (s0 >> shift) & 255  # byte sub (sub < 4) or sub − 4
    b1 = (s1 >> shift) & 255  # byte sub + 4 or sub
    b2 = (s2 >> shift) & 255  # byte sub + 4 (sub >= 4)
    scale = tl.where(low, b0 & 63, (b2 & 15) | ((b0 >> 6) << 4))
    minimum = tl.where(low, b1 & 63, (b2 >> 4) | ((b1 >> 6) << 4))
    return scale.to(tl.float32), minimum.to(tl.float32)


@triton.jit
def k4_scale_min_words(s0, s1, s2, sub):
    """k4_scale_min of header words [N] and sub-blocks `sub` [S] -> two [N, S] fp32."""
    return k4_scale_min(s0[:, None], s1[:, None], s2[:, None], sub[None, :])


@triton.jit
def k4_header(base, live):
    """A Q4_K super-block's header (16 bytes at 4-byte aligned byte pointers `base` [N]) as four int32
    words: d | dmin << 16, then the scale bytes 0-3, 4-7, 8-11."""
    words = base.to(tl.pointer_type(tl.int32))
    head = tl.load(words, mask=live, other=0)
    return (
        head,
        tl.load(words + 1, mask=live, other=0),
        tl.load(words + 2, mask=live, other=0),
        tl.load(words + 3, mask=live, other=0),
    )


@triton.jit
def e2m1_doubled(code):
    """Twice the e2m1 value of 4-bit codes (int32): magnitudes 0 1 2 3 4 6 8 12, bit 3 the sign."""
    mag = code & 7
    doubled = as_float(tl.where(mag < 4, mag, (2 + (mag & 1)) << ((mag >> 1) - 1)), 0.0)
    return tl.where(code >= 8, -doubled, doubled)
