"""The latent rows' cache write (Triton's interpreter runs the kernel body on CPU tensors) against its
reference: each live row lands at its (slot, position), padding rows and positions past the cache write
nothing, every other cell is untouched."""

from __future__ import annotations

import pytest
import torch

from freetoken.runtime.models.kernels.slot_write import (
    slot_write,
    slot_write_available,
    slot_write_reference,
)

pytestmark = pytest.mark.skipif(not slot_write_available("cpu"), reason="needs Triton's interpreter")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_land_at_their_slot_and_position(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(5, 40, generator=g).to(dtype)
    cache = torch.randn(4, 1, 12, 40, generator=g).to(dtype)
    slots = torch.tensor([2, -1, 0, 3, 1], dtype=torch.int32)
    positions = torch.tensor([0, 5, 11, 12, 7], dtype=torch.int32)  # row 3: past the cache
    want = cache.clone()
    slot_write_reference(rows, want, slots, positions)
    got = cache.clone()
    slot_write(rows, got, slots, positions)
    assert torch.equal(got, want)
    assert torch.equal(got[2, 0, 0], rows[0]) and torch.equal(got[0, 0, 11], rows[2])
    changed = (got != cache).any(dim=-1).sum().item()
    assert changed == 3  # rows 0, 2 and 4: padding and the out-of-range position write nothing


@pytest.mark.parametrize(
    ("width", "index_dtype", "message"), [(8, torch.int64, "int32"), (4, torch.int32, "do not fit")]
)
def test_refuses_rows_that_do_not_fit(width: int, index_dtype: torch.dtype, message: str) -> None:
    slots = torch.zeros(2, dtype=index_dtype)
    with pytest.raises(ValueError, match=message):
        slot_write(torch.zeros(2, 8), torch.zeros(2, 1, 4, width), slots, torch.zeros(2, dtype=torch.int32))
