"""The int8-activation sides' pieces under Triton's interpreter: the block quantizer against its torch
statement, the byte permute and the nibble-table lookup against numpy's, and which banks the int8 kernels
take (the kernels themselves: test_moe_decode_kernel.py)."""

from __future__ import annotations

import os

import gguf.quants
import numpy as np
import pytest
import torch

from freetoken.runtime.moe.kernels.moe_decode import triton_available
from freetoken.runtime.moe.kernels.moe_decode_int8 import (
    int8_side,
    quantize_blocks,
    quantize_dequantize_blocks,
)

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

if triton_available():
    import triton
    import triton.language as tl

    from freetoken.runtime.moe.kernels import quant_dot_int8_triton
    from freetoken.runtime.moe.kernels.quant_dot_int8_triton import prmt, table16

    @triton.jit
    def _prmt_kernel(a_ptr, b_ptr, sel_ptr, out_ptr, N: tl.constexpr, EMULATE: tl.constexpr):
        at = tl.arange(0, N)
        a, b, sel = tl.load(a_ptr + at), tl.load(b_ptr + at), tl.load(sel_ptr + at)
        tl.store(out_ptr + at, prmt(a, b, sel, EMULATE))

    @triton.jit
    def _table16_kernel(q_ptr, lo_ptr, hi_ptr, T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr,
                        T3: tl.constexpr, N: tl.constexpr, EMULATE: tl.constexpr):  # fmt: skip
        at = tl.arange(0, N)
        lo, hi = table16(tl.load(q_ptr + at), T0, T1, T2, T3, EMULATE)
        tl.store(lo_ptr + at, lo)
        tl.store(hi_ptr + at, hi)


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


def kernel_device() -> tuple[str, bool]:
    """(where the probe kernels' tensors live, whether the integer emulation stands for the instructions):
    CPU under the interpreter, else the GPU, where the PTX runs."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available()
    return ("cpu" if interpreted else "cuda"), interpreted


def as_words(values: np.ndarray) -> torch.Tensor:
    """uint32 [N] -> int32 [N] with the same bits."""
    return torch.from_numpy(values.astype(np.uint32).view(np.int32).copy())


def test_prmt_picks_bytes_and_replicates_signs() -> None:
    """Result byte k: byte (sel >> 4k) & 7 of {a, b}, or its sign bit over the byte where bit 3 is set."""
    rng = np.random.default_rng(0)
    n = 256
    a, b, sel = (rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32) for _ in range(3))
    sel[:16] = np.arange(16) * 0x1111  # every selector nibble, copied and sign-replicated
    source = np.concatenate([a.view(np.uint8).reshape(n, 4), b.view(np.uint8).reshape(n, 4)], axis=1)
    nibbles = (sel[:, None] >> (4 * np.arange(4, dtype=np.uint32))) & 15  # [N, 4]
    picked = np.take_along_axis(source, (nibbles & 7).astype(np.int64), axis=1)
    want = np.where(nibbles >= 8, (picked >> 7) * 255, picked).astype(np.uint8)  # [N, 4] bytes
    device, emulate = kernel_device()
    out = torch.empty(n, dtype=torch.int32, device=device)
    _prmt_kernel[(1,)](*(as_words(v).to(device) for v in (a, b, sel)), out, N=n, EMULATE=emulate)
    assert np.array_equal(out.cpu().numpy().view(np.uint8).reshape(n, 4), want)


# the nibble codecs' values by gguf's dequantisers (Q4_0: n − 8), against the kernels' tables
GGUF_TABLES = {
    "MXFP4": gguf.quants.MXFP4.kvalues,
    "Q4_0": tuple(range(-8, 8)),
    "IQ4_NL": gguf.quants.IQ4_NL.kvalues,
}


@pytest.mark.parametrize("codec", GGUF_TABLES)
def test_table16_looks_up_low_and_high_nibbles(codec: str) -> None:
    """A word of four code bytes (byte i: weight i in its low nibble, 16 + i in its high) -> the values of
    weights 0..3 and 16..19, four int8 a word, as gguf's table gives them (the kernel's table words)."""
    rng = np.random.default_rng(1)
    n = 512
    codes = rng.integers(0, 16, (n, 8), dtype=np.uint8)  # [N, 8]: weights 0..3, then 16..19
    codes[:2] = np.arange(16).reshape(2, 8)  # every code, so a nibble >= 8 is met
    words = (codes[:, :4] | (codes[:, 4:] << 4)).view(np.uint32)[:, 0]
    table = np.array(GGUF_TABLES[codec], dtype=np.int8)
    device, emulate = kernel_device()
    lo, hi = (torch.empty(n, dtype=torch.int32, device=device) for _ in range(2))
    t0, t1, t2, t3 = (getattr(quant_dot_int8_triton, f"{codec}_T{w}").value for w in range(4))
    _table16_kernel[(1,)](as_words(words).to(device), lo, hi, t0, t1, t2, t3, N=n, EMULATE=emulate)
    assert np.array_equal(lo.cpu().numpy().view(np.int8).reshape(n, 4), table[codes[:, :4]])
    assert np.array_equal(hi.cpu().numpy().view(np.int8).reshape(n, 4), table[codes[:, 4:]])


@pytest.mark.parametrize(
    ("codec", "width", "code"),
    [
        ("Q4_K", 256, 3), ("Q4_K", 768, 3), ("Q8_0", 128, 1), ("Q8_0", 96, 0), ("MXFP4", 2880, 12),
        ("MXFP4", 32, 12), ("Q4_0", 96, 17), ("IQ4_NL", 160, 25), ("Q6_K", 256, 0), ("Q4_1", 64, 0),
        ("IQ4_XS", 256, 0), (None, 64, 0),
    ],
)  # fmt: skip
def test_the_int8_kernels_take_their_codecs_and_whole_q8_pairs(
    codec: str | None, width: int, code: int
) -> None:
    assert int8_side(codec, width) == code
