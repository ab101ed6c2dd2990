"""NVFP4 weights (FP4 e2m1 values in blocks of 16, an e4m3 scale per block and one fp32 global scale per
tensor) as ModelOpt and compressed-tensors checkpoints ship them, and the codec rows FreeToken keeps.

Checkpoints: values packed two per byte, element 2j in the low nibble, [R, C / 2] uint8; scales [R, C / 16]
e4m3. ModelOpt: w = fp4 · scale · `weight_scale_2`; compressed-tensors: w = fp4 · scale /
`weight_global_scale` (its global is the divisor). The codec "NVFP4" keeps, per 128 weights of a row, the
tensor's fp32 multiplier, the eight e4m3 block scales and 64 bytes of values, each block's 8 bytes holding
its first eight weights in the low nibbles and the next eight in the high ones (76 bytes).
"""

from __future__ import annotations

import numpy as np

from freetoken.codecs.fp8 import E4M3

BLOCK = 16
GROUP = 128
GROUP_BYTES = 4 + GROUP // BLOCK + GROUP // 2
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


def unpack(packed: np.ndarray) -> np.ndarray:
    """[R, C / 2] uint8, element 2j low -> codes [R, C]."""
    out = np.empty((packed.shape[0], packed.shape[1] * 2), dtype=np.uint8)
    out[:, 0::2], out[:, 1::2] = packed & 15, packed >> 4
    return out


def dequantize_packed(packed: np.ndarray, scales: np.ndarray, multiplier: float) -> np.ndarray:
    """A checkpoint's values [R, C / 2], e4m3 scale bytes [R, C / 16] and its global multiplier (ModelOpt's
    weight_scale_2, or 1 / compressed-tensors' weight_global_scale) -> float32 [R, C]."""
    codes = unpack(packed)
    scale = np.repeat(E4M3[scales], BLOCK, axis=1)
    return E2M1[codes] * scale * np.float32(multiplier)


def block_rows(packed: np.ndarray, scales: np.ndarray, multiplier: float) -> np.ndarray:
    """The checkpoint's tensors -> the codec's rows, uint8 [R, C / 128 · 76] (C a multiple of 128)."""
    codes = unpack(packed)
    rows, cols = codes.shape
    groups = cols // GROUP
    blocks = codes.reshape(rows, groups, GROUP // BLOCK, BLOCK)
    repacked = blocks[..., :8] | (blocks[..., 8:] << 4)  # [R, G, 8, 8]
    out = np.empty((rows, groups, GROUP_BYTES), dtype=np.uint8)
    out[:, :, :4] = np.frombuffer(np.float32(multiplier).tobytes(), np.uint8)
    out[:, :, 4:12] = scales.reshape(rows, groups, GROUP // BLOCK)
    out[:, :, 12:] = repacked.reshape(rows, groups, GROUP // 2)
    return out.reshape(rows, groups * GROUP_BYTES)


def dequantize_rows(data: np.ndarray) -> np.ndarray:
    """The codec's rows, uint8 [..., g · 76] -> float32 [..., g · 128]."""
    groups = data.reshape(*data.shape[:-1], -1, GROUP_BYTES)
    multiplier = np.ascontiguousarray(groups[..., :4]).view(np.float32)  # [..., g, 1]
    scale = E4M3[groups[..., 4:12]] * multiplier  # [..., g, 8]
    values = groups[..., 12:].reshape(*groups.shape[:-1], GROUP // BLOCK, 8)
    codes = np.concatenate((values & 15, values >> 4), axis=-1)  # [..., g, 8, 16]
    return (E2M1[codes] * scale[..., None]).reshape(*data.shape[:-1], -1)


def quantize(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """float [R, C] -> (packed [R, C / 2], e4m3 scale bytes [R, C / 16], multiplier) as NVFP4 checkpoints
    are made: multiplier = max|w| / (448 · 6), block scales max|block| / 6 / multiplier rounded to e4m3,
    values rounded to the nearest e2m1 (for tests and tools)."""
    rows, cols = weight.shape
    multiplier = max(float(np.abs(weight).max()) / (448.0 * 6.0), 1e-12)
    blocks = weight.reshape(rows, cols // BLOCK, BLOCK)
    want = np.abs(blocks).max(axis=-1) / 6.0 / multiplier
    finite = np.where(np.isnan(E4M3) | (E4M3 < 0), np.inf, E4M3)
    scales = np.abs(want[..., None] - finite).argmin(axis=-1).astype(np.uint8)
    step = E4M3[scales] * multiplier  # [R, C / 16]
    scaled = np.where(step[..., None] > 0, blocks / np.maximum(step[..., None], 1e-30), 0.0)
    codes = np.abs(scaled[..., None] - E2M1).argmin(axis=-1).astype(np.uint8).reshape(rows, cols)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8), scales, multiplier
