"""What the Triton kernels know the GGML types beyond Q8_0, Q4_K, Q6_K and MXFP4 by (their numbers, as
cpu_experts.CODEC_IDS), and the one table of codebooks and sign patterns they read on the device
(quant_lowbit_triton.py). No Triton here: the launchers import it where Triton may be absent."""

from __future__ import annotations

from functools import cache

import numpy as np
import torch

SUPERBLOCK_CODECS = {
    "Q5_K": 8, "IQ4_XS": 10, "Q2_K": 19, "Q3_K": 20, "IQ2_XXS": 21, "IQ2_XS": 22, "IQ3_XXS": 23, "IQ3_S": 24,
}  # fmt: skip
LEGACY_CODECS = {"Q4_0": 17, "Q5_0": 18, "IQ4_NL": 25, "Q4_1": 26, "Q5_1": 27}
BLOCK128_CODECS = {"FP8": 14, "NVFP4": 15}  # the safetensors codecs: blocks of 128 weights
# codec_table's parts, at these byte offsets: IQ4_NL's 16 int8 values, ksigns, then the four grids
IQ4NL_AT, KSIGNS_AT, IQ2XXS_AT, IQ2XS_AT, IQ3XXS_AT, IQ3S_AT = 0, 16, 144, 2192, 6288, 7312
TABLE_BYTES = 9360


def table_bytes() -> np.ndarray:
    """The codebooks and sign patterns the kernels read, uint8 [TABLE_BYTES], from gguf's tables."""
    import gguf.quants as gq

    from freetoken.codecs.torch_lowbit import IQ4_NL_VALUES

    parts = [np.array(IQ4_NL_VALUES, np.int8).view(np.uint8), np.frombuffer(gq.IQ2_XXS.ksigns, np.uint8)]
    for cls in (gq.IQ2_XXS, gq.IQ2_XS, gq.IQ3_XXS, gq.IQ3_S):
        cls.init_grid()
        parts.append(np.asarray(cls.grid).reshape(-1).astype(np.uint8))
    out = np.concatenate(parts)
    assert out.size == TABLE_BYTES
    return out


@cache
def codec_table(device: torch.device) -> torch.Tensor:
    """table_bytes() on `device` (made once per device, before any graph capture reads it)."""
    return torch.from_numpy(table_bytes()).to(device)
