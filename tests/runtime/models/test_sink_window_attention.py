"""gpt-oss's attention (layers.sink_window_attention) against its formula written query by query."""

from __future__ import annotations

import pytest
import torch

from freetoken.runtime.models.layers import sink_window_attention


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("chunk", [1, 3, None])
def test_matches_the_formula_in_any_chunks(window: int | None, chunk: int | None) -> None:
    """Softmax over the keys a query sees and its head's sink logit, the sink's share dropped; whatever
    the chunk of queries (10 queries after 40 cached positions, 2 query heads per key head)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=g) for shape in ((8, 10, 16), (2, 50, 16), (2, 50, 16)))
    sinks = torch.randn(8, generator=g)
    got = sink_window_attention(q, k, v, 0.25, sinks, window, chunk=chunk)  # [T, NH * D]
    want = torch.empty(10, 8, 16)
    for i in range(10):
        p = 40 + i
        lo = 0 if window is None else max(0, p - window + 1)
        for h in range(8):
            scores = k[h // 4, lo : p + 1] @ q[h, i] * 0.25
            weights = torch.softmax(torch.cat((scores, sinks[h : h + 1])), dim=0)[:-1]
            want[i, h] = weights @ v[h // 4, lo : p + 1]
    torch.testing.assert_close(got, want.reshape(10, -1), rtol=1e-5, atol=1e-6)
