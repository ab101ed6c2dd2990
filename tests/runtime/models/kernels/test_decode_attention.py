"""Slot decode attention against its plain-torch reference, run by Triton's interpreter on CPU (the same
kernel bodies the GPU compiles; tests/gpu/test_decode_kernels_gpu.py runs them compiled)."""

from __future__ import annotations

import pytest
import torch

from freetoken.runtime.models.kernels.decode_attention import (
    AttentionBlocks,
    choose_splits,
    decode_kernels_available,
    slot_decode_attention,
    slot_decode_attention_reference,
)
from freetoken.runtime.models.layers import decode_attention

pytestmark = pytest.mark.skipif(not decode_kernels_available("cpu"), reason="needs Triton's interpreter")

SMALL = AttentionBlocks(block_n=16)  # several blocks per split, and partial ones
CAP = 48


def case(
    nh: int, kvh: int, d: int, dtype: torch.dtype = torch.float32, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """Four rows: slot 2 with one key, padding, slot 0 with 37 keys (not a block multiple), slot 3 full."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(4, nh, d, generator=g).to(dtype)
    k_cache = torch.randn(4, kvh, CAP, d, generator=g).to(dtype)
    v_cache = torch.randn(4, kvh, CAP, d, generator=g).to(dtype)
    slots = torch.tensor([2, -1, 0, 3], dtype=torch.int32)
    lengths = torch.tensor([1, 10**6, 37, CAP], dtype=torch.int32)  # a padding row's length is never read
    return q, k_cache, v_cache, slots, lengths


@pytest.mark.parametrize(("nh", "kvh", "d", "splits"), [(4, 4, 32, None), (8, 2, 24, 3), (8, 2, 32, 1)])
def test_matches_the_reference_in_fp32(nh: int, kvh: int, d: int, splits: int | None) -> None:
    q, k_cache, v_cache, slots, lengths = case(nh, kvh, d, seed=nh + d)
    q[1] = float("nan")  # the padding row's query is not read either
    got = slot_decode_attention(q, k_cache, v_cache, slots, lengths, d**-0.5, splits=splits, blocks=SMALL)
    want = slot_decode_attention_reference(q, k_cache, v_cache, slots, lengths, d**-0.5)
    assert got.shape == (4, nh * d) and got.dtype == q.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(got[1]) == 0


def test_bf16_within_bf16_tolerance() -> None:
    q, k_cache, v_cache, slots, lengths = case(8, 2, 32, torch.bfloat16, seed=3)
    got = slot_decode_attention(q, k_cache, v_cache, slots, lengths, 32**-0.5, splits=2, blocks=SMALL)
    assert got.dtype == torch.bfloat16
    as_fp32 = (q.float(), k_cache.float(), v_cache.float())
    want = slot_decode_attention_reference(*as_fp32, slots, lengths, 32**-0.5)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    assert torch.count_nonzero(got[1]) == 0


def test_lengths_past_the_capacity_are_clamped_to_it() -> None:
    q, k_cache, v_cache, slots, lengths = case(4, 4, 32, seed=6)
    past = lengths[2:] + 50  # 87 and CAP + 50 keys of a CAP-key slot: both read the whole slot only
    got = slot_decode_attention(q[2:], k_cache, v_cache, slots[2:], past, 1.0, blocks=SMALL)
    full = torch.full((2,), CAP, dtype=torch.int32)
    want = slot_decode_attention_reference(q[2:], k_cache, v_cache, slots[2:], full, 1.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_reference_is_the_model_decode_attention() -> None:
    q, k_cache, v_cache, slots, lengths = case(8, 2, 32, torch.bfloat16, seed=4)
    want = slot_decode_attention_reference(q, k_cache, v_cache, slots, lengths, 32**-0.5)
    k, v = k_cache[0, :, :37], v_cache[0, :, :37]
    assert torch.equal(want[2:3], decode_attention(q[2][:, None], k, v, 32**-0.5))


def test_split_count_comes_from_shapes_only() -> None:
    blocks = AttentionBlocks()
    assert choose_splits(1, 4, 4096, blocks) == 32  # batch 1: 128 programs
    assert choose_splits(8, 4, 4096, blocks) == 16
    assert choose_splits(64, 4, 4096, blocks) == 2
    assert choose_splits(1, 4, 100, blocks) == 2  # never more splits than blocks of keys


def test_refuses_inputs_that_do_not_fit() -> None:
    q, k_cache, v_cache, slots, lengths = case(4, 4, 32)
    with pytest.raises(ValueError, match="int32"):
        slot_decode_attention(q, k_cache, v_cache, slots.long(), lengths, 1.0)
    with pytest.raises(ValueError, match="do not fit"):
        slot_decode_attention(q, k_cache, v_cache[:, :, :10], slots, lengths, 1.0)
    with pytest.raises(ValueError, match="group"):
        slot_decode_attention(q[:, :3], k_cache, v_cache, slots, lengths, 1.0)


@pytest.mark.parametrize(
    ("window", "sinks", "splits"), [(None, True, 2), (9, False, 3), (20, True, None), (1, True, 2)]
)
def test_sinks_and_windows_match_the_reference(window: int | None, sinks: bool, splits: int | None) -> None:
    q, k_cache, v_cache, slots, lengths = case(8, 2, 32, seed=11)
    sink = 2.0 * torch.randn(8, generator=torch.Generator().manual_seed(1)) if sinks else None
    args = (q, k_cache, v_cache, slots, lengths, 32**-0.5, sink, window)
    got = slot_decode_attention(*args, splits=splits, blocks=SMALL)
    want = slot_decode_attention_reference(*args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(got[1]) == 0  # padding: still zeros
    plain = slot_decode_attention_reference(q, k_cache, v_cache, slots, lengths, 32**-0.5)
    assert not torch.allclose(want[2], plain[2])  # the sinks or the window did change the 37-key row


def test_the_sink_reference_is_the_model_sink_window_attention() -> None:
    from freetoken.runtime.models.layers import sink_window_attention

    q, k_cache, v_cache, slots, lengths = case(8, 2, 32, seed=12)
    sink = torch.randn(8, generator=torch.Generator().manual_seed(2))
    want = slot_decode_attention_reference(q, k_cache, v_cache, slots, lengths, 32**-0.5, sink, 7)
    k, v = k_cache[0, :, :37], v_cache[0, :, :37]
    eager = sink_window_attention(q[2][:, None], k, v, 32**-0.5, sink, 7)
    torch.testing.assert_close(want[2:3], eager, rtol=1e-6, atol=1e-6)
