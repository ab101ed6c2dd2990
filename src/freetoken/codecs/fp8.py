"""FP8 block-scaled weights (e4m3 values with one fp32 scale per 128×128 tile, `weight_scale_inv`, as
Qwen3-FP8 and DeepSeek-V3 checkpoints ship them) and the codec rows FreeToken keeps them in.

A checkpoint stores a [R, C] e4m3 weight and a [⌈R/128⌉, ⌈C/128⌉] fp32 scale grid (w = value · scale of
its tile). The pool keeps rows: per 128 weights of a row, its tile's fp32 scale then the 128 e4m3 bytes
(132 bytes, the codec "FP8"), so a row is whole blocks like every other codec's and experts stay
outermost. The reference dequantiser decodes e4m3 through a 256-entry table (e4m3fn: bias 7, no
infinities, 0x7F/0xFF NaN).
"""

from __future__ import annotations

import numpy as np

TILE = 128
BLOCK_BYTES = 4 + TILE  # fp32 scale, then 128 e4m3 values


def _e4m3_table() -> np.ndarray:
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp, mant = (codes >> 3) & 15, codes & 7
    value = np.where(exp == 0, mant / 8.0 * 2.0**-6, (1 + mant / 8.0) * 2.0 ** (exp - 7.0))
    value = np.where((codes & 0x7F) == 0x7F, np.nan, value)
    return (sign * value).astype(np.float32)


E4M3 = _e4m3_table()  # byte -> value


def dequantize_tiles(values: np.ndarray, scale_inv: np.ndarray) -> np.ndarray:
    """A checkpoint's [R, C] e4m3 bytes (uint8) and [⌈R/128⌉, ⌈C/128⌉] scales -> float32 [R, C]."""
    rows, cols = values.shape
    scale = np.repeat(np.repeat(scale_inv.astype(np.float32), TILE, axis=0), TILE, axis=1)[:rows, :cols]
    return E4M3[values] * scale


def block_rows(values: np.ndarray, scale_inv: np.ndarray) -> np.ndarray:
    """A checkpoint's [R, C] e4m3 bytes and tile scales -> the codec's rows, uint8 [R, C / 128 · 132]
    (C a multiple of 128)."""
    rows, cols = values.shape
    blocks = cols // TILE
    out = np.empty((rows, blocks, BLOCK_BYTES), dtype=np.uint8)
    scale = np.repeat(scale_inv.astype(np.float32), TILE, axis=0)[:rows, :blocks]  # [R, C / 128]
    out[:, :, :4] = np.ascontiguousarray(scale).view(np.uint8).reshape(rows, blocks, 4)
    out[:, :, 4:] = values.reshape(rows, blocks, TILE)
    return out.reshape(rows, blocks * BLOCK_BYTES)


def dequantize_rows(data: np.ndarray) -> np.ndarray:
    """The codec's rows, uint8 [..., k · 132] -> float32 [..., k · 128]."""
    blocks = data.reshape(*data.shape[:-1], -1, BLOCK_BYTES)
    scale = np.ascontiguousarray(blocks[..., :4]).view(np.float32)  # [..., k, 1]
    return (E4M3[blocks[..., 4:]] * scale).reshape(*data.shape[:-1], -1)


def to_e4m3(values: np.ndarray) -> np.ndarray:
    """float values within ±448 -> e4m3 bytes, rounded to nearest even (torch's conversion)."""
    import torch

    return (
        torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
        .to(torch.float8_e4m3fn)
        .view(torch.uint8)
        .numpy()
    )


def quantize_tiles(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float [R, C] -> (e4m3 bytes [R, C], scale_inv [⌈R/128⌉, ⌈C/128⌉]) as FP8 checkpoints are made:
    each tile's scale is max|w| / 448 (for tests and tools)."""
    rows, cols = weight.shape
    tr, tc = -(-rows // TILE), -(-cols // TILE)
    padded = np.zeros((tr * TILE, tc * TILE), dtype=np.float32)
    padded[:rows, :cols] = np.abs(weight)
    amax = padded.reshape(tr, TILE, tc, TILE).max(axis=(1, 3))
    scale = np.maximum(amax / 448.0, 1e-12).astype(np.float32)
    scaled = weight / np.repeat(np.repeat(scale, TILE, axis=0), TILE, axis=1)[:rows, :cols]
    return to_e4m3(scaled), scale


def quantize_rows(values: np.ndarray) -> np.ndarray:
    """float [..., n] -> the codec's rows, uint8 [..., n / 128 · 132], one scale per 128 weights of a row
    (max|w| / 448): finer than a checkpoint's 128×128 tiles, which `ft convert --expert-dtype fp8` uses."""
    blocks = np.ascontiguousarray(values, dtype=np.float32).reshape(*values.shape[:-1], -1, TILE)
    scale = np.maximum(np.abs(blocks).max(axis=-1, keepdims=True) / 448.0, 1e-12).astype(np.float32)
    out = np.empty((*blocks.shape[:-1], BLOCK_BYTES), dtype=np.uint8)
    out[..., :4] = scale.view(np.uint8)
    out[..., 4:] = to_e4m3(blocks / scale)
    return out.reshape(*values.shape[:-1], -1)
