"""Decode-sized Linear layers on the CPU through the native bf16 GEMV (moe/kernels/dense_bf16.c): each
bf16 weight row read once for all of a step's rows, fp32 accumulation, 1..16 rows. `F.linear` is its
reference and its fallback (other dtypes, more rows, no compiled library)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from freetoken.runtime.moe.kernels.loader import load_library

MAX_ROWS = 16


def native_linear_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `cpu_linear` runs the native kernel for these: CPU, bf16 contiguous weight, 1..16 rows."""
    return (
        x.device.type == "cpu"
        and x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and weight.dtype == torch.bfloat16
        and weight.is_contiguous()
        and load_library() is not None
    )


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H] @ weight [N, H]^T (+ bias) -> [T, N] in x's dtype; F.linear where the kernel does not take
    the inputs."""
    if not native_linear_takes(x, weight):
        return F.linear(x, weight, bias)
    lib = load_library()
    assert lib is not None
    t, h = x.shape
    n = weight.shape[0]
    xf = x.to(torch.float32).contiguous()
    out = torch.empty(t, n, dtype=torch.float32)
    scratch = torch.empty(t * h, dtype=torch.float32)  # x in the kernel's split form
    code = lib.ft_linear_bf16(
        weight.data_ptr(), xf.data_ptr(), out.data_ptr(), n, h, t, scratch.data_ptr(), torch.get_num_threads()
    )
    if code != 0:
        return F.linear(x, weight, bias)
    if bias is not None:
        out += bias
    return out.to(x.dtype)
