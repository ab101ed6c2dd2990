"""The decode step's norm and rotary kernels against their plain-torch references under Triton's
interpreter (which runs the same kernel bodies on CPU; bf16 rounding there is done on the bits)."""

from __future__ import annotations

import pytest
import torch

from freetoken.runtime.config import RopeConfig
from freetoken.runtime.models.kernels.decode_attention import decode_kernels_available
from freetoken.runtime.models.kernels.norm_rope import (
    add_rms_norm,
    add_rms_norm_reference,
    qk_norm_rope_kv_write,
    qk_norm_rope_kv_write_reference,
    rms_norm_reference,
)
from freetoken.runtime.models.layers import RMSNorm
from freetoken.runtime.models.rope import RotaryEmbedding

pytestmark = pytest.mark.skipif(not decode_kernels_available("cpu"), reason="needs Triton's interpreter")

EPS = 1e-6
DTYPES = [torch.float32, torch.bfloat16]


def rows(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def assert_exact_or_near(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16: equal (the interpreter rounds where torch does); fp32: within a few ulps (sum order)."""
    if got.dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_matches_the_reference(dtype: torch.dtype, with_residual: bool) -> None:
    x = rows(3, 72, dtype=dtype, seed=1)  # 72: a partial block of 128
    residual = rows(3, 72, dtype=dtype, seed=2, scale=4.0) if with_residual else None
    weight = (1 + rows(72, dtype=torch.float32, seed=3, scale=0.1)).to(dtype)
    normed, summed = add_rms_norm(x, residual, weight, EPS)
    want_normed, want_summed = add_rms_norm_reference(x, residual, weight, EPS)
    assert torch.equal(summed, want_summed)  # one rounding of an fp32 sum, as torch's add
    if residual is None:
        assert summed is x
    assert_exact_or_near(normed, want_normed)


def test_add_rms_norm_reference_is_the_model_rmsnorm() -> None:
    x, residual = rows(3, 64, dtype=torch.bfloat16, seed=4), rows(3, 64, dtype=torch.bfloat16, seed=5)
    norm = RMSNorm(64, EPS).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(1 + torch.rand(64) / 4)
        normed, _ = add_rms_norm_reference(x, residual, norm.weight, EPS)
        assert torch.equal(normed, norm(x + residual))


def qkv_case(
    dtype: torch.dtype, nh: int = 4, kvh: int = 2, d: int = 24, seed: int = 0
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """(kernel arguments with the caches, the same with cache copies). q, k, v are column views of one
    projection; rows: slot 1 at 0, padding, slot 0 at 9 (the last position), slot 2 at 5."""
    b, slots_n, cap = 4, 3, 10
    qkv = rows(b, (nh + 2 * kvh) * d, dtype=dtype, seed=seed, scale=2.0)
    q, k, v = qkv.split([nh * d, kvh * d, kvh * d], dim=1)
    q_w = (1 + rows(d, dtype=torch.float32, seed=seed + 1, scale=0.2)).to(dtype)
    k_w = (1 + rows(d, dtype=torch.float32, seed=seed + 2, scale=0.2)).to(dtype)
    positions = torch.tensor([0, 3, 9, 5], dtype=torch.int32)
    slots = torch.tensor([1, -1, 0, 2], dtype=torch.int32)
    cos, sin = RotaryEmbedding(RopeConfig(theta=1e4), d)(positions, dtype)
    k_cache = rows(slots_n, kvh, cap, d, dtype=dtype, seed=seed + 3)
    v_cache = rows(slots_n, kvh, cap, d, dtype=dtype, seed=seed + 4)
    head = (q, k, v, q_w, k_w, EPS, cos, sin)
    tail = (slots, positions)
    return (*head, k_cache, v_cache, *tail), (*head, k_cache.clone(), v_cache.clone(), *tail)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_matches_the_reference_and_writes_only_its_cells(dtype: torch.dtype) -> None:
    args, ref_args = qkv_case(dtype, seed=7)
    k_cache, v_cache = args[8], args[9]
    before_k, before_v = k_cache.clone(), v_cache.clone()
    q_out = qk_norm_rope_kv_write(*args)
    want_q = qk_norm_rope_kv_write_reference(*ref_args)
    want_k, want_v = ref_args[8], ref_args[9]
    assert q_out.shape == (4, 4, 24) and q_out.is_contiguous()
    live = [0, 2, 3]  # row 1 is padding: its q is anything, its k and v land nowhere
    assert_exact_or_near(q_out[live], want_q[live])
    assert_exact_or_near(k_cache, want_k)
    assert torch.equal(v_cache, want_v)  # v is copied raw
    written = torch.zeros(k_cache.shape[:3], dtype=torch.bool)
    written[[1, 0, 2], :, [0, 9, 5]] = True
    assert torch.equal(k_cache[~written], before_k[~written])  # every other cell untouched
    assert torch.equal(v_cache[~written], before_v[~written])
    assert not torch.equal(k_cache[written], before_k[written])


def test_qk_norm_rope_with_equal_heads_and_a_contiguous_q() -> None:
    args, ref_args = qkv_case(torch.bfloat16, nh=2, kvh=2, d=32, seed=11)
    q = args[0].contiguous()
    got = qk_norm_rope_kv_write(q, *args[1:])
    want = qk_norm_rope_kv_write_reference(*ref_args)
    assert torch.equal(got[[0, 2, 3]], want[[0, 2, 3]])
    assert torch.equal(args[8], ref_args[8])


def test_a_position_outside_the_cache_writes_nothing() -> None:
    args, _ = qkv_case(torch.float32, seed=13)
    k_cache, v_cache = args[8], args[9]
    before_k, before_v = k_cache.clone(), v_cache.clone()
    positions = torch.tensor([10, -1, 10**6, 2**31 - 1], dtype=torch.int32)  # CAP is 10
    qk_norm_rope_kv_write(*args[:11], positions)
    assert torch.equal(k_cache, before_k) and torch.equal(v_cache, before_v)


def test_refuses_inputs_that_do_not_fit() -> None:
    args, _ = qkv_case(torch.float32)
    with pytest.raises(ValueError, match="int32"):
        qk_norm_rope_kv_write(*args[:10], args[10].long(), args[11])
    with pytest.raises(ValueError, match="one dtype"):
        qk_norm_rope_kv_write(*args[:6], args[6].double(), *args[7:])
    with pytest.raises(ValueError, match="heads"):
        qk_norm_rope_kv_write(args[0][:, :-1], *args[1:])
    x = rows(2, 8, dtype=torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match="does not fit"):
        add_rms_norm(x, None, torch.ones(8), EPS)  # an fp32 weight for bf16 activations


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_without_q_k_norms_matches_the_reference(dtype: torch.dtype) -> None:
    from freetoken.runtime.models.rope import apply_rotary

    args, ref_args = (list(a) for a in qkv_case(dtype, seed=17))
    args[3:5] = ref_args[3:5] = [None, None]  # gpt-oss, Mixtral: no q/k norm
    q_out = qk_norm_rope_kv_write(*args)
    want_q = qk_norm_rope_kv_write_reference(*ref_args)
    live = [0, 2, 3]
    assert_exact_or_near(q_out[live], want_q[live])
    assert_exact_or_near(args[8], ref_args[8])
    q, cos, sin = args[0], args[6], args[7]
    plain = apply_rotary(q.reshape(4, 4, 24).transpose(0, 1), cos, sin).transpose(0, 1)  # rope alone
    assert torch.equal(want_q[live], plain[live])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_centred", [False, True])
def test_partial_rotary_and_zero_centred_norms_match_the_reference(
    dtype: torch.dtype, zero_centred: bool
) -> None:
    """Rope on the first 8 of 24 dims (GLM-4.5, MiniMax-M2, Qwen3.5's gated attention), the other 16 normed
    and passed through; Qwen3.5's zero-centred q/k norm weights; q heads strided as Qwen3.5's query
    projection lays them out (each head's query, then its gate)."""
    args, ref_args = (list(a) for a in qkv_case(dtype, seed=19))
    positions = args[11]
    cos, sin = RotaryEmbedding(RopeConfig(theta=1e4), 8)(positions, dtype)  # [B, 8]
    args[6:8] = ref_args[6:8] = [cos, sin]
    gated = rows(4, 4, 48, dtype=dtype, seed=23, scale=2.0)  # [B, NH, query | gate]
    args[0], ref_args[0] = gated[:, :, :24], gated[:, :, :24].reshape(4, 96)
    q_out = qk_norm_rope_kv_write(*args, zero_centred=zero_centred)
    want_q = qk_norm_rope_kv_write_reference(*ref_args, zero_centred=zero_centred)
    live = [0, 2, 3]
    assert_exact_or_near(q_out[live], want_q[live])
    assert_exact_or_near(args[8], ref_args[8])
    assert torch.equal(args[9], ref_args[9])
    if not zero_centred:  # the dims past the rotary ones are the normed values themselves
        normed = rms_norm_reference(ref_args[0].reshape(4, 4, 24), ref_args[3], EPS)
        assert torch.equal(want_q[live][..., 8:], normed[live][..., 8:])


def test_zero_centred_reference_is_the_model_norm() -> None:
    from freetoken.runtime.models.kernels.norm_rope import zero_centred_rms_norm_reference
    from freetoken.runtime.models.qwen3_5_moe import ZeroCenteredRMSNorm

    x = rows(3, 4, 16, dtype=torch.bfloat16, seed=29)
    norm = ZeroCenteredRMSNorm(16, EPS).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(16) / 4)
        assert torch.equal(zero_centred_rms_norm_reference(x, norm.weight, EPS), norm(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_centred_add_rms_norm_matches_the_reference(dtype: torch.dtype) -> None:
    x, residual = rows(3, 72, dtype=dtype, seed=31), rows(3, 72, dtype=dtype, seed=32, scale=4.0)
    weight = rows(72, dtype=dtype, seed=33, scale=0.1)
    normed, summed = add_rms_norm(x, residual, weight, EPS, zero_centred=True)
    want_normed, want_summed = add_rms_norm_reference(x, residual, weight, EPS, zero_centred=True)
    assert torch.equal(summed, want_summed)
    assert_exact_or_near(normed, want_normed)
    plain, _ = add_rms_norm_reference(x, residual, weight, EPS)
    assert not torch.allclose(plain, want_normed)  # the zero-centred weight is not the plain one
