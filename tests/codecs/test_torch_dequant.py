"""The torch dequantisers of every GGML type the device keeps give gguf's values bit for bit, for any bits
in a block (scales included), on rows of several blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken.codecs import get_codec
from freetoken.codecs.torch_dequant import DEVICE_CODECS, dequantize_rows


def safetensors_rows(name: str, rng: np.random.Generator) -> np.ndarray:
    """FP8 / NVFP4 rows [3, 5, 2 blocks] from random weights (every e4m3 code in the first row's values),
    by the checkpoints' own quantizers, then repacked as the codec's rows."""
    from freetoken.codecs import fp8, nvfp4

    weights = rng.standard_normal((15, 256)).astype(np.float32) * 0.05
    if name == "FP8":
        codes, scale = fp8.quantize_tiles(weights)
        codes[0, :126] = np.arange(126)
        rows = fp8.block_rows(codes, scale)
    else:
        packed, scales, multiplier = nvfp4.quantize(weights)
        packed[0, :128] = np.arange(128)
        rows = nvfp4.block_rows(packed, scales, multiplier)
    return rows.reshape(3, 5, -1)


@pytest.mark.parametrize("name", DEVICE_CODECS)
def test_matches_the_reference_bit_for_bit(name: str) -> None:
    codec = get_codec(name)
    if name in ("FP8", "NVFP4"):
        raw = safetensors_rows(name, np.random.default_rng(0))
        want = codec.dequantize(raw, 256)
        assert np.array_equal(dequantize_rows(torch.from_numpy(raw), name, 256).numpy(), want)
        return
    n = 2 * codec.block_elements * (2 if codec.block_elements == 32 else 1)
    rng = np.random.default_rng(0)
    raw = codec.random_blocks(np.empty((3, 5, codec.row_bytes(n)), np.uint8), rng, 2**-4)
    raw[0] = rng.integers(0, 256, raw[0].shape, dtype=np.uint8)  # every bit random, scales too
    with np.errstate(all="ignore"):
        want = codec.dequantize(raw, n)
    got = dequantize_rows(torch.from_numpy(raw), name, n).numpy()
    finite = np.isfinite(want)
    assert np.array_equal(np.isfinite(got), finite)
    assert np.array_equal(got[finite], want[finite])


def test_other_codecs_are_refused() -> None:
    with pytest.raises(ValueError, match="no torch dequantiser for bf16"):
        dequantize_rows(torch.zeros(1, 256, dtype=torch.uint8), "bf16", 128)
