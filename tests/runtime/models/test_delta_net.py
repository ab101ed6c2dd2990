"""Our gated DeltaNet layer equals transformers' Qwen3.5-MoE one (its pure-torch path), in one pass and
when the sequence is fed in pieces through the carried conv and recurrent state."""

from __future__ import annotations

import pytest
import torch

from freetoken.runtime.models.delta_net import GatedDeltaNet
from oracle import rel_err

SHAPE = dict(
    hidden_size=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
)


@pytest.fixture(scope="module")
def layers() -> tuple[torch.nn.Module, GatedDeltaNet]:
    transformers = pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
    from transformers import Qwen3_5MoeTextConfig

    cfg = Qwen3_5MoeTextConfig(num_hidden_layers=1, layer_types=["linear_attention"], **SHAPE)
    torch.manual_seed(0)
    theirs = transformers.Qwen3_5MoeGatedDeltaNet(cfg, 0).eval()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if name not in ("A_log", "dt_bias"):
                p.copy_(0.3 * torch.randn(p.shape))
        theirs.dt_bias.copy_(0.5 * torch.randn(4))
    ours = GatedDeltaNet(32, 2, 4, 8, 8, 4, 1e-6)
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours.eval()


@pytest.mark.parametrize("pieces", [[11], [5, 1, 1, 1, 1, 1, 1], [3, 4, 4], [1] * 11])
def test_pieces_through_the_state_equal_one_reference_pass(
    layers: tuple[torch.nn.Module, GatedDeltaNet], pieces: list[int]
) -> None:
    theirs, ours = layers
    x = torch.randn(11, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = theirs(x[None])[0]
        state = ours.new_state(x.device, x.dtype)
        got, start = [], 0
        for n in pieces:
            got.append(ours(x[start : start + n], state)[0])
            start += n
    assert rel_err(torch.cat(got), want) < 1e-5


def test_state_is_what_resuming_needs(layers: tuple[torch.nn.Module, GatedDeltaNet]) -> None:
    """A copy of the state taken mid-sequence resumes exactly: what an anchor checkpoint relies on."""
    _, ours = layers
    x = torch.randn(12, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        state = ours.new_state(x.device, x.dtype)
        ours(x[:7], state)
        snapshot = state.clone()
        tail = ours(x[7:], state)[0]
        resumed = ours(x[7:], snapshot)[0]
    assert torch.equal(tail, resumed)
    assert snapshot.nbytes == (2 * 16 + 32) * 3 * 4 + 4 * 8 * 8 * 4


def test_states_captured_inside_one_pass_equal_states_between_passes(
    layers: tuple[torch.nn.Module, GatedDeltaNet],
) -> None:
    """Checkpoints taken mid-pass (prefill is not split at anchors) are the states two passes leave."""
    _, ours = layers
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        one = ours.new_state(x.device, x.dtype)
        out, captured = ours(x, one, (2, 9, 31))
        split = ours.new_state(x.device, x.dtype)
        parts = []
        for a, b in ((0, 2), (2, 9), (9, 31), (31, 40)):
            parts.append(ours(x[a:b], split)[0])
            if b < 40:
                want = split.clone()
                got = captured.pop(0)
                assert rel_err(got.conv, want.conv) < 1e-6 and rel_err(got.recurrent, want.recurrent) < 1e-6
    assert rel_err(out, torch.cat(parts)) < 1e-6 and rel_err(one.recurrent, split.recurrent) < 1e-6


@pytest.mark.parametrize(("length", "chunk"), [(1, 64), (7, 64), (64, 64), (150, 64), (150, 16)])
def test_chunked_rule_equals_the_recurrence(length: int, chunk: int) -> None:
    from freetoken.runtime.models.delta_net import _l2norm, chunked_delta_rule, delta_rule

    gen = torch.Generator().manual_seed(length)
    hv, dk, dv = 4, 8, 6
    q = _l2norm(torch.randn(length, hv, dk, generator=gen)) * dk**-0.5
    k = _l2norm(torch.randn(length, hv, dk, generator=gen))
    v = torch.randn(length, hv, dv, generator=gen)
    g = -torch.rand(length, hv, generator=gen)  # log decays <= 0
    beta = torch.rand(length, hv, generator=gen)
    start = torch.randn(hv, dk, dv, generator=gen)
    s1, s2 = start.clone(), start.clone()
    want = delta_rule(q, k, v, g, beta, s1)
    got = chunked_delta_rule(q, k, v, g, beta, s2, chunk=chunk)
    assert rel_err(got, want) < 1e-5 and rel_err(s2, s1) < 1e-5
