"""The torch dequantisers of every GGML type the device keeps give gguf's values bit for bit, for any bits
in a block (scales included), on rows of several blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken.codecs import get_codec
from freetoken.codecs.torch_dequant import DEVICE_CODECS, dequantize_rows


@pytest.mark.parametrize("name", DEVICE_CODECS)
def test_matches_the_reference_bit_for_bit(name: str) -> None:
    codec = get_codec(name)
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
    with pytest.raises(ValueError, match="no torch dequantiser for FP8"):
        dequantize_rows(torch.zeros(1, 132, dtype=torch.uint8), "FP8", 128)
