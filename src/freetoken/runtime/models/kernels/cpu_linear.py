"""Linear layers on the CPU with bf16 weights, `F.linear` their reference: up to 16 rows through the
native bf16 GEMV (moe/kernels/dense_bf16.c: each weight row read once for all the rows, fp32
accumulation); more rows through torch's bf16 matrix product where the CPU has bf16 dot units
(AVX512-BF16, AMX: 3-6 × faster than widening on a 2-core EPYC), else as an fp32 product of the widened
operands, rounded back (torch's bf16 product is several times slower than its fp32 one without those
units). Either way an fp32 accumulation rounded once. `Linear` is nn.Linear with this forward, what the
models build."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.runtime.moe.kernels.loader import bf16_dot_units, load_library

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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for x [..., H]; on the CPU with a bf16 weight, the faster of the paths above."""
    if x.device.type != "cpu" or weight.dtype != torch.bfloat16 or x.dtype != torch.bfloat16:
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    if native_linear_takes(rows, weight):
        return cpu_linear(rows, weight, bias).reshape(*x.shape[:-1], weight.shape[0])
    if bf16_dot_units():
        return F.linear(x, weight, bias)
    wide_bias = None if bias is None else bias.float()
    return F.linear(x.float(), weight.float(), wide_bias).to(x.dtype)


class Linear(nn.Linear):
    """nn.Linear whose forward is `linear` (the same parameters and state-dict names)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


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
