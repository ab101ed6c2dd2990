"""Grouped expert compute and the executors against a token-by-token reference."""

from __future__ import annotations

import torch

from freetoken.runtime.moe.experts import gathered_experts, group_by_expert, grouped_experts, swiglu_expert
from freetoken.runtime.moe.pool import HostExpertPool


def make_pool(dtype: torch.dtype = torch.float32) -> HostExpertPool:
    gen = torch.Generator().manual_seed(0)
    pool = HostExpertPool.allocate((0, 2), num_experts=6, hidden_size=16, intermediate_size=8, dtype=dtype)
    for layer in pool.layers:
        pool.gate_up[layer].copy_(torch.randn(pool.gate_up[layer].shape, generator=gen) * 0.3)
        pool.down[layer].copy_(torch.randn(pool.down[layer].shape, generator=gen) * 0.3)
    return pool


def naive(
    x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, pool: HostExpertPool, layer: int
) -> torch.Tensor:
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1])
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            acc += w[t, k] * swiglu_expert(x[t : t + 1], pool.gate_up[layer][e], pool.down[layer][e])[0]
        rows.append(acc)
    return torch.stack(rows)


def routed(t: int, k: int = 3, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, 16, generator=gen)
    ids = torch.stack([torch.randperm(6, generator=gen)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=gen)
    return x, ids, w


def test_group_by_expert_covers_every_choice_once() -> None:
    ids = torch.tensor([[3, 1], [1, 0], [3, 5]])
    experts, rows, cols = group_by_expert(ids)
    assert experts == [0, 1, 3, 5]
    pairs = sorted(
        (int(r), int(c)) for row, col in zip(rows, cols, strict=True) for r, c in zip(row, col, strict=True)
    )
    assert pairs == [(t, k) for t in range(3) for k in range(2)]
    for expert, row, col in zip(experts, rows, cols, strict=True):
        assert all(int(ids[r, c]) == expert for r, c in zip(row, col, strict=True))


def test_grouped_equals_naive_for_batches() -> None:
    pool = make_pool()
    for t in (1, 5, 17):
        x, ids, w = routed(t)
        torch.testing.assert_close(
            grouped_experts(x, ids, w, pool.gate_up[2], pool.down[2]), naive(x, ids, w, pool, 2)
        )


def test_pool_tracks_missing_experts() -> None:
    from freetoken.formats.tensor_names import QWEN3_MOE_EXPERTS

    pool = HostExpertPool.allocate(
        (0,), num_experts=2, hidden_size=4, intermediate_size=2, dtype=torch.float32
    )
    target = QWEN3_MOE_EXPERTS.classify("model.layers.0.mlp.experts.1.up_proj.weight")
    assert target is not None and (target.layer, target.expert, target.part) == (0, 1, "up")
    pool.write(target, "x", torch.full((2, 4), 7.0))
    assert torch.equal(pool.gate_up[0][1, 2:], torch.full((2, 4), 7.0))  # up rows follow the gate rows
    assert "layer 0 expert 1 up" not in pool.missing()
    assert "layer 0 expert 0 up" in pool.missing() and "layer 0 expert 1 gate" in pool.missing()
    fused = QWEN3_MOE_EXPERTS.classify("model.layers.0.mlp.experts.gate_up_proj")
    assert fused is not None and fused.expert is None
    pool.write(fused, "y", torch.zeros(2, 4, 4))
    assert not [m for m in pool.missing() if "gate" in m or "up" in m]


def test_skipped_pairs_contribute_nothing() -> None:
    pool = make_pool()
    x, ids, w = routed(6)
    masked = ids.clone()
    masked[::2, 0] = -1
    keep = torch.where(masked >= 0, w, torch.zeros_like(w))
    banks = pool.gate_up[0], pool.down[0]
    want = naive(x, ids, keep, pool, 0)
    torch.testing.assert_close(grouped_experts(x, masked, w, *banks), want)
    torch.testing.assert_close(gathered_experts(x, masked, w, *banks), want)


def test_gathered_equals_grouped() -> None:
    pool = make_pool()
    for t in (1, 4):
        x, ids, w = routed(t, seed=t)
        banks = pool.gate_up[0], pool.down[0]
        torch.testing.assert_close(gathered_experts(x, ids, w, *banks), grouped_experts(x, ids, w, *banks))
        torch.testing.assert_close(gathered_experts(x, ids, w, *banks), naive(x, ids, w, pool, 0))
