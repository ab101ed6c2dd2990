"""Latent attention's decode kernel against its plain-torch reference, run by Triton's interpreter on CPU
(the same kernel bodies the GPU compiles; tests/gpu/test_decode_kernels_gpu.py runs them compiled)."""

from __future__ import annotations

import pytest
import torch

from freetoken.runtime.models.kernels.decode_attention import decode_kernels_available
from freetoken.runtime.models.kernels.latent_attention import latent_attend_reference, latent_decode_attention

pytestmark = pytest.mark.skipif(not decode_kernels_available("cpu"), reason="needs Triton's interpreter")

CAP = 80


def case(nh: int, rank: int, rope: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Four rows: slot 2 with one position, padding, slot 0 with 37 (not a block multiple), slot 3 full."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(4, nh, rank + rope, generator=g)
    cache = torch.randn(4, 1, CAP, rank + rope, generator=g)
    slots = torch.tensor([2, -1, 0, 3], dtype=torch.int32)
    lengths = torch.tensor([1, 10**6, 37, CAP], dtype=torch.int32)  # a padding row's length is never read
    return q, cache, slots, lengths


@pytest.mark.parametrize(
    ("nh", "rank", "rope", "splits"), [(16, 32, 16, None), (20, 40, 24, 3), (3, 64, 16, 1)]
)
def test_matches_the_reference_in_fp32(nh: int, rank: int, rope: int, splits: int | None) -> None:
    """Head counts that fill, overrun (20 = 16 + 4) and underfill a block of 16; ranks and rope widths
    below their tiles (masks); one to several splits, with empty ones for the one-position row."""
    q, cache, slots, lengths = case(nh, rank, rope, seed=nh + rank)
    q[1] = float("nan")  # the padding row's query is not read
    got = latent_decode_attention(q, cache, slots, lengths, 0.125, rank, splits=splits)
    want = latent_attend_reference(q, cache, slots, lengths, 0.125, rank)
    live = slots >= 0
    torch.testing.assert_close(got[live], want[live], rtol=1e-4, atol=1e-5)
    assert bool((got[1] == 0).all())


def test_positions_past_the_length_are_not_read() -> None:
    q, cache, slots, lengths = case(16, 32, 16, seed=5)
    got = latent_decode_attention(q, cache, slots, lengths, 0.2, 32)
    cache[0, 0, 37:] = float("nan")  # slot 0 holds 37 positions
    cache[2, 0, 1:] = float("nan")
    assert torch.equal(latent_decode_attention(q, cache, slots, lengths, 0.2, 32), got)


def test_refuses_a_cache_that_does_not_fit() -> None:
    q, cache, slots, lengths = case(16, 32, 16)
    with pytest.raises(ValueError, match="does not fit"):
        latent_decode_attention(q, cache[..., :-1], slots, lengths, 0.2, 32)
