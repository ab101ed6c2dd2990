"""The stream-or-on-demand choice for prefill chunks, against hand-computed costs."""

from __future__ import annotations

import math

import pytest

from freetoken.runtime.moe.prefill_plan import PrefillCosts

GB = 1e9
S = 9 * 2**20  # a Qwen3-30B-A3B expert in bf16


def costs(**kw: object) -> PrefillCosts:
    base = dict(
        num_experts=128,
        top_k=8,
        expert_bytes=S,
        pcie_bw=50 * GB,
        host_bw=60 * GB,
        host_batch_scale=((1, 1.0), (16, 0.5)),
        device_pairs_per_s=2e6,
        mode="offload",
    )
    return PrefillCosts(**{**base, **kw})  # type: ignore[arg-type]


def test_costs_by_hand() -> None:
    c = costs()
    tokens = 64
    u = 128 * (1 - (1 - 8 / 128) ** tokens)
    compute = tokens * 8 / 2e6
    assert c.routed(tokens) == pytest.approx(u)
    assert c.on_demand_s(tokens, 0.0) == pytest.approx(u * S / (50 * GB) + compute)
    assert c.stream_s(tokens, 0.0) == pytest.approx(max(128 * S / (50 * GB), compute))
    # half the layer resident: on demand fetches half the misses; streaming copies everything unless d2d
    assert c.on_demand_s(tokens, 64) == pytest.approx(u / 2 * S / (50 * GB) + compute)
    assert costs(hit_d2d=True).stream_s(tokens, 64) == pytest.approx(max(64 * S / (50 * GB), compute))


def test_host_bandwidth_interpolates_in_log_batch_then_falls_as_one_over_n() -> None:
    c = costs()
    assert c.host_bw_at(1) == 60 * GB
    assert c.host_bw_at(4) == pytest.approx(60 * GB * 0.75)  # halfway between 1 and 16 in log n
    assert c.host_bw_at(64) == pytest.approx(60 * GB * 0.5 * 16 / 64)


def test_small_chunks_go_on_demand_and_large_ones_stream() -> None:
    c = costs()
    assert not c.stream_wins(1, 0.0) and not c.stream_wins(8, 0.0)
    assert c.stream_wins(8192, 0.0)
    t = c.crossover(0.0)
    assert t is not None and 8 < t < 8192
    assert c.stream_wins(t, 0.0) and not c.stream_wins(t - 1, 0.0)


def test_crossover_moves_with_the_measured_numbers() -> None:
    fast_link = costs(pcie_bw=200 * GB).crossover(0.0)
    slow_link = costs(pcie_bw=10 * GB).crossover(0.0)
    assert fast_link is not None and slow_link is not None and slow_link > fast_link
    # the CPU branch takes misses too in hybrid: streaming must beat both paths, so it starts later
    hybrid = costs(mode="hybrid").crossover(0.0)
    offload = costs().crossover(0.0)
    assert hybrid is not None and offload is not None and hybrid >= offload


def test_without_a_link_nothing_streams() -> None:
    c = costs(pcie_bw=None, mode="cpu")
    assert c.stream_s(8192, 0.0) == math.inf
    assert not c.stream_wins(8192, 0.0) and c.crossover(0.0) is None
