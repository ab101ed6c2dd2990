"""The native CPU attention block against the two torch steps it replaces (q/k norm + rotary + K/V
write, then attention over each row's slot): equal in fp32 up to summation order, within bf16 rounding
on bf16 caches; padding rows write nothing. Head dims 64 and 128 on bf16 caches take the vector paths:
per KV group when there are as many (row, group) tasks as threads, else per head — both are run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from freetoken.runtime.config import RopeConfig
from freetoken.runtime.models.kernels.cpu_attention import cpu_attention_block
from freetoken.runtime.models.kernels.decode_attention import slot_decode_attention_reference
from freetoken.runtime.models.kernels.norm_rope import qk_norm_rope_kv_write_reference
from freetoken.runtime.models.rope import RotaryEmbedding
from freetoken.runtime.moe.kernels.loader import load_library

pytestmark = pytest.mark.skipif(load_library() is None, reason="needs the compiled CPU kernels")
NH, KVH, D, SLOTS, CAP = 8, 2, 32, 3, 40


def layer(dtype: torch.dtype, g: torch.Generator, d: int = D) -> SimpleNamespace:
    norm = SimpleNamespace(eps=1e-6)
    q_norm = SimpleNamespace(weight=(1 + 0.1 * torch.randn(d, generator=g)).to(dtype), eps=norm.eps)
    k_norm = SimpleNamespace(weight=(1 + 0.1 * torch.randn(d, generator=g)).to(dtype), eps=norm.eps)
    return SimpleNamespace(
        head_dim=d,
        num_heads=NH,
        num_kv_heads=KVH,
        q_norm=q_norm,
        k_norm=k_norm,
        qk_norm="head",
        sinks=None,
        window=None,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [D, 64, 128])
@pytest.mark.parametrize("threads", [1, 64])  # 1: per KV group (8 tasks >= 1); 64: per head
@pytest.mark.parametrize("sinks", [False, True])  # gpt-oss's sink logits and a window of 6 keys
def test_native_block_equals_the_torch_steps(
    dtype: torch.dtype, d: int, threads: int, sinks: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)  # what the block passes the kernel
    g = torch.Generator().manual_seed(3)
    attn = layer(dtype, g, d)
    if sinks:
        attn.sinks, attn.window = torch.randn(NH, generator=g).to(dtype), 6
    slots = torch.tensor([2, -1, 0, 1], dtype=torch.int32)  # row 1 pads
    positions = torch.tensor([5, 0, 17, 30], dtype=torch.int32)  # within the window and past it
    qkv = torch.randn(4, (NH + 2 * KVH) * d, generator=g).to(dtype)
    cos, sin = RotaryEmbedding(RopeConfig(), d)(positions, dtype)
    caches = torch.randn(2, SLOTS, KVH, CAP, d, generator=g).to(dtype)
    k_ref, v_ref = caches[0].clone(), caches[1].clone()
    k_nat, v_nat = caches[0].clone(), caches[1].clone()
    nq, nkv = NH * d, KVH * d
    q = qk_norm_rope_kv_write_reference(
        qkv[:, :nq], qkv[:, nq : nq + nkv], qkv[:, nq + nkv :], attn.q_norm.weight, attn.k_norm.weight,
        attn.q_norm.eps, cos, sin, k_ref, v_ref, slots, positions,
    )  # fmt: skip
    want = slot_decode_attention_reference(
        q, k_ref, v_ref, slots, positions + 1, d**-0.5, attn.sinks, attn.window
    )
    got = cpu_attention_block(qkv, attn, cos, sin, k_nat, v_nat, slots, positions)
    assert got is not None and got.dtype == dtype
    live = slots >= 0
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert torch.allclose(got[live].float(), want[live].float(), atol=tol, rtol=tol)
    assert torch.allclose(k_nat.float(), k_ref.float(), atol=tol, rtol=tol)
    assert torch.equal(v_nat, v_ref)  # v is written as given
    untouched = torch.ones(SLOTS, dtype=torch.bool)
    untouched[slots[live].long()] = False
    assert torch.equal(k_nat[untouched], caches[0][untouched])  # the padding row wrote nothing


def test_a_position_past_the_cache_is_an_error() -> None:
    g = torch.Generator().manual_seed(4)
    attn = layer(torch.float32, g)
    positions = torch.tensor([CAP], dtype=torch.int32)
    cos, sin = RotaryEmbedding(RopeConfig(), D)(positions, torch.float32)
    k, v = torch.zeros(SLOTS, KVH, CAP, D), torch.zeros(SLOTS, KVH, CAP, D)
    with pytest.raises(ValueError, match="position past the cache"):
        cpu_attention_block(
            torch.randn(1, (NH + 2 * KVH) * D), attn, cos, sin, k, v, torch.tensor([0]), positions
        )


@pytest.mark.parametrize("norm", ["none", "full", "head"])
@pytest.mark.parametrize("rot", [D, 8])
def test_every_q_k_norm_and_a_partial_rotary(norm: str, rot: int) -> None:
    """No q/k norm (Mixtral), one over the whole projection (OLMoE, MiniMax-M2) or per head (Qwen3,
    GLM-4.5), rope on all dims or the first 8 (GLM-4.5, MiniMax-M2): the torch steps' results, fp32."""
    from freetoken.runtime.models.kernels.norm_rope import rms_norm_reference

    g = torch.Generator().manual_seed(5)
    attn = layer(torch.float32, g)
    attn.qk_norm = norm
    if norm == "full":
        attn.q_norm.weight = 1 + 0.1 * torch.randn(NH * D, generator=g)
        attn.k_norm.weight = 1 + 0.1 * torch.randn(KVH * D, generator=g)
    slots = torch.tensor([1, -1, 2], dtype=torch.int32)
    positions = torch.tensor([3, 0, 9], dtype=torch.int32)
    qkv = torch.randn(3, (NH + 2 * KVH) * D, generator=g)
    cos, sin = RotaryEmbedding(RopeConfig(), rot)(positions, torch.float32)  # [B, rot]
    k_ref, v_ref = torch.zeros(SLOTS, KVH, CAP, D), torch.zeros(SLOTS, KVH, CAP, D)
    k_nat, v_nat = k_ref.clone(), v_ref.clone()
    nq, nkv = NH * D, KVH * D
    q, k, v = qkv[:, :nq], qkv[:, nq : nq + nkv], qkv[:, nq + nkv :]
    if norm == "full":
        q, k = (
            rms_norm_reference(q, attn.q_norm.weight, 1e-6),
            rms_norm_reference(k, attn.k_norm.weight, 1e-6),
        )
    head = norm == "head"
    q = qk_norm_rope_kv_write_reference(
        q, k, v, attn.q_norm.weight if head else None, attn.k_norm.weight if head else None, 1e-6,
        cos, sin, k_ref, v_ref, slots, positions,
    )  # fmt: skip
    want = slot_decode_attention_reference(q, k_ref, v_ref, slots, positions + 1, D**-0.5)
    got = cpu_attention_block(qkv, attn, cos, sin, k_nat, v_nat, slots, positions)
    assert got is not None
    live = slots >= 0
    torch.testing.assert_close(got[live], want[live], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_nat, k_ref, rtol=1e-5, atol=1e-5)
