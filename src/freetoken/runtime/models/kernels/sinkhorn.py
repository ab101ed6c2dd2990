"""The hyper-connections' Sinkhorn normalisation (DeepSeek-V4): `iters` rounds over a small [N, N] mix per
token. In torch each round is a few launches over a tiny tensor (some 80 for 20 rounds, two mixes a
layer), so on CUDA the whole normalisation is one Triton launch (sinkhorn_triton.py), graph-capturable;
`sinkhorn_reference` is the plain torch it replaces, and runs elsewhere. They agree up to fp32 rounding
of four-term sums.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from freetoken.runtime.triton_support import kernel_runs_on, next_pow2

MAX_N = 64  # mixes wider than this stay in torch (hc_mult is 4 in DeepSeek-V4)


@functools.cache
def _body() -> tuple[ModuleType, bool]:
    from triton.runtime.interpreter import InterpretedFunction

    from freetoken.runtime.models.kernels import sinkhorn_triton as body

    return body, isinstance(body.sinkhorn_kernel, InterpretedFunction)


def sinkhorn_available(device: torch.device | str) -> bool:
    return kernel_runs_on(_body, device)


def sinkhorn_reference(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """comb [..., N, N] > 0 -> nearly doubly stochastic: columns normalised, then `iters` − 1 rounds of
    rows then columns (each divided by its sum + eps)."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def sinkhorn_kernel(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """`sinkhorn_reference` in one launch: comb [..., N, N] fp32 -> [..., N, N] fp32."""
    n = comb.shape[-1]
    if comb.dtype != torch.float32 or comb.shape[-2] != n or iters < 1:
        raise ValueError(
            f"comb must be [..., N, N] fp32 and iters >= 1, not {tuple(comb.shape)} {comb.dtype}"
        )
    flat = comb.reshape(-1, n, n).contiguous()
    out = torch.empty_like(flat)
    if flat.shape[0]:
        body, _ = _body()
        body.sinkhorn_kernel[(flat.shape[0],)](flat, out, iters, eps, N=n, BLOCK=next_pow2(n), num_warps=1)
    return out.view(comb.shape)


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The kernel on CUDA (fp32 mixes of at most MAX_N streams), the reference elsewhere."""
    if comb.is_cuda and comb.dtype == torch.float32 and comb.shape[-1] <= MAX_N and iters >= 1:
        return sinkhorn_kernel(comb, iters, eps)
    return sinkhorn_reference(comb, iters, eps)
