"""The grouped MoE prefill kernels against the plain-torch reference, run by Triton's interpreter on CPU
(the same kernel bodies the GPU compiles; tests/gpu runs them compiled)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from codec_banks import codec_rows  # block scales giving values about 1
from freetoken.codecs import get_codec
from freetoken.runtime.moe.expert_fn import SILU, ExpertFn, PairBias
from freetoken.runtime.moe.experts import grouped_experts
from freetoken.runtime.moe.kernels.moe_decode import triton_available
from freetoken.runtime.moe.kernels.moe_prefill import PrefillBlocks, grouped_moe, sort_pairs

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

SMALL = PrefillBlocks(block_m=16, block_n=16, block_k=16)  # chunks cut H and I partway (72, 40)


def case(t: int, k: int, slots: int, h: int = 72, i: int = 40, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    ids = torch.stack([torch.randperm(slots, generator=g)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=g)
    gate_up = torch.randn(slots, 2 * i, h, generator=g) / h**0.5
    down = torch.randn(slots, h, i, generator=g) / i**0.5
    return x, ids, weights, gate_up, down


@pytest.mark.parametrize("block_m", [16, 32])
def test_sorting_places_every_pair_once_in_its_experts_blocks(block_m: int) -> None:
    _, ids, *_ = case(37, 3, slots=7, seed=1)
    ids[4, 1] = -1
    ids[9] = -1
    pb = sort_pairs(ids, 7, block_m)
    flat = ids.reshape(-1)
    placed = pb.sorted_pairs.long()
    real = placed[placed < pb.pairs]
    assert sorted(real.tolist()) == [p for p in range(flat.numel()) if flat[p] >= 0]
    for b, e in enumerate(pb.block_expert.tolist()):
        block = placed[b * block_m : (b + 1) * block_m]
        members = block[block < pb.pairs]
        if e == 7:
            assert members.numel() == 0
        else:
            assert members.numel() > 0 and bool((flat[members] == e).all())
            assert members.tolist() == sorted(members.tolist())
    assert pb.sorted_pairs.numel() % block_m == 0


@pytest.mark.parametrize(("t", "k", "slots"), [(1, 1, 3), (5, 2, 4), (40, 3, 6), (23, 4, 16)])
def test_matches_the_reference_in_fp32(t: int, k: int, slots: int) -> None:
    x, ids, weights, gate_up, down = case(t, k, slots, seed=t)
    ids[0, 0] = -1
    got = grouped_moe(x, ids, weights, gate_up, down, blocks=SMALL)
    torch.testing.assert_close(got, grouped_experts(x, ids, weights, gate_up, down), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fn", [SILU, ExpertFn("clamped", limit=0.5), ExpertFn("clamped_silu", limit=0.5)])
def test_every_function_and_biases_match(fn: ExpertFn) -> None:
    x, ids, weights, gate_up, down = case(19, 2, 5, seed=3)
    bias = PairBias(torch.randn(9, 80) * 0.3, torch.randint(0, 9, ids.shape))  # expert ids apart from slots
    want = grouped_experts(x, ids, weights, gate_up, down, fn, bias)
    got = grouped_moe(x, ids, weights, gate_up, down, fn, bias, blocks=SMALL)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("codecs", "h", "i"),
    [
        (("Q8_0", "Q8_0"), 96, 64),
        (("Q4_K", "Q6_K"), 256, 512),
        (("MXFP4", "Q4_K"), 64, 256),
        (("Q5_K", "IQ4_XS"), 256, 256),
        (("Q2_K", "Q3_K"), 256, 256),
        (("IQ2_XXS", "IQ2_XS"), 256, 256),
        (("IQ3_XXS", "IQ3_S"), 256, 256),
        (("Q4_0", "Q5_0"), 96, 64),
        (("IQ4_NL", "Q4_0"), 64, 96),
        (("Q4_1", "Q5_1"), 96, 64),
        (("FP8", "NVFP4"), 256, 384),
    ],
)
def test_banks_of_codec_blocks_are_dequantised_in_registers(codecs: tuple[str, str], h: int, i: int) -> None:
    """Blocks as stored, against the sum over gguf's dequantisation of the same blocks; 20 tokens over 4
    slots fill several blocks per expert, and a chunk of the Q8_0 row (96 = 1.5 × 64) is cut by the mask."""
    rng = np.random.default_rng(2)
    gu, dn = (get_codec(name) for name in codecs)
    gu_blocks, dn_blocks = codec_rows(gu.name, 4, 2 * i, h, rng), codec_rows(dn.name, 4, h, i, rng)
    gate_up = torch.from_numpy(gu.dequantize(gu_blocks, h))
    down = torch.from_numpy(dn.dequantize(dn_blocks, i))
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(20, h, generator=g), torch.rand(20, 2, generator=g)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(20)])
    want = grouped_experts(x, ids, w, gate_up, down)
    blocks = PrefillBlocks(block_m=16, block_n=16)
    got = grouped_moe(
        x, ids, w, torch.from_numpy(gu_blocks), torch.from_numpy(dn_blocks), codecs=codecs, blocks=blocks
    )
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))


def test_refuses_banks_that_do_not_fit() -> None:
    x, ids, weights, gate_up, down = case(3, 2, 4)
    with pytest.raises(ValueError, match="do not fit"):
        grouped_moe(x[:, :-1], ids, weights, gate_up, down)
