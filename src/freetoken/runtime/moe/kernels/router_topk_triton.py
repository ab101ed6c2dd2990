"""Triton kernel body of the decode step's router (launcher, rule and reference in router_topk.py).

One program per row of logits [T, E], the whole row in registers (E padded to BLOCK, a power of two):

  s = score(fp32(logits))                softmax (exp(x - max) / sum), sigmoid 1 / (1 + exp(-x)),
                                         sqrt(softplus(x)), or x itself (SCORING 0..3): libdevice's
                                         exp and IEEE division compiled
  c = s (+ bias)                         the choice value; padding -inf
  GROUPS > 1: each group of E / GROUPS scored by its two best c; the TOPK_GROUP best groups kept, the
              others' c set to -inf
  K rounds: (c_j, id) = argmax(c)        the lower id on equal values; then c[id] = -inf (chosen)
  w = s[ids]                             (SCORING 3: softmax over the K chosen logits)
  w = w / (sum(w) + 1e-20) (if RENORM)   the fp32 sum over the K chosen
  store ids (int64), w · scaling rounded once to the weights' dtype
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from freetoken.runtime.models.kernels.norm_rope_triton import _round


@triton.jit
def _exp(x, COMPILED: tl.constexpr):
    # compiled: libdevice's exp (~1 ulp, as torch's expf; tl.exp is ex2.approx); the interpreter: numpy's
    return libdevice.exp(x) if COMPILED else tl.exp(x)


@triton.jit
def _scores(x, live, SCORING: tl.constexpr, COMPILED: tl.constexpr):
    """fp32 logits [BLOCK] (padding -inf) -> scores; padding scores 0 (softmax, sigmoid, softplus)."""
    if SCORING == 0:
        e = _exp(x - tl.max(x, axis=0), COMPILED)
        s = tl.div_rn(e, tl.sum(e, axis=0))  # padding: exp(-inf) = 0; `/` on fp32 is div.full (2 ulp)
    elif SCORING == 1:
        s = tl.div_rn(tl.full(x.shape, 1.0, tl.float32), 1.0 + _exp(-x, COMPILED))
    elif SCORING == 2:  # torch's softplus: x past its threshold of 20, else log(1 + exp(x))
        soft = libdevice.log1p(_exp(x, COMPILED)) if COMPILED else tl.log(1.0 + tl.exp(x))
        s = tl.sqrt_rn(tl.where(x > 20.0, x, soft))
    else:
        s = x
    return tl.where(live, s, 0.0)


@triton.jit
def _keep_groups(c, offs, E: tl.constexpr, GROUPS: tl.constexpr, G_BLOCK: tl.constexpr,
                 TOPK_GROUP: tl.constexpr):  # fmt: skip
    """c [BLOCK] with every expert outside the TOPK_GROUP best of GROUPS equal groups set to -inf (a
    group's score: its two best values' sum; on equal scores the lower group first)."""
    group = offs // (E // GROUPS)
    g_offs = tl.arange(0, G_BLOCK)
    score = tl.full([G_BLOCK], float("-inf"), tl.float32)
    for g in tl.static_range(GROUPS):
        mine = tl.where(group == g, c, float("-inf"))
        first, at = tl.max(mine, axis=0, return_indices=True, return_indices_tie_break_left=True)
        second = tl.max(tl.where(offs == at, float("-inf"), mine), axis=0)
        score = tl.where(g_offs == g, first + second, score)
    kept = group < 0  # [BLOCK], all False
    for _ in tl.static_range(TOPK_GROUP):
        _, at = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
        kept = kept | (group == at)
        score = tl.where(g_offs == at, float("-inf"), score)
    return tl.where(kept, c, float("-inf"))


@triton.jit
def router_topk_kernel(
    logits_ptr,  # [T, E], E contiguous
    bias_ptr,  # [E] (BIASED)
    ids_ptr,  # [T, K] out, int64, contiguous
    weights_ptr,  # [T, K] out, contiguous
    stride_l,
    scaling,  # fp32
    E: tl.constexpr,
    K: tl.constexpr,
    BLOCK: tl.constexpr,  # power of two >= E
    K_BLOCK: tl.constexpr,  # power of two >= K
    SCORING: tl.constexpr,  # router_topk.SCORINGS' index
    BIASED: tl.constexpr,
    GROUPS: tl.constexpr,
    G_BLOCK: tl.constexpr,  # power of two >= GROUPS
    TOPK_GROUP: tl.constexpr,
    RENORM: tl.constexpr,
    COMPILED: tl.constexpr,  # False under Triton's interpreter
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    live = offs < E
    x = tl.load(logits_ptr + row * stride_l + offs, mask=live, other=float("-inf")).to(tl.float32)
    s = _scores(x, live, SCORING, COMPILED)
    c = s
    if BIASED:
        c = c + tl.load(bias_ptr + offs, mask=live, other=0.0).to(tl.float32)
    c = tl.where(live, c, float("-inf"))  # never chosen: a rule keeps at least K live experts
    if GROUPS > 1:
        c = _keep_groups(c, offs, E, GROUPS, G_BLOCK, TOPK_GROUP)
    k_offs = tl.arange(0, K_BLOCK)
    k_live = k_offs < K
    top_s = tl.zeros([K_BLOCK], dtype=tl.float32)
    top_id = tl.zeros([K_BLOCK], dtype=tl.int64)
    for j in tl.static_range(K):
        _, at = tl.max(c, axis=0, return_indices=True, return_indices_tie_break_left=True)
        top_s = tl.where(k_offs == j, tl.sum(tl.where(offs == at, s, 0.0), axis=0), top_s)
        top_id = tl.where(k_offs == j, at.to(tl.int64), top_id)
        c = tl.where(offs == at, float("-inf"), c)
    if SCORING == 3:  # the chosen logits softmaxed (descending, so the first is the largest)
        largest = tl.sum(tl.where(k_offs == 0, top_s, 0.0), axis=0)
        e = tl.where(k_live, _exp(top_s - largest, COMPILED), 0.0)
        top_s = tl.div_rn(e, tl.sum(e, axis=0))
    if RENORM:
        top_s = tl.div_rn(top_s, tl.sum(top_s, axis=0) + 1e-20)  # the unused columns hold 0
    w = top_s * scaling
    tl.store(ids_ptr + row * K + k_offs, top_id, mask=k_live)
    tl.store(weights_ptr + row * K + k_offs, _round(w, weights_ptr.dtype.element_ty, COMPILED), mask=k_live)
