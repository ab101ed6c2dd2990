"""The CPU expert kernel over the types lowbit_dot.h decodes (Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K,
IQ2_XXS, IQ2_XS, IQ3_XXS, IQ3_S; lowbit_dot_int8.h against int8 activations) against fp32 experts over
gguf's dequantisation of the same random blocks: one token (each row dotted as it is decoded), twelve
(rows widened once for the pairs of an expert), bf16 activations (a bf16 model's); the 32-weight types
over rows of an odd number of blocks."""

from __future__ import annotations

import pytest
import torch
from test_cpu_kernel_codecs import quantized_activation_reference

import gguf_fixture
from freetoken.codecs import get_codec
from freetoken.runtime.moe.kernels.cpu_experts import (
    bf16_act_reference,
    cpu_experts,
    kernel_available,
    kernel_takes,
    stored_reference,
)
from oracle import rel_err

pytestmark = pytest.mark.skipif(not kernel_available(), reason="needs the compiled CPU kernel")

LOWBIT = ["Q4_0", "Q5_0", "IQ4_NL", "Q2_K", "Q3_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ3_S", "Q4_1", "Q5_1"]


def case(
    codecs: tuple[str, str], tokens: int, h: int, i: int, bf16: bool = False
) -> tuple[torch.Tensor, ...]:
    e, k = 6, 3
    gate_up = torch.from_numpy(gguf_fixture.random_blocks(codecs[0], (e, 2 * i, h), seed=1))
    down = torch.from_numpy(gguf_fixture.random_blocks(codecs[1], (e, h, i), seed=2))
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, h, generator=gen)
    x = x.bfloat16().float() if bf16 else x
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(tokens)])
    return x, ids, torch.rand(tokens, k, generator=gen), gate_up, down


@pytest.mark.parametrize("codec", LOWBIT)
@pytest.mark.parametrize("tokens", [1, 12])
def test_low_bit_rows_match_the_dequantised_reference(codec: str, tokens: int) -> None:
    codecs = (codec, LOWBIT[(LOWBIT.index(codec) + 1) % len(LOWBIT)])
    x, ids, w, gate_up, down = case(codecs, tokens, 512, 768)
    assert kernel_takes(gate_up, down, codecs)
    ours = cpu_experts(x, ids, w, gate_up, down, threads=2, codecs=codecs)
    assert rel_err(ours, stored_reference(x, ids, w, gate_up, down, codecs)) < 1e-5
    # against int8 activation blocks (per 256 for the super-block types, per 32 for the others): tight to
    # the same experts given activations quantized the kernel's way, and within what that costs
    act8 = cpu_experts(x, ids, w, gate_up, down, threads=2, codecs=codecs, int8_act=True)
    gu_f, dn_f = (
        torch.from_numpy(get_codec(c).dequantize(b.numpy(), n))
        for c, b, n in zip(codecs, (gate_up, down), (512, 768), strict=True)
    )
    blocks = tuple(256 if get_codec(c).block_elements == 256 else 32 for c in codecs)
    assert rel_err(act8, quantized_activation_reference(x, ids, w, gu_f, dn_f, blocks=blocks)) < 1e-3
    assert rel_err(act8, stored_reference(x, ids, w, gate_up, down, codecs)) < 3e-2


@pytest.mark.parametrize("codec", ["Q4_0", "Q5_0", "IQ4_NL", "Q4_1", "Q5_1"])
def test_rows_of_odd_block_counts(codec: str) -> None:
    """Rows of 5 and 7 blocks of 32: a decoded chunk shorter than 256 at each row's end; against int8
    activations, each block decoded in registers."""
    x, ids, w, gate_up, down = case((codec, codec), 3, 160, 224)
    ours = cpu_experts(x, ids, w, gate_up, down, threads=2, codecs=(codec, codec))
    assert rel_err(ours, stored_reference(x, ids, w, gate_up, down, (codec, codec))) < 1e-5
    act8 = cpu_experts(x, ids, w, gate_up, down, threads=2, codecs=(codec, codec), int8_act=True)
    gu_f, dn_f = (
        torch.from_numpy(get_codec(codec).dequantize(b.numpy(), n)) for b, n in ((gate_up, 160), (down, 224))
    )
    assert rel_err(act8, quantized_activation_reference(x, ids, w, gu_f, dn_f, blocks=(32, 32))) < 1e-3


@pytest.mark.parametrize("codec", ["Q3_K", "IQ2_XXS", "IQ4_NL"])
def test_bf16_activations(codec: str) -> None:
    """A bf16 model's activations: the pairs of an expert widen its rows to bf16 where the CPU has bf16
    dot instructions (bf16_act_reference); one token keeps fp32 dots."""
    for tokens in (1, 12):
        x, ids, w, gate_up, down = case((codec, codec), tokens, 256, 512, bf16=True)
        ours = cpu_experts(x, ids, w, gate_up, down, threads=2, codecs=(codec, codec))
        plain = stored_reference(x, ids, w, gate_up, down, (codec, codec))
        rounded = bf16_act_reference(x, ids, w, gate_up, down, codecs=(codec, codec))
        assert min(rel_err(ours, rounded), rel_err(ours, plain)) < 1e-2
        assert rel_err(ours, plain) < 1e-2


@pytest.mark.parametrize("codec", LOWBIT)
def test_bf16_activations_of_one_or_two_pairs(codec: str) -> None:
    """A bf16 model's decode (an expert's one or two pairs): the rows' int8 decoding meets the bf16
    activations in pair-dot instructions where the CPU has them (lowbit_bf16_dot.h; scales and, for
    Q2_K, Q4_1 and Q5_1, mins per 16 applied after the integer sums), the fp32 dots elsewhere: either way
    the products are exact, so the result is the reference's up to the order of fp32 sums (the
    activations between the projections rounded to bf16, as a bf16 model rounds them)."""
    for tokens in (1, 2):
        x, ids, w, gate_up, down = case((codec, codec), tokens, 256, 512, bf16=True)
        ours = cpu_experts(x, ids, w, gate_up, down, threads=2, codecs=(codec, codec))
        assert rel_err(ours, bf16_act_reference(x, ids, w, gate_up, down, codecs=(codec, codec))) < 1e-4
