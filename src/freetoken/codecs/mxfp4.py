"""MXFP4 weights as gpt-oss's safetensors checkpoints ship them, turned into the rows of the codec "MXFP4"
(GGUF's block: one e8m0 scale byte, then 16 bytes holding the block's first 16 weights in the low
nibbles and the next 16 in the high ones).

Checkpoint: `X_blocks` uint8 [..., R, C / 32, 16], weights 2j and 2j + 1 of a block in the low and high
nibble of byte j; `X_scales` uint8 [..., R, C / 32], e8m0: w = fp4 · 2^(s − 127). R are output rows (for
the fused gate_up bank, gate and up rows alternating), C inputs. Both forms use the same 16 e2m1 codes
(GGUF's table holds them doubled, with its scale 2^(e − 128)), so only the nibbles move.
"""

from __future__ import annotations

import numpy as np

BLOCK = 32
BLOCK_BYTES = 1 + BLOCK // 2


def gguf_rows(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks [..., R, G, 16], scales [..., R, G] -> the codec's rows, uint8 [..., R, G · 17]."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} do not match scales {list(scales.shape)}")
    codes = np.stack((blocks & 15, blocks >> 4), axis=-1).reshape(*blocks.shape[:-1], BLOCK)  # weight order
    packed = codes[..., : BLOCK // 2] | (codes[..., BLOCK // 2 :] << 4)
    rows = np.concatenate((scales[..., None], packed), axis=-1)  # [..., R, G, 17]
    return np.ascontiguousarray(rows.reshape(*scales.shape[:-1], -1), dtype=np.uint8)
