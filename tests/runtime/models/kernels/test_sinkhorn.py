"""The hyper-connections' Sinkhorn normalisation in one launch (Triton's interpreter here) against its
torch reference, and the reference against its definition."""

from __future__ import annotations

import pytest
import torch

from freetoken.runtime.models.kernels.sinkhorn import (
    sinkhorn,
    sinkhorn_available,
    sinkhorn_kernel,
    sinkhorn_reference,
)


def mixes(*shape: int, seed: int) -> torch.Tensor:
    """Positive mixes as a hyper-connection makes them: a softmax per row, plus ε."""
    logits = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3
    return torch.softmax(logits, dim=-1) + 1e-6


@pytest.mark.skipif(not sinkhorn_available("cpu"), reason="needs Triton's interpreter")
@pytest.mark.parametrize(("shape", "iters"), [((5, 4, 4), 20), ((2, 3, 6, 6), 7), ((1, 3, 3), 1)])
def test_the_kernel_is_the_reference(shape: tuple[int, ...], iters: int) -> None:
    comb = mixes(*shape, seed=len(shape) + iters)
    torch.testing.assert_close(sinkhorn_kernel(comb, iters, 1e-6), sinkhorn_reference(comb, iters, 1e-6))


def test_the_reference_makes_columns_and_rows_sum_to_one() -> None:
    comb = mixes(3, 4, 4, seed=1)
    out = sinkhorn_reference(comb, 20, 1e-6)
    torch.testing.assert_close(out.sum(dim=-2), torch.ones(3, 4), atol=1e-4, rtol=0)
    torch.testing.assert_close(out.sum(dim=-1), torch.ones(3, 4), atol=1e-2, rtol=0)  # rows end a round early
    one = sinkhorn_reference(comb, 1, 1e-6)  # one round: columns only
    torch.testing.assert_close(one, comb / (comb.sum(dim=-2, keepdim=True) + 1e-6))


def test_cpu_tensors_take_the_reference() -> None:
    comb = mixes(2, 4, 4, seed=2)
    assert torch.equal(sinkhorn(comb, 5, 1e-6), sinkhorn_reference(comb, 5, 1e-6))
