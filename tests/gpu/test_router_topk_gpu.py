"""The router kernel compiled on CUDA at Qwen3-30B-A3B shapes (128 experts, top 8, renormalised, bf16):
against its reference, and replayed in a CUDA graph with no host sync after the logits change in place."""

from __future__ import annotations

import pytest
import torch

from freetoken.runtime.moe.kernels.router_topk import (
    RouterRule,
    choose_experts,
    choose_experts_reference,
    router_topk,
    router_topk_reference,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
E, K, H = 128, 8, 2048  # Qwen3-30B-A3B: experts, experts per token, hidden size


def gate_logits(t: int, seed: int, e: int = E) -> torch.Tensor:
    """[t, e] bf16 logits as a gate makes them: hidden states times a gate weight, in bf16."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, H, device="cuda", generator=g).bfloat16()
    w = (torch.randn(e, H, device="cuda", generator=g) / H**0.5).bfloat16()
    return x @ w.T


def assert_same_choice(
    logits: torch.Tensor, k: int, renormalize: bool, ids: torch.Tensor, weights: torch.Tensor
) -> None:
    """bf16 logits tie now and then, and torch.topk orders ties as it likes: the kernel's choice must hold
    the same probabilities in the same (descending) order, with distinct ids, and ids equal where no two
    of a row's top k + 1 probabilities tie."""
    want_ids, want_weights = router_topk_reference(logits, k, renormalize)
    probs = torch.softmax(logits.float(), dim=-1)
    assert torch.equal(probs.gather(-1, ids), probs.gather(-1, want_ids))
    assert all(len(set(row)) == k for row in ids.tolist())
    top = probs.topk(min(k + 1, probs.shape[-1]), dim=-1).values
    untied = (top[:, 1:] != top[:, :-1]).all(-1)
    assert torch.equal(ids[untied], want_ids[untied])
    assert weights.dtype == want_weights.dtype
    if weights.dtype == torch.bfloat16:
        assert (weights == want_weights).float().mean().item() >= 0.95  # fp32 sum order may move an ulp
        torch.testing.assert_close(weights, want_weights)
    else:
        torch.testing.assert_close(weights, want_weights, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("t", [1, 8])
@pytest.mark.parametrize("renormalize", [True, False])
def test_matches_the_reference_at_qwen3_shapes(t: int, renormalize: bool) -> None:
    logits = gate_logits(t, seed=t)
    ids, weights = router_topk(logits, K, renormalize)
    assert ids.shape == weights.shape == (t, K)
    assert_same_choice(logits, K, renormalize, ids, weights)


@pytest.mark.parametrize(("e", "k"), [(60, 4), (512, 16)])
def test_matches_the_reference_in_fp32_at_other_shapes(e: int, k: int) -> None:
    logits = gate_logits(16, seed=e, e=e).float() * 4
    ids, weights = router_topk(logits, k, True)
    assert_same_choice(logits, k, True, ids, weights)


def test_replays_in_a_cuda_graph_after_the_logits_change() -> None:
    t = 8
    logits = gate_logits(t, seed=20)
    router_topk(logits, K, True)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            ids, weights = router_topk(logits, K, True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for seed in (21, 22):
        logits.copy_(gate_logits(t, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        assert_same_choice(logits, K, True, ids, weights)
        want_ids, want_weights = router_topk(logits, K, True)
        assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)


@pytest.mark.parametrize(
    ("rule", "e"),
    [
        (RouterRule(8, "sigmoid", True, True, n_group=8, topk_group=4, scaling=2.5), 256),  # DeepSeek-V3
        (RouterRule(8, "sigmoid", True, True, scaling=1.0), 160),  # GLM-4.5
        (RouterRule(6, "sqrtsoftplus", True, True, scaling=1.5), 256),  # DeepSeek-V4
        (RouterRule(4, "topk_softmax"), 32),  # gpt-oss
    ],
)
def test_every_rule_compiled_matches_its_reference(rule: RouterRule, e: int) -> None:
    """fp32 logits as the sigmoid routers make them (x and gate in fp32): the same choice, the weights a
    few fp32 ulps apart (exp, division and sums compiled)."""
    logits = gate_logits(8, seed=e, e=e).float() * 4
    bias = (
        torch.randn(e, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1)) * 0.01
    ).float()
    ids, weights = choose_experts(logits, rule, bias if rule.biased else None, torch.float32)
    want_ids, want_weights = choose_experts_reference(
        logits, rule, bias if rule.biased else None, torch.float32
    )
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=4e-6, atol=1e-7)
