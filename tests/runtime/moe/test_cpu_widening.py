"""The prompt path's row widening (experts_cpu.c widen_bf16): each codec's straight-to-bf16 form gives bit
for bit what dequantising to fp32 and rounding to bf16 gives, over every byte pattern with finite fp16
scales and e8m0 scales at their extremes (0 and 1 make subnormal values; 254 and 255 overflow), and the
plain way stays within bf16 rounding of gguf's dequantisation."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from freetoken.codecs import get_codec
from freetoken.runtime.moe.kernels.cpu_experts import CODEC_IDS
from freetoken.runtime.moe.kernels.loader import load_library

# codec -> (weights a row, block bytes, offsets of fp16 scales in a block)
LAYOUT = {
    "Q4_K": (512, 144, (0, 2)),
    "Q5_K": (512, 176, (0, 2)),
    "Q6_K": (512, 210, (208,)),
    "Q8_0": (256, 34, (0,)),
    "MXFP4": (256, 17, ()),
    "IQ4_XS": (512, 136, (0,)),
    # the low-bit types: their int8 decoding scaled per 16 (lowbit_dot.h), sixteen weights at a time
    "Q4_0": (256, 18, (0,)),
    "Q4_1": (256, 20, (0, 2)),
    "Q5_0": (256, 22, (0,)),
    "Q5_1": (256, 24, (0, 2)),
    "IQ4_NL": (256, 18, (0,)),
    "Q2_K": (512, 84, (80, 82)),
    "Q3_K": (512, 110, (108,)),
    "IQ2_XXS": (512, 66, (0,)),
    "IQ2_XS": (512, 74, (0,)),
    "IQ3_XXS": (512, 98, (0,)),
    "IQ3_S": (512, 110, (0,)),
}


def random_rows(codec: str, rows: int, seed: int) -> np.ndarray:
    n, block, scales = LAYOUT[codec]
    raw = np.random.default_rng(seed).integers(0, 256, (rows, get_codec(codec).row_bytes(n)), np.uint8)
    blocks = raw.reshape(rows, -1, block)
    for at in scales:
        blocks[:, :, at + 1] &= 0xFB  # the fp16's exponent below 31: finite
    if codec == "MXFP4":
        blocks[::2, :4, 0] = np.array([0, 1, 254, 255], np.uint8)
    return raw


def widen(lib: ctypes.CDLL, codec: str, raw: np.ndarray, plain: int) -> tuple[int, np.ndarray]:
    out = np.empty((raw.shape[0], LAYOUT[codec][0]), np.uint16)
    way = lib.ft_widen_rows_bf16(
        CODEC_IDS[codec], raw.ctypes.data, out.ctypes.data, raw.shape[0], out.shape[1], plain
    )
    return way, out


@pytest.mark.parametrize("codec", sorted(LAYOUT))
def test_straight_widening_is_the_plain_one_bit_for_bit(codec: str) -> None:
    lib = load_library()
    if lib is None:
        pytest.skip("no C compiler")
    raw = random_rows(codec, 64, seed=len(codec))
    way, straight = widen(lib, codec, raw, plain=0)
    if way < 0:
        pytest.skip("this CPU has no bf16 conversion instructions: rows widen the plain way only")
    assert way == 1
    assert widen(lib, codec, raw, plain=1)[0] == 0
    plain = widen(lib, codec, raw, plain=1)[1]
    assert np.array_equal(straight, plain)
    values = torch.from_numpy(plain.view(np.int16)).view(torch.bfloat16).float()
    with np.errstate(over="ignore"):  # e8m0 255 times the codebook's largest values: inf, both ways
        want = torch.from_numpy(get_codec(codec).dequantize(raw, LAYOUT[codec][0])).float()
    finite = torch.isfinite(want)
    assert bool((torch.isinf(values) == torch.isinf(want)).all())
    torch.testing.assert_close(values[finite], want[finite].bfloat16().float(), rtol=2**-7, atol=0)
