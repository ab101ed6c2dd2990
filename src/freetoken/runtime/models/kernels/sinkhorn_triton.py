"""Triton kernel body of the hyper-connections' Sinkhorn normalisation (launcher and reference in
sinkhorn.py): one program per [N, N] matrix, held in registers through every iteration, in fp32."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def sinkhorn_kernel(
    comb_ptr,  # [M, N, N] fp32, contiguous
    out_ptr,  # [M, N, N] fp32 out
    iters,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,  # >= N
):
    m = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, BLOCK)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    inside = (rows < N) & (cols < N)
    at = m * N * N + rows * N + cols
    c = tl.load(comb_ptr + at, mask=inside, other=0.0)  # cells outside are 0: they add nothing to a sum
    c = c / (tl.sum(c, axis=0)[None, :] + eps)  # columns
    for _ in range(iters - 1):
        c = c / (tl.sum(c, axis=1)[:, None] + eps)  # rows
        c = c / (tl.sum(c, axis=0)[None, :] + eps)  # columns
    tl.store(out_ptr + at, c, mask=inside)
