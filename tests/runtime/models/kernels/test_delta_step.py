"""A DeltaNet layer's decode-step kernels against their references — the Triton kernels (Triton's
interpreter runs their bodies on CPU) and the native CPU calls (delta_step_cpu.c) — and the references
against the eager layer."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from freetoken.runtime.models.delta_net import GatedDeltaNet
from freetoken.runtime.models.kda import KimiDeltaAttention
from freetoken.runtime.models.kernels.cpu_delta_step import cpu_conv_step, cpu_delta_step, cpu_kda_step
from freetoken.runtime.models.kernels.delta_step import (
    causal_conv_step,
    causal_conv_step_reference,
    delta_rule_step,
    delta_rule_step_reference,
    delta_step_available,
    kda_rule_step,
    kda_rule_step_reference,
)
from freetoken.runtime.moe.kernels.loader import load_library

HK, HV, DK, DV, W = 2, 4, 8, 12, 4  # DV 12: a partial value block


def randn(*shape: int, seed: int, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def randomised(layer: torch.nn.Module) -> torch.nn.Module:
    """Every parameter drawn from N(0, 0.3²) (the global generator, seeded by the caller)."""
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
    return layer


# rows: slot 2, padding, slot 0
SLOTS = torch.tensor([2, -1, 0], dtype=torch.int32)
LIVE = [0, 2]


TRITON = pytest.mark.skipif(not delta_step_available("cpu"), reason="needs Triton's interpreter")
NATIVE = pytest.mark.skipif(load_library() is None, reason="needs the compiled CPU kernels")
CONV_STEPS = [pytest.param(causal_conv_step, marks=TRITON, id="triton"),
              pytest.param(cpu_conv_step, marks=NATIVE, id="native")]  # fmt: skip
DELTA_STEPS = [pytest.param(delta_rule_step, marks=TRITON, id="triton"),
               pytest.param(cpu_delta_step, marks=NATIVE, id="native")]  # fmt: skip
KDA_STEPS = [pytest.param(kda_rule_step, marks=TRITON, id="triton"),
             pytest.param(cpu_kda_step, marks=NATIVE, id="native")]  # fmt: skip


@pytest.mark.parametrize("step", CONV_STEPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_step_matches_the_reference_and_keeps_other_slots(step: Callable, dtype: torch.dtype) -> None:
    c = 2 * HK * DK + HV * DV
    x = randn(3, c + 5, seed=1, dtype=dtype)[:, :c]  # a strided view, as a projection's split gives
    weight = randn(c, 1, W, seed=2, scale=0.5, dtype=dtype)
    state = randn(3, c, W - 1, seed=3, dtype=dtype)
    want_state = state.clone()
    got = step(x, state, weight, SLOTS)
    want = causal_conv_step_reference(x, want_state, weight, SLOTS)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got[LIVE], want[LIVE], **tol)
    assert torch.equal(state, want_state)  # shifts are copies: exact; slot 1 untouched
    assert torch.equal(state[0, :, -1], x[2]) and torch.equal(state[2, :, -1], x[0])


@pytest.mark.parametrize("step", DELTA_STEPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_delta_rule_step_matches_the_reference(step: Callable, dtype: torch.dtype) -> None:
    mixed = randn(3, 2 * HK * DK + HV * DV, seed=4, dtype=dtype)
    ba = randn(3, 2 * HV, seed=5, dtype=dtype)
    b, a = ba[:, :HV], ba[:, HV:]  # row-strided views
    a_log, dt_bias = randn(HV, seed=6, scale=0.5), randn(HV, seed=7, scale=0.5, dtype=dtype)
    state = randn(3, HV, DK, DV, seed=8)
    want_state = state.clone()
    got = step(mixed, b, a, a_log, dt_bias, state, SLOTS, HK, DK)
    want = delta_rule_step_reference(mixed, b, a, a_log, dt_bias, want_state, SLOTS, HK, DK)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got[LIVE], want[LIVE], **tol)
    torch.testing.assert_close(state, want_state, rtol=1e-5, atol=1e-5)
    assert torch.equal(state[1], randn(3, HV, DK, DV, seed=8)[1])  # no row's slot: untouched
    assert not torch.equal(state[0], randn(3, HV, DK, DV, seed=8)[0])


def test_references_step_as_the_eager_layer() -> None:
    """One new token through the two references leaves the eager layer's output and state."""
    torch.manual_seed(0)
    layer = randomised(GatedDeltaNet(32, HK, HV, DK, DV, W, 1e-6))
    prompt, new = torch.randn(5, 32), torch.randn(1, 32)
    eager = layer.new_state(torch.device("cpu"), torch.float32)
    with torch.no_grad():
        layer(prompt, eager)
        slots = torch.tensor([1], dtype=torch.int32)
        conv = torch.zeros(2, *eager.conv.shape)
        recurrent = torch.zeros(2, *eager.recurrent.shape)
        conv[1], recurrent[1] = eager.conv, eager.recurrent
        want, _ = layer(new, eager)
        qkv, z, b, a = layer.project(new)
        mixed = causal_conv_step_reference(qkv, conv, layer.conv1d.weight, slots)
        o = delta_rule_step_reference(mixed, b, a, layer.A_log, layer.dt_bias, recurrent, slots, HK, DK)
        got = layer.out_proj(layer.norm(o, z.reshape(1, HV, DV)).reshape(1, HV * DV))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(conv[1], eager.conv)
    torch.testing.assert_close(recurrent[1], eager.recurrent, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("step", KDA_STEPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kda_rule_step_matches_the_reference(step: Callable, dtype: torch.dtype) -> None:
    heads, dim = 2, 12
    mixed = randn(3, 3 * heads * dim, seed=9, dtype=dtype)
    b = randn(3, heads + 3, seed=10, dtype=dtype)[:, :heads]  # a row-strided view
    decay = -randn(3, heads, dim, seed=11, scale=0.5).abs()  # log decay <= 0, per key channel
    state = randn(3, heads, dim, dim, seed=12)
    want_state = state.clone()
    got = step(mixed, b, decay, state, SLOTS)
    want = kda_rule_step_reference(mixed, b, decay, want_state, SLOTS)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got[LIVE], want[LIVE], **tol)
    torch.testing.assert_close(state, want_state, rtol=1e-5, atol=1e-5)
    assert torch.equal(state[1], randn(3, heads, dim, dim, seed=12)[1])


def test_kda_references_step_as_the_eager_layer() -> None:
    torch.manual_seed(1)
    layer = randomised(KimiDeltaAttention(32, 2, 8, W, 1e-6))
    prompt, new = torch.randn(5, 32), torch.randn(1, 32)
    eager = layer.new_state(torch.device("cpu"), torch.float32)
    with torch.no_grad():
        layer(prompt, eager)
        slots = torch.tensor([0], dtype=torch.int32)
        conv, recurrent = eager.conv.clone()[None], eager.recurrent.clone()[None]
        want, _ = layer(new, eager)
        qkv = torch.cat((layer.q_proj(new), layer.k_proj(new), layer.v_proj(new)), dim=-1)
        mixed = causal_conv_step_reference(qkv, conv, layer.conv_weight(), slots)
        o = kda_rule_step_reference(mixed, layer.b_proj(new), layer.log_decay(new), recurrent, slots)
        gate = layer.g_b_proj(layer.g_a_proj(new)).view(1, 2, 8)
        got = layer.o_proj(layer.o_norm(o, gate).reshape(1, 16))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(conv[0], eager.conv)
    torch.testing.assert_close(recurrent[0], eager.recurrent, rtol=1e-6, atol=1e-6)
