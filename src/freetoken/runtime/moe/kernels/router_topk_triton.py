"""Triton kernel body of the decode step's router (launcher and reference in router_topk.py).

One program per row of logits [T, E], the whole row in registers (E padded to BLOCK, a power of two):

  p = softmax(fp32(logits))              exp(x - max) / sum: libdevice's exp, IEEE division
  K rounds: (value, id) = argmax(p)      the lower id on equal values; then p[id] = -1 (chosen)
  w = values / sum(values) (if RENORM)   the fp32 sum over the K chosen
  store ids (int64), w rounded once to the logits' dtype
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from freetoken.runtime.models.kernels.norm_rope_triton import _round


@triton.jit
def router_topk_kernel(
    logits_ptr,  # [T, E], E contiguous
    ids_ptr,  # [T, K] out, int64, contiguous
    weights_ptr,  # [T, K] out, the logits' dtype, contiguous
    stride_l,
    E: tl.constexpr,
    K: tl.constexpr,
    BLOCK: tl.constexpr,  # power of two >= E
    K_BLOCK: tl.constexpr,  # power of two >= K
    RENORM: tl.constexpr,
    COMPILED: tl.constexpr,  # False under Triton's interpreter
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    live = offs < E
    x = tl.load(logits_ptr + row * stride_l + offs, mask=live, other=float("-inf"))
    dtype = x.dtype
    x = x.to(tl.float32)
    shifted = x - tl.max(x, axis=0)
    # compiled: libdevice's exp (~1 ulp, as torch's expf; tl.exp is ex2.approx); the interpreter: numpy's
    e = libdevice.exp(shifted) if COMPILED else tl.exp(shifted)
    p = tl.div_rn(e, tl.sum(e, axis=0))  # padding: exp(-inf) = 0; `/` on fp32 is div.full (2 ulp)
    p = tl.where(live, p, -1.0)  # below every probability, so padding is never chosen
    k_offs = tl.arange(0, K_BLOCK)
    top_p = tl.zeros([K_BLOCK], dtype=tl.float32)
    top_id = tl.zeros([K_BLOCK], dtype=tl.int64)
    for j in tl.static_range(K):
        best, at = tl.max(p, axis=0, return_indices=True, return_indices_tie_break_left=True)
        top_p = tl.where(k_offs == j, best, top_p)
        top_id = tl.where(k_offs == j, at.to(tl.int64), top_id)
        p = tl.where(offs == at, -1.0, p)
    if RENORM:
        top_p = tl.div_rn(top_p, tl.sum(top_p, axis=0))  # the unused columns hold 0
    k_live = k_offs < K
    tl.store(ids_ptr + row * K + k_offs, top_id, mask=k_live)
    tl.store(weights_ptr + row * K + k_offs, _round(top_p, dtype, COMPILED), mask=k_live)
