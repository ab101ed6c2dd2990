"""The grouped MoE prefill kernels compiled on CUDA: against the fp32 reference, bf16 and fp32 banks, banks
of codec blocks, the shapes of a real model's layer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from codec_banks import SCALES
from freetoken.codecs import get_codec
from freetoken.runtime.moe.expert_fn import ExpertFn, PairBias
from freetoken.runtime.moe.experts import grouped_experts
from freetoken.runtime.moe.kernels.moe_prefill import grouped_moe

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
H, INTER, SLOTS, K = 2048, 768, 64, 8  # Qwen3-30B-A3B expert shapes, half the experts


def routing(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.rand(t, SLOTS, device="cuda", generator=g).argsort(dim=1)[:, :K]
    ids[0, 3] = -1
    return ids, torch.rand(t, K, device="cuda", generator=g)


@pytest.mark.parametrize("t", [17, 200, 1500])
def test_bf16_banks_match_the_fp32_reference(t: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(t)
    x = torch.randn(t, H, device="cuda", generator=g).bfloat16()
    gate_up = (torch.randn(SLOTS, 2 * INTER, H, device="cuda", generator=g) / H**0.5).bfloat16()
    down = (torch.randn(SLOTS, H, INTER, device="cuda", generator=g) / INTER**0.5).bfloat16()
    ids, w = routing(t, t)
    got = grouped_moe(x, ids, w, gate_up, down)
    ref = grouped_experts(x.float(), ids, w, gate_up.float(), down.float())
    assert float((got.float() - ref).norm() / ref.norm()) < 1e-2


def test_fp32_banks_multiply_in_ieee_fp32() -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(40, 96, device="cuda", generator=g)
    gate_up = torch.randn(6, 2 * 80, 96, device="cuda", generator=g) / 96**0.5
    down = torch.randn(6, 96, 80, device="cuda", generator=g) / 80**0.5
    ids = torch.rand(40, 6, device="cuda", generator=g).argsort(dim=1)[:, :3]
    w = torch.rand(40, 3, device="cuda", generator=g)
    fn = ExpertFn("clamped", limit=0.5)
    bias = PairBias(
        torch.randn(9, 160, device="cuda", generator=g) * 0.3, torch.randint(0, 9, (40, 3), device="cuda")
    )
    got = grouped_moe(x, ids, w, gate_up, down, fn, bias)
    torch.testing.assert_close(got, grouped_experts(x, ids, w, gate_up, down, fn, bias), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("codec", list(SCALES))
def test_codec_banks_match_their_dequantised_weights(codec: str) -> None:
    c, rng = get_codec(codec), np.random.default_rng(0)
    scale = SCALES[codec]
    slots = 16
    gu = c.random_blocks(np.empty((slots, 2 * INTER, c.row_bytes(H)), np.uint8), rng, scale)
    dn = c.random_blocks(np.empty((slots, H, c.row_bytes(INTER)), np.uint8), rng, scale)
    gate_up, down = (
        torch.from_numpy(c.dequantize(gu, H)).cuda(),
        torch.from_numpy(c.dequantize(dn, INTER)).cuda(),
    )
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(300, H, device="cuda", generator=g)
    ids = torch.rand(300, slots, device="cuda", generator=g).argsort(dim=1)[:, :4]
    w = torch.rand(300, 4, device="cuda", generator=g)
    want = grouped_experts(x, ids, w, gate_up, down)
    got = grouped_moe(
        x, ids, w, torch.from_numpy(gu).cuda(), torch.from_numpy(dn).cuda(), codecs=(codec, codec)
    )
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4 * float(want.abs().max()))
    got_bf16 = grouped_moe(
        x.bfloat16(), ids, w, torch.from_numpy(gu).cuda(), torch.from_numpy(dn).cuda(), codecs=(codec, codec)
    )
    assert float((got_bf16.float() - want).norm() / want.norm()) < 1e-2
