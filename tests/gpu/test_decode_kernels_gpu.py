"""The decode-step kernels (slot attention, add + RMSNorm, q/k norm + rotary + cache write) compiled on
CUDA at Qwen3-30B-A3B shapes: against their references, and replayed in CUDA graphs with no host sync."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import pytest
import torch

from freetoken.runtime.config import RopeConfig
from freetoken.runtime.models.kernels.decode_attention import (
    slot_decode_attention,
    slot_decode_attention_reference,
)
from freetoken.runtime.models.kernels.latent_attention import latent_attend_reference, latent_decode_attention
from freetoken.runtime.models.kernels.norm_rope import (
    add_rms_norm,
    add_rms_norm_reference,
    qk_norm_rope_kv_write,
    qk_norm_rope_kv_write_reference,
)
from freetoken.runtime.models.rope import RotaryEmbedding

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
NH, KVH, D, H, CAP, SLOTS = 32, 4, 128, 2048, 4096, 10  # Qwen3-30B-A3B attention
EPS = 1e-6
T = TypeVar("T")


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda", generator=gen(seed)) * scale).bfloat16()


def norm_weight(n: int, seed: int) -> torch.Tensor:
    return (1 + randn(n, seed=seed).float() / 8).bfloat16()


def rows_of(b: int, seed: int, pad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots, lengths) for b rows: distinct slots, lengths in [1, 4000], row 1 padding when b > 1."""
    slots = torch.randperm(SLOTS, device="cuda", generator=gen(seed))[:b].int()
    lengths = torch.randint(1, 4001, (b,), device="cuda", generator=gen(seed + 1)).int()
    lengths[0] = 4000 if b == 1 else 1
    if b > 1 and pad:
        slots[1] = -1
    return slots, lengths


def assert_bf16_close(got: torch.Tensor, want: torch.Tensor, equal_share: float = 0.99) -> None:
    """Mostly bit-equal (rsqrt and fp32 sum order may move an ulp), never more than bf16 noise apart."""
    assert got.dtype == want.dtype == torch.bfloat16
    assert (got == want).float().mean().item() >= equal_share
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=2e-2)


@pytest.mark.parametrize("b", [1, 8])
def test_attention_matches_the_reference(b: int) -> None:
    q = randn(b, NH, D, seed=b)
    k_cache, v_cache = randn(SLOTS, KVH, CAP, D, seed=b + 1), randn(SLOTS, KVH, CAP, D, seed=b + 2)
    slots, lengths = rows_of(b, seed=b + 3)
    if b > 1:
        lengths[2] = CAP
    got = slot_decode_attention(q, k_cache, v_cache, slots, lengths, D**-0.5)
    as_fp32 = (q.float(), k_cache.float(), v_cache.float())
    want = slot_decode_attention_reference(*as_fp32, slots, lengths, D**-0.5)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    if b > 1:
        assert torch.count_nonzero(got[1]) == 0


@pytest.mark.parametrize("window", [None, 128])
def test_gpt_oss_attention_with_sinks_and_window_matches_the_reference(window: int | None) -> None:
    nh, kvh, d = 64, 8, 64  # gpt-oss-20b's heads
    q = randn(8, nh, d, seed=30)
    k_cache, v_cache = randn(SLOTS, kvh, CAP, d, seed=31), randn(SLOTS, kvh, CAP, d, seed=32)
    slots, lengths = rows_of(8, seed=33)
    lengths[3] = 100  # shorter than the window: every key
    sinks = randn(nh, seed=34, scale=2.0).float()
    got = slot_decode_attention(q, k_cache, v_cache, slots, lengths, d**-0.5, sinks, window)
    as_fp32 = (q.float(), k_cache.float(), v_cache.float())
    want = slot_decode_attention_reference(*as_fp32, slots, lengths, d**-0.5, sinks, window)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    assert torch.count_nonzero(got[1]) == 0


def test_add_rms_norm_matches_the_reference() -> None:
    x, residual = randn(8, H, seed=1), randn(8, H, seed=2, scale=8.0)
    weight = norm_weight(H, seed=3)
    normed, summed = add_rms_norm(x, residual, weight, EPS)
    want_normed, want_summed = add_rms_norm_reference(x, residual, weight, EPS)
    assert torch.equal(summed, want_summed)
    assert_bf16_close(normed, want_normed)


def qkv_case(b: int, seed: int) -> tuple[torch.Tensor, ...]:
    """(qkv, q_w, k_w, cos, sin, k_cache, v_cache, slots, positions) at Qwen3-30B shapes."""
    qkv = randn(b, (NH + 2 * KVH) * D, seed=seed, scale=3.0)
    q_w, k_w = norm_weight(D, seed=seed + 1), norm_weight(D, seed=seed + 2)
    slots, _ = rows_of(b, seed=seed + 3)
    positions = torch.randint(0, CAP, (b,), device="cuda", generator=gen(seed + 4)).int()
    cos, sin = RotaryEmbedding(RopeConfig(theta=1e6), D)(positions, torch.bfloat16)
    k_cache, v_cache = randn(SLOTS, KVH, CAP, D, seed=seed + 5), randn(SLOTS, KVH, CAP, D, seed=seed + 6)
    return qkv, q_w, k_w, cos, sin, k_cache, v_cache, slots, positions


def split(qkv: torch.Tensor) -> list[torch.Tensor]:
    """Column views of one projection: q, k, v."""
    return list(qkv.split([NH * D, KVH * D, KVH * D], dim=1))


def test_qk_norm_rope_matches_the_reference() -> None:
    qkv, q_w, k_w, cos, sin, k_cache, v_cache, slots, positions = qkv_case(8, seed=20)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    head = (*split(qkv), q_w, k_w, EPS, cos, sin)
    got = qk_norm_rope_kv_write(*head, k_cache, v_cache, slots, positions)
    want = qk_norm_rope_kv_write_reference(*head, ref_k, ref_v, slots, positions)
    live = slots >= 0
    assert_bf16_close(got[live], want[live])
    assert torch.equal(v_cache, ref_v)
    assert_bf16_close(k_cache, ref_k, equal_share=0.9999)  # all but the new cells are equal anyway


def test_rope_without_norms_matches_the_reference() -> None:
    qkv, _, _, cos, sin, k_cache, v_cache, slots, positions = qkv_case(8, seed=21)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    head = (*split(qkv), None, None, 0.0, cos, sin)
    got = qk_norm_rope_kv_write(*head, k_cache, v_cache, slots, positions)
    want = qk_norm_rope_kv_write_reference(*head, ref_k, ref_v, slots, positions)
    live = slots >= 0
    assert_bf16_close(got[live], want[live])
    assert_bf16_close(k_cache, ref_k, equal_share=0.9999)


def test_latent_rows_write_as_the_reference() -> None:
    from freetoken.runtime.models.kernels.slot_write import slot_write, slot_write_reference

    rows = randn(8, 576, seed=40)  # DeepSeek-V3's [c ; k_pe]
    cache = randn(SLOTS, 1, CAP, 576, seed=41)
    slots, lengths = rows_of(8, seed=42)
    positions = lengths - 1
    want = cache.clone()
    slot_write_reference(rows, want, slots, positions)
    slot_write(rows, cache, slots, positions)
    assert torch.equal(cache, want)


def capture(fn: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            out = fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return graph, out


def test_attention_replays_for_new_lengths_and_slots() -> None:
    b = 8
    q = randn(b, NH, D, seed=30)
    k_cache, v_cache = randn(SLOTS, KVH, CAP, D, seed=31), randn(SLOTS, KVH, CAP, D, seed=32)
    slots, lengths = rows_of(b, seed=33, pad=False)
    graph, out = capture(lambda: slot_decode_attention(q, k_cache, v_cache, slots, lengths, D**-0.5))
    new_slots, new_lengths = rows_of(b, seed=34)  # other slots and lengths, and now a padding row
    slots.copy_(new_slots)
    lengths.copy_(new_lengths)
    q.copy_(randn(b, NH, D, seed=35))
    graph.replay()
    torch.testing.assert_close(out, slot_decode_attention(q, k_cache, v_cache, slots, lengths, D**-0.5))
    as_fp32 = (q.float(), k_cache.float(), v_cache.float())
    want = slot_decode_attention_reference(*as_fp32, slots, lengths, D**-0.5)
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
    assert torch.count_nonzero(out[1]) == 0


@pytest.mark.parametrize("b", [1, 8])
def test_latent_attention_matches_the_reference_and_replays(b: int) -> None:
    """DeepSeek-V3's latent attention (128 heads, rank 512, rope 64) over a 4,096-position slot cache: the
    split kernels against the torch reference in fp32, then replayed in a graph for new rows."""
    nh, rank, rope = 128, 512, 64
    q, cache = randn(b, nh, rank + rope, seed=40 + b), randn(SLOTS, 1, CAP, rank + rope, seed=41, scale=0.5)
    slots, lengths = rows_of(b, seed=42 + b)
    got = latent_decode_attention(q, cache, slots, lengths, 0.07, rank)
    want = latent_attend_reference(q.float(), cache.float(), slots, lengths, 0.07, rank)
    live = slots >= 0
    torch.testing.assert_close(got[live].float(), want[live], rtol=2e-2, atol=2e-2)
    if b > 1:
        assert torch.count_nonzero(got[1]) == 0
    graph, out = capture(lambda: latent_decode_attention(q, cache, slots, lengths, 0.07, rank))
    new_slots, new_lengths = rows_of(b, seed=50 + b)
    slots.copy_(new_slots)
    lengths.copy_(new_lengths)
    graph.replay()
    want = latent_attend_reference(q.float(), cache.float(), slots, lengths, 0.07, rank)
    torch.testing.assert_close(out[slots >= 0].float(), want[slots >= 0], rtol=2e-2, atol=2e-2)


def test_add_rms_norm_replays() -> None:
    x, residual, weight = randn(4, H, seed=40), randn(4, H, seed=41), norm_weight(H, seed=42)
    graph, (normed, summed) = capture(lambda: add_rms_norm(x, residual, weight, EPS))
    x.copy_(randn(4, H, seed=43))
    residual.copy_(randn(4, H, seed=44))
    graph.replay()
    assert torch.equal(normed, add_rms_norm(x, residual, weight, EPS)[0])
    assert torch.equal(summed, x + residual)


def test_qk_norm_rope_replays_for_new_positions_and_slots() -> None:
    qkv, q_w, k_w, cos, sin, k_cache, v_cache, slots, positions = qkv_case(8, seed=50)

    head = (*split(qkv), q_w, k_w, EPS, cos, sin)
    graph, out = capture(lambda: qk_norm_rope_kv_write(*head, k_cache, v_cache, slots, positions))
    new = qkv_case(8, seed=60)  # other activations, positions and slots, written into the same buffers
    for buffer, index in ((qkv, 0), (cos, 3), (sin, 4), (slots, 7), (positions, 8)):
        buffer.copy_(new[index])
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    graph.replay()
    want = qk_norm_rope_kv_write_reference(*head, ref_k, ref_v, slots, positions)
    live = slots >= 0
    assert_bf16_close(out[live], want[live])
    assert torch.equal(v_cache, ref_v)
    assert_bf16_close(k_cache, ref_k, equal_share=0.9999)
