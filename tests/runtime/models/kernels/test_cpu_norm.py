"""The native residual add + RMS norm of the CPU decode step against add_rms_norm_reference."""

from __future__ import annotations

import pytest
import torch

from freetoken.runtime.models.kernels.cpu_norm import cpu_add_rms_norm
from freetoken.runtime.models.kernels.norm_rope import add_rms_norm_reference
from freetoken.runtime.moe.kernels.loader import load_library

pytestmark = pytest.mark.skipif(load_library() is None, reason="needs the compiled CPU kernels")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
def test_native_add_rms_norm_rounds_as_the_reference(dtype: torch.dtype, with_residual: bool) -> None:
    g = torch.Generator().manual_seed(9)
    x = torch.randn(3, 96, generator=g).to(dtype)
    residual = torch.randn(3, 96, generator=g).to(dtype) if with_residual else None
    weight = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
    h, summed = cpu_add_rms_norm(x, residual, weight, 1e-6)
    want_h, want_sum = add_rms_norm_reference(x, residual, weight, 1e-6)
    assert torch.equal(summed, want_sum)  # the residual stream is the reference's, bit for bit
    if dtype == torch.float32:
        assert torch.allclose(h, want_h, rtol=1e-5, atol=1e-6)
    else:  # fp32 sums in another order can move a value across a bf16 rounding boundary: one ulp at most
        assert (h.float() - want_h.float()).abs().max() <= 2**-7 * want_h.float().abs().max()
        assert (h != want_h).float().mean() < 0.05
