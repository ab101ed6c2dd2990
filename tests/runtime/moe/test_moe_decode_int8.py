"""The int8-activation sides' pieces under Triton's interpreter: the block quantizer against its torch
statement, and which banks the int8 kernels take (the kernels themselves: test_moe_decode_kernel.py)."""

from __future__ import annotations

import pytest
import torch

from freetoken.runtime.moe.kernels.moe_decode import triton_available
from freetoken.runtime.moe.kernels.moe_decode_int8 import (
    int8_side,
    quantize_blocks,
    quantize_dequantize_blocks,
)

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")


def unpack(words: torch.Tensor) -> torch.Tensor:
    """int32 words [R, W / 4] -> their int8 quants [R, W] (little-endian)."""
    return words.contiguous().view(torch.int8).reshape(words.shape[0], -1)


def test_quantized_blocks_are_the_reference_values() -> None:
    g = torch.Generator().manual_seed(0)
    v = torch.randn(3, 96, generator=g) * torch.tensor([1.0, 1e-3, 40.0])[:, None]
    v[0, 32:64] = 0.0  # a block of zeros: scale 0, quants 0
    v[1, :32] = torch.linspace(-100, 100, 32)
    v[1, :4] = torch.tensor([-127.0, 2.5, 3.5, -2.5])  # d = 1: ties round to even (2, 4, -2)
    q, d, s = quantize_blocks(v.bfloat16())
    want = quantize_dequantize_blocks(v.bfloat16())
    quants = unpack(q).float()
    assert quants.abs().max() <= 127
    torch.testing.assert_close(quants * d.repeat_interleave(32, dim=1), want, rtol=0, atol=0)
    torch.testing.assert_close(s, want.reshape(3, 3, 32).sum(dim=2), rtol=1e-6, atol=1e-6)
    assert float(d[0, 1]) == 0.0 and not quants[0, 32:64].any()
    assert quants[1, 1:4].tolist() == [2.0, 4.0, -2.0]


@pytest.mark.parametrize(
    ("codec", "width", "code"),
    [("Q4_K", 256, 3), ("Q4_K", 768, 3), ("Q8_0", 128, 1), ("Q8_0", 96, 0), ("Q6_K", 256, 0), (None, 64, 0)],
)
def test_the_int8_kernels_take_q4k_and_whole_q8_pairs(codec: str | None, width: int, code: int) -> None:
    assert int8_side(codec, width) == code
