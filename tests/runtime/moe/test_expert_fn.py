"""The experts' functions (SiLU, gpt-oss's clamped SwiGLU, DeepSeek-V4's clamped SiLU) and their biases
on every expert path: the torch reference written out by hand, the CPU C kernel over bf16/f32/Q8_0 banks,
the Triton decode kernel (by Triton's interpreter), the pool's layout change, and the down bias added once
per pair. The cases' gate and up values pass the limit 0.5 often (their spread is about 1)."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from freetoken.codecs import get_codec
from freetoken.formats.tensor_names import ExpertTensor
from freetoken.runtime.moe.expert_fn import ACTIVATION_KINDS, SILU, ExpertFn, PairBias, down_bias_sum
from freetoken.runtime.moe.experts import gathered_experts, grouped_experts
from freetoken.runtime.moe.kernels.cpu_experts import cpu_experts, kernel_available
from freetoken.runtime.moe.pool import HostExpertPool, to_pool_layout

CLAMPED = ExpertFn("clamped", alpha=1.702, limit=0.5)
CLAMPED_SILU = ExpertFn("clamped_silu", limit=0.5)
FNS = {"silu": SILU, "clamped": CLAMPED, "clamped_silu": CLAMPED_SILU}


def case(t: int = 5, k: int = 3, e: int = 6, h: int = 64, i: int = 32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    ids[1, 0] = -1  # a pair another branch computes
    weights = torch.rand(t, k, generator=g)
    gate_up = torch.randn(e, 2 * i, h, generator=g) * 0.1
    down = torch.randn(e, h, i, generator=g) * 0.1
    bias = torch.randn(e, 2 * i, generator=g) * 0.5
    return x, ids, weights, gate_up, down, bias


def by_hand(x, ids, weights, gate_up, down, bias, fn):
    """Pair by pair, each kind's formula written out (transformers' GptOssExperts._apply_gate for
    "clamped", DeepseekV4Experts._apply_gate for "clamped_silu")."""
    i = down.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e < 0:
                continue
            h = gate_up[e] @ x[t] + (bias[e] if bias is not None else 0)
            g, u = h[:i], h[i:]
            if fn.kind == "clamped":
                g, u = g.clamp(max=fn.limit), u.clamp(-fn.limit, fn.limit)
                a = g * torch.sigmoid(fn.alpha * g) * (u + 1)
            elif fn.kind == "clamped_silu":
                g, u = g.clamp(max=fn.limit), u.clamp(-fn.limit, fn.limit)
                a = torch.nn.functional.silu(g) * u
            else:
                a = torch.nn.functional.silu(g) * u
            out[t] += weights[t, k] * (down[e] @ a)
    return out


@pytest.mark.parametrize("fn", FNS.values(), ids=FNS.keys())
@pytest.mark.parametrize("biased", [False, True])
def test_torch_paths_match_the_formula(fn: ExpertFn, biased: bool) -> None:
    x, ids, weights, gate_up, down, bias = case()
    b = bias if biased else None
    want = by_hand(x, ids, weights, gate_up, down, b, fn)
    pair = PairBias(bias, ids) if biased else None
    for path in (grouped_experts, gathered_experts):
        got = path(x, ids, weights, gate_up, down, fn, pair)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if fn.kind != "silu":  # the clamp is reached: without it the answer differs
        assert not torch.allclose(by_hand(x, ids, weights, gate_up, down, b, replace(fn, limit=1e9)), want)


def test_the_kernels_number_the_kinds_as_python_does() -> None:
    """expert_fn.h's enum: FT_ACT_<KIND> = its index in ACTIVATION_KINDS, for every kind."""
    header = Path(__file__).parents[3] / "src/freetoken/runtime/moe/kernels/expert_fn.h"
    enum = dict(re.findall(r"FT_ACT_(\w+) = (\d+)", header.read_text()))
    assert {name.lower(): int(code) for name, code in enum.items()} == {
        kind: ExpertFn(kind).code for kind in ACTIVATION_KINDS
    }


def test_bias_follows_expert_ids_while_weights_come_from_slots() -> None:
    """Slots hold experts in another order: the weights are read by slot, the bias by expert id."""
    x, ids, weights, gate_up, down, bias = case(seed=1)
    order = torch.tensor([3, 5, 0, 1, 4, 2])  # slot s holds expert order[s]
    slot_of = torch.argsort(order)
    slots = torch.where(ids >= 0, slot_of[ids.clamp(min=0)], -1)
    want = by_hand(x, ids, weights, gate_up, down, bias, CLAMPED)
    got = grouped_experts(x, slots, weights, gate_up[order], down[order], CLAMPED, PairBias(bias, ids))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not kernel_available(), reason="no C compiler")
@pytest.mark.parametrize("fn", [CLAMPED, CLAMPED_SILU], ids=["clamped", "clamped_silu"])
@pytest.mark.parametrize("bank", ["f32", "bf16", "Q8_0"])
@pytest.mark.parametrize("tokens", [1, 5])
def test_cpu_kernel_takes_the_function_and_biases(fn: ExpertFn, bank: str, tokens: int) -> None:
    x, ids, weights, gate_up, down, bias = case(t=max(tokens, 2), seed=2)
    x, ids, weights = x[:tokens], ids[:tokens], weights[:tokens]
    if bank == "Q8_0":
        codec = get_codec("Q8_0")
        gu = torch.from_numpy(codec.quantize(gate_up.numpy()))
        dn = torch.from_numpy(codec.quantize(down.numpy()))
        gate_up = torch.from_numpy(codec.dequantize(gu.numpy(), gate_up.shape[-1]))
        down = torch.from_numpy(codec.dequantize(dn.numpy(), down.shape[-1]))
        codecs, tol = ("Q8_0", "Q8_0"), 1e-3
    else:
        dtype = torch.float32 if bank == "f32" else torch.bfloat16
        gu, dn = gate_up.to(dtype), down.to(dtype)
        gate_up, down = gu.float(), dn.float()
        codecs, tol = (bank, bank), 1e-3
    want = by_hand(x, ids, weights, gate_up, down, bias, fn)
    got = cpu_experts(x, ids, weights, gu, dn, 2, codecs=codecs, fn=fn, gate_up_bias=bias)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    plain = cpu_experts(
        x, ids, weights, gu, dn, 2, codecs=codecs, use_kernel=False, fn=fn, gate_up_bias=bias
    )  # computes in the banks' dtype
    loose = 3e-2 if bank == "bf16" else tol
    torch.testing.assert_close(plain, want, rtol=loose, atol=loose)


@pytest.mark.parametrize("fn", FNS.values(), ids=FNS.keys())
def test_triton_decode_kernel_takes_the_function_and_biases(fn: ExpertFn) -> None:
    from freetoken.runtime.moe.kernels.moe_decode import DecodeBlocks, fused_moe_decode, triton_available

    if not triton_available():
        pytest.skip("triton is not installed")
    x, ids, weights, gate_up, down, bias = case(t=3, seed=4)
    blocks = DecodeBlocks(gate_up_n=16, gate_up_k=32, down_n=16, down_k=32)
    want = by_hand(x, ids, weights, gate_up, down, bias, fn)
    got = fused_moe_decode(x, ids, weights, gate_up, down, blocks, fn=fn, bias=PairBias(bias, ids))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_down_bias_is_weighted_once_per_pair() -> None:
    g = torch.Generator().manual_seed(5)
    down_bias = torch.randn(6, 8, generator=g)
    ids = torch.tensor([[0, 3], [-1, 5]])
    w = torch.tensor([[0.25, 0.75], [0.5, 0.5]])
    want = torch.stack([0.25 * down_bias[0] + 0.75 * down_bias[3], 0.5 * down_bias[5]])
    torch.testing.assert_close(down_bias_sum(down_bias, ids, w), want)


def test_pool_takes_gpt_oss_layout_and_biases() -> None:
    """[E, H, 2I] with gate/up columns alternating -> [E, 2I, H] gate rows first; [E, I, H] -> [E, H, I]."""
    e, h, i = 3, 8, 4
    g = torch.Generator().manual_seed(6)
    gate, up = torch.randn(e, i, h, generator=g), torch.randn(e, i, h, generator=g)
    down = torch.randn(e, h, i, generator=g)
    gate_b, up_b, down_b = torch.randn(e, i, generator=g), torch.randn(e, i, generator=g), torch.randn(e, h)
    hf_gate_up = torch.stack((gate, up), dim=2).reshape(e, 2 * i, h).transpose(1, 2)  # [E, H, 2I] alternating
    hf_bias = torch.stack((gate_b, up_b), dim=2).reshape(e, 2 * i)
    pool = HostExpertPool.allocate((0,), e, h, i, torch.float32, huge_pages=False, biased=True)
    assert sorted(pool.missing())[:1] and pool.biased
    layout = "interleaved_in_out"
    pool.write(ExpertTensor(0, None, "gate_up", layout), "gate_up_proj", hf_gate_up)
    pool.write(ExpertTensor(0, None, "down", layout), "down_proj", down.transpose(1, 2))
    pool.write(ExpertTensor(0, None, "gate_up_bias", layout), "gate_up_proj_bias", hf_bias)
    pool.write(ExpertTensor(0, None, "down_bias", layout), "down_proj_bias", down_b)
    assert pool.missing() == []
    torch.testing.assert_close(pool.gate_up[0], torch.cat((gate, up), dim=1))
    torch.testing.assert_close(pool.down[0], down)
    torch.testing.assert_close(pool.gate_up_bias[0], torch.cat((gate_b, up_b), dim=1))
    torch.testing.assert_close(pool.down_bias[0], down_b)
    assert to_pool_layout(ExpertTensor(0, None, "down"), np.zeros(2)) is not None  # rows: unchanged


def test_biases_into_a_pool_without_them_name_the_tensor() -> None:
    from freetoken.errors import FreeTokenError

    pool = HostExpertPool.allocate((0,), 2, 8, 4, torch.float32, huge_pages=False)
    with pytest.raises(FreeTokenError, match=r"down_proj_bias.*no biases"):
        pool.write(ExpertTensor(0, None, "down_bias"), "down_proj_bias", torch.zeros(2, 8))
