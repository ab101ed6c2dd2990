"""The router kernel (softmax + top-k + renormalisation) against its plain-torch reference under Triton's
interpreter on CPU (the kernel body the GPU compiles; tests/gpu runs it compiled)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from freetoken.runtime.models.kernels.decode_attention import decode_kernels_available
from freetoken.runtime.models.qwen3_moe import SparseMoeBlock
from freetoken.runtime.moe.kernels.router_topk import (
    RouterRule,
    choose_experts,
    choose_experts_reference,
    router_topk,
    router_topk_reference,
)

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


def test_the_model_routers_follow_their_rule() -> None:
    """A block's route is its rule's reference off the kernel path (the CPU): softmax, and sigmoid scored
    from the fp32 product of gate and x with its correction bias."""
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(8)).bfloat16()
    gate = torch.nn.Linear(16, 12, bias=False).to(torch.bfloat16)
    gate.e_score_correction_bias = torch.nn.Parameter(torch.randn(12) * 0.1, requires_grad=False)
    for rule in (RouterRule(3, renormalize=True), RouterRule(3, "sigmoid", True, True, 4, 2, 2.5)):
        block = SimpleNamespace(gate=gate, rule=rule)
        with torch.no_grad():
            got = SparseMoeBlock.route(block, x)  # type: ignore[arg-type]
            logits = F.linear(x.float(), gate.weight.float()) if rule.scoring == "sigmoid" else gate(x)
            want = choose_experts_reference(logits, rule, gate.e_score_correction_bias, x.dtype)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def old_grouped_sigmoid(
    logits: torch.Tensor, bias: torch.Tensor, rule: RouterRule
) -> tuple[torch.Tensor, ...]:
    """DeepSeek-V3's noaux_tc choice as transformers writes it, the oracle for the rule's reference."""
    scores = logits.float().sigmoid()
    choice = scores + bias
    t, e = choice.shape
    grouped = choice.view(t, rule.n_group, e // rule.n_group)
    group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
    idx = group_scores.topk(rule.topk_group, dim=-1)[1]
    mask = torch.zeros_like(group_scores).scatter_(1, idx, 1)[:, :, None].expand_as(grouped).reshape(t, e)
    ids = choice.masked_fill(~mask.bool(), 0.0).topk(rule.top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * rule.scaling


# (rule, experts): grouped sigmoid with a bias (DeepSeek-V3's 8 groups, keep 4; one group of 64 kept of 4),
# plain sigmoid (MiniMax-M2, GLM-4.5), DeepSeek-V4's sqrt(softplus), gpt-oss's top-k then softmax
RULES = [
    (RouterRule(8, "sigmoid", True, True, n_group=8, topk_group=4, scaling=2.5), 256),
    (RouterRule(4, "sigmoid", True, True, n_group=4, topk_group=1, scaling=1.0), 64),
    (RouterRule(8, "sigmoid", True, True, scaling=1.8), 160),
    (RouterRule(6, "sqrtsoftplus", True, True, scaling=1.5), 96),
    (RouterRule(4, "topk_softmax"), 32),
    (RouterRule(2, "softmax", False, True), 60),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rule", "e"), RULES)
@pytest.mark.parametrize("t", [1, 3])
def test_every_rule_matches_its_reference(rule: RouterRule, e: int, dtype: torch.dtype, t: int) -> None:
    logits = distinct_logits(t, e, dtype, seed=e + t)
    # a bias of the grid's spacing at most, in steps of 1/1024: choices stay apart (scores are ≥ 1/64 apart
    # before the bias moves them, and the sigmoid's slope keeps them ≥ 1/300 apart); fp32 like a checkpoint's
    g = torch.Generator().manual_seed(e)
    bias = torch.randint(-8, 8, (e,), generator=g).float() / 1024 if rule.biased else None
    ids, weights = choose_experts(logits, rule, bias, torch.bfloat16)
    want_ids, want_weights = choose_experts_reference(logits, rule, bias, torch.bfloat16)
    assert torch.equal(ids, want_ids)
    assert_weights_close(weights, want_weights)
    if rule.n_group > 1:  # the grouped choice as transformers writes it
        old_ids, old_weights = old_grouped_sigmoid(logits, bias, rule)
        assert torch.equal(ids.sort(-1).values, old_ids.sort(-1).values)
        torch.testing.assert_close(weights.float(), old_weights, rtol=8e-3, atol=0)
        group = ids // (e // rule.n_group)
        assert all(len(set(row)) <= rule.topk_group for row in group.tolist())


def test_rules_that_cannot_choose_are_refused() -> None:
    logits = distinct_logits(1, 64, torch.float32, seed=9)
    with pytest.raises(ValueError, match="top_k must be in"):
        choose_experts(logits, RouterRule(17, "sigmoid", n_group=4, topk_group=1))  # 16 kept
    with pytest.raises(ValueError, match="n_group 3"):
        choose_experts(logits, RouterRule(2, n_group=3, topk_group=1))
    with pytest.raises(ValueError, match="bias"):
        choose_experts(logits, RouterRule(2, "sigmoid", biased=True))
    with pytest.raises(ValueError, match="topk_group"):
        RouterRule(2, n_group=2, topk_group=3)
    with pytest.raises(ValueError, match="scoring"):
        RouterRule(2, "relu")
