"""The residual add + RMS norm of a CPU decode step in one native call (moe/kernels/norm_cpu.c), rounding
where `add_rms_norm_reference` rounds (the sum to the dtype, the normalised value, the product with the
weight); the reference runs wherever the kernel does not take the inputs."""

from __future__ import annotations

import torch

from freetoken.runtime.models.kernels.norm_rope import add_rms_norm_reference
from freetoken.runtime.moe.kernels.loader import load_library

DTYPES = (torch.bfloat16, torch.float32)


def native_norm_takes(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> bool:
    same = residual is None or (
        residual.dtype == x.dtype and residual.shape == x.shape and residual.is_contiguous()
    )
    return (
        x.device.type == "cpu"
        and x.dim() == 2
        and x.dtype in DTYPES
        and weight.dtype == x.dtype
        and x.is_contiguous()
        and weight.is_contiguous()
        and same
        and load_library() is not None
    )


def cpu_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    zero_centred: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [B, H] -> (normed [B, H], the sum x + residual [B, H]), as add_rms_norm_reference (the
    native call norms with a plain weight; a zero-centred one runs the reference)."""
    if zero_centred or not native_norm_takes(x, residual, weight):
        return add_rms_norm_reference(x, residual, weight, eps, zero_centred)
    lib = load_library()
    assert lib is not None
    rows, hidden = x.shape
    h = torch.empty_like(x)
    summed = x if residual is None else torch.empty_like(x)
    scratch = torch.empty(hidden, dtype=torch.float32)
    lib.ft_add_rms_norm(
        x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(), eps, rows, hidden,
        x.element_size(), h.data_ptr(), summed.data_ptr(), scratch.data_ptr(),
    )  # fmt: skip
    return h, summed
