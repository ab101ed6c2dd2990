"""The router kernel (softmax + top-k + renormalisation) against its plain-torch reference under Triton's
interpreter on CPU (the kernel body the GPU compiles; tests/gpu runs it compiled)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from freetoken.runtime.models.kernels.decode_attention import decode_kernels_available
from freetoken.runtime.models.qwen3_moe import SparseMoeBlock
from freetoken.runtime.moe.kernels.router_topk import router_topk, router_topk_reference

pytestmark = pytest.mark.skipif(not decode_kernels_available("cpu"), reason="needs Triton's interpreter")

DTYPES = [torch.float32, torch.bfloat16]


def distinct_logits(t: int, e: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[t, e] logits, each row e distinct values of the grid {k / 64 : -256 <= k < 256} (exact in bf16,
    at least 1/64 apart, so no two probabilities tie, nor come within rounding of each other)."""
    g = torch.Generator().manual_seed(seed)
    grid = torch.stack([torch.randperm(512, generator=g)[:e] for _ in range(t)])
    return ((grid - 256) / 64).to(dtype)


def assert_weights_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: a few ulps (exp and sum order); bf16: one rounding of those, so at most an ulp apart."""
    assert got.dtype == want.dtype
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-7)
    else:
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("e", "k"), [(60, 1), (60, 2), (60, 8), (128, 8), (128, 2)])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("t", [1, 5])
def test_matches_the_reference(dtype: torch.dtype, e: int, k: int, renormalize: bool, t: int) -> None:
    logits = distinct_logits(t, e, dtype, seed=e * 100 + k * 10 + t)
    ids, weights = router_topk(logits, k, renormalize)
    want_ids, want_weights = router_topk_reference(logits, k, renormalize)
    assert ids.shape == weights.shape == (t, k) and ids.dtype == torch.int64
    assert ids.is_contiguous() and weights.is_contiguous()
    assert torch.equal(ids, want_ids)
    assert_weights_close(weights, want_weights)


@pytest.mark.parametrize("renormalize", [True, False])
def test_random_fp32_logits_at_the_largest_decode_shape(renormalize: bool) -> None:
    logits = torch.randn(16, 512, generator=torch.Generator().manual_seed(3)) * 3
    ids, weights = router_topk(logits, 16, renormalize)
    want_ids, want_weights = router_topk_reference(logits, 16, renormalize)
    assert torch.equal(ids, want_ids)
    assert_weights_close(weights, want_weights)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(16))


def test_ties_put_the_lower_expert_first() -> None:
    """torch.topk's order among equal values is unspecified: against it only the sets are compared."""
    logits = torch.tensor([[0.5, 2.0, 1.0, 2.0, 2.0, 1.0, -1.0], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    for dtype in DTYPES:
        ids, weights = router_topk(logits.to(dtype), 4, False)
        assert ids.tolist() == [[1, 3, 4, 2], [0, 1, 2, 3]]
        want_ids, want_weights = router_topk_reference(logits.to(dtype), 4, False)
        assert torch.equal(ids[0, :3].sort().values, want_ids[0, :3].sort().values)
        assert want_ids[0, 3].item() in (2, 5)  # the 4th: one of two tied experts
        assert_weights_close(weights, want_weights)  # tied columns carry equal weights


def test_strided_rows_and_no_rows() -> None:
    wide = distinct_logits(3, 200, torch.bfloat16, seed=5)
    logits = wide[:, 20:80]  # row stride 200, 60 experts
    got = router_topk(logits, 4, True)
    want = router_topk_reference(logits, 4, True)
    assert torch.equal(got[0], want[0])
    assert_weights_close(got[1], want[1])
    ids, weights = router_topk(wide[:0], 4, True)
    assert ids.shape == weights.shape == (0, 4)


def test_k_equal_to_e_is_a_full_sort() -> None:
    logits = distinct_logits(2, 6, torch.float32, seed=6)
    ids, weights = router_topk(logits, 6, False)
    assert torch.equal(ids, logits.argsort(-1, descending=True))
    assert_weights_close(weights, torch.softmax(logits, -1).sort(-1, descending=True).values)


def test_refuses_inputs_that_do_not_fit() -> None:
    logits = distinct_logits(2, 8, torch.float32, seed=7)
    for k in (0, 9):
        with pytest.raises(ValueError, match="top_k"):
            router_topk(logits, k, True)
    with pytest.raises(ValueError, match=r"\[T, E\]"):
        router_topk(logits[None], 2, True)
    with pytest.raises(ValueError, match="fp32, bf16 or fp16"):
        router_topk(logits.double(), 2, True)


@pytest.mark.parametrize("renormalize", [True, False])
def test_the_reference_is_the_model_router(renormalize: bool) -> None:
    gate = torch.nn.Linear(16, 12, bias=False).to(torch.bfloat16)
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(8)).bfloat16()
    block = SimpleNamespace(gate=gate, top_k=3, norm_topk_prob=renormalize, scoring="softmax")
    with torch.no_grad():
        want_ids, want_weights = SparseMoeBlock.route(block, x)  # type: ignore[arg-type]
        ids, weights = router_topk_reference(gate(x), 3, renormalize)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)
