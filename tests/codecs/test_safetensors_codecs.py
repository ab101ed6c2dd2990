"""The codecs with no GGUF type (FP8 block-scaled, NVFP4): their e4m3/e2m1 tables against torch's and the
formats' definitions, row layouts that round-trip the checkpoint tensors exactly, and quantizers within
their steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken.codecs import CODECS, fp8, nvfp4
from freetoken.errors import FreeTokenError


def test_e4m3_table_is_torchs() -> None:
    want = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    assert np.array_equal(fp8.E4M3, want, equal_nan=True)
    assert np.isnan(fp8.E4M3[[0x7F, 0xFF]]).all() and fp8.E4M3[0x7E] == 448 and fp8.E4M3[1] == 2.0**-9


def test_e2m1_table_is_the_fp4_grid() -> None:
    assert nvfp4.E2M1[:8].tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert np.array_equal(nvfp4.E2M1[8:], -nvfp4.E2M1[:8])


@pytest.mark.parametrize("rows", [128, 200])  # a partial tile row
def test_fp8_rows_hold_the_checkpoint_exactly(rows: int) -> None:
    rng = np.random.default_rng(rows)
    codes = rng.integers(0, 256, (rows, 384), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # no NaN
    scale = rng.random((-(-rows // 128), 3), dtype=np.float32) + 0.5
    rows_ = fp8.block_rows(codes, scale)
    assert rows_.shape == (rows, 3 * 132) and CODECS["FP8"].row_bytes(384) == 3 * 132
    assert np.array_equal(CODECS["FP8"].dequantize(rows_, 384), fp8.dequantize_tiles(codes, scale))


def test_nvfp4_rows_hold_the_checkpoint_exactly() -> None:
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, (64, 128), dtype=np.uint8)  # 256 weights a row
    scales = rng.integers(0, 0x7E, (64, 16), dtype=np.uint8)  # finite positive e4m3
    got = CODECS["NVFP4"].dequantize(nvfp4.block_rows(packed, scales, 0.25), 256)
    assert np.array_equal(got, nvfp4.dequantize_packed(packed, scales, 0.25))
    # element 2j of a checkpoint row is the low nibble of byte j
    one = np.zeros((1, 128), dtype=np.uint8)
    one[0, 0] = 0x71  # elements 0 and 1: codes 1 (0.5) and 7 (6)
    values = nvfp4.dequantize_packed(one, np.full((1, 16), 0x38, dtype=np.uint8), 1.0)  # e4m3 0x38 = 1
    assert values[0, :3].tolist() == [0.5, 6.0, 0.0]


def test_quantizers_stay_within_their_steps() -> None:
    rng = np.random.default_rng(1)
    w = rng.standard_normal((128, 256)).astype(np.float32)
    back = CODECS["FP8"].dequantize(CODECS["FP8"].quantize(w), 256)
    assert np.abs(back - w).max() <= np.abs(w).max() * 2.0**-4  # e4m3: 3 mantissa bits
    packed, scales, mult = nvfp4.quantize(w)
    assert np.corrcoef(nvfp4.dequantize_packed(packed, scales, mult).ravel(), w.ravel())[0, 1] > 0.99


def test_fp8_rows_need_whole_blocks() -> None:
    with pytest.raises(FreeTokenError, match="not a whole number of FP8 blocks"):
        CODECS["FP8"].quantize(np.zeros((2, 100), dtype=np.float32))
