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
        head_dim=d, num_heads=NH, num_kv_heads=KVH, q_norm=q_norm, k_norm=k_norm, qk_norm="head", plain=True
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [D, 64, 128])
@pytest.mark.parametrize("threads", [1, 64])  # 1: per KV group (8 tasks >= 1); 64: per head
def test_native_block_equals_the_torch_steps(
    dtype: torch.dtype, d: int, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)  # what the block passes the kernel
    g = torch.Generator().manual_seed(3)
    attn = layer(dtype, g, d)
    slots = torch.tensor([2, -1, 0, 1], dtype=torch.int32)  # row 1 pads
    positions = torch.tensor([5, 0, 17, 0], dtype=torch.int32)
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
    want = slot_decode_attention_reference(q, k_ref, v_ref, slots, positions + 1, d**-0.5)
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
