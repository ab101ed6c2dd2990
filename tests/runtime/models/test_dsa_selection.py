"""Sparse attention's top-k (dsa.top_positions): ordered by score as a stable sort orders, ties to the
earlier position, and so the same over a row's own positions or a whole slot of them."""

from __future__ import annotations

import torch

from freetoken.runtime.models.dsa import top_positions


def test_orders_by_score_then_by_earlier_position() -> None:
    gen = torch.Generator().manual_seed(0)
    index = torch.randint(-3, 4, (5, 40), generator=gen).float() * 0.25  # many ties, negatives, zeros
    index[0, 7] = -0.0  # a negative zero ties with the zeros
    want = torch.sort(index + 0.0, dim=-1, descending=True, stable=True).indices[:, :9]
    assert torch.equal(top_positions(index, 9), want)


def test_the_same_over_a_rows_positions_or_its_whole_slot() -> None:
    gen = torch.Generator().manual_seed(1)
    index = torch.relu(torch.randn(4, 12, generator=gen))  # ties at zero, as an indexer's relu makes them
    slot = torch.cat((index, torch.full((4, 20), float("-inf"))), dim=1)  # the positions past the length
    assert torch.equal(top_positions(index, 6), top_positions(slot, 6))
