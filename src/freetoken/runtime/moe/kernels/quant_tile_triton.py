"""In-register dequantisation of weight tiles for the fused decode kernels (moe_decode_triton.py): a tile
[BLOCK_N, BLOCK_K] of rows stored as a codec's blocks, read by byte offset and widened to fp32.

Codecs by the CPU kernel's numbers (cpu_experts.CODEC_IDS): 1 Q8_0 (34-byte blocks of 32: fp16 scale,
int8 quants), 3 Q4_K (144-byte super-blocks of 256: fp16 d and dmin, 12 bytes of 6-bit scales and mins
for eight sub-blocks of 32, 128 bytes of nibbles, chunk j of 64 weights in bytes 32j.. as low then high
nibbles), 12 MXFP4 (17-byte blocks of 32: an e8m0 scale 2^(e − 128), 16 bytes, weights k and k + 16 in
byte k's low and high nibble, doubled e2m1 values). References: codecs/torch_dequant.py and gguf's.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _fp16_at(ptr, mask):
    """The little-endian fp16 at byte pointers `ptr` (2-byte aligned or not), as fp32."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def quant_tile(rows, k, mask, CODEC: tl.constexpr):
    """rows: [BLOCK_N, 1] byte pointers to row starts; k: [1, BLOCK_K] weight indices in the row; mask:
    [BLOCK_N, BLOCK_K] -> the weights, fp32 (0 where masked off)."""
    if CODEC == 1:  # Q8_0
        base = rows + (k // 32) * 34
        q = tl.load(base + 2 + k % 32, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        return _fp16_at(base, mask) * q
    elif CODEC == 3:  # Q4_K
        base = rows + (k // 256) * 144
        w = k % 256
        chunk = w // 64
        high = (w % 64) // 32
        sub = 2 * chunk + high  # sub-block of 32
        byte = tl.load(base + 16 + 32 * chunk + w % 32, mask=mask, other=0).to(tl.int32)
        q = tl.where(high == 1, byte >> 4, byte & 15).to(tl.float32)
        s_sub = tl.load(base + 4 + sub, mask=mask, other=0).to(tl.int32)
        s_next = tl.load(base + 8 + sub, mask=mask, other=0).to(tl.int32)  # byte sub + 4
        s_prev = tl.load(base + 4 + tl.where(sub >= 4, sub - 4, 0), mask=mask, other=0).to(tl.int32)
        low = sub < 4
        scale = tl.where(low, s_sub & 63, (s_next & 15) | ((s_prev >> 6) << 4)).to(tl.float32)
        minimum = tl.where(low, s_next & 63, (s_next >> 4) | ((s_sub >> 6) << 4)).to(tl.float32)
        return _fp16_at(base, mask) * scale * q - _fp16_at(base + 2, mask) * minimum
    else:  # MXFP4 (12)
        base = rows + (k // 32) * 17
        w = k % 32
        byte = tl.load(base + 1 + w % 16, mask=mask, other=0).to(tl.int32)
        code = tl.where(w >= 16, byte >> 4, byte & 15)
        mag = code & 7
        doubled = tl.where(mag < 4, mag, (2 + (mag & 1)) << ((mag >> 1) - 1)).to(tl.float32)
        value = tl.where(code >= 8, -doubled, doubled)
        exponent = tl.load(base, mask=mask, other=0).to(tl.float32) - 128.0
        return value * tl.exp2(exponent)
