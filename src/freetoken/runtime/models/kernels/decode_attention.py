"""Decode attention over a slot KV cache: one new query per row against that row's slot, with no host
sync, no data-dependent shape and no data-dependent allocation (graph-capturable).

The cache is [S, KVH, CAP, D] (one block per sequence slot); row b reads slot `slots[b]` (< 0: padding,
reads nothing, outputs zeros) up to `lengths[b]` keys. Two Triton launches (decode_attention_triton.py):
flash-decoding splits over (row, KV head, split), then a combine over the splits. SPLITS is fixed at
launch from shapes only, so a CUDA graph captured once replays correctly for any lengths <= CAP.

Reference: `slot_decode_attention_reference`, the math of layers.decode_attention row by row.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from types import ModuleType

import torch

from freetoken.runtime.triton_support import kernel_runs_on, next_pow2


@dataclass(frozen=True)
class AttentionBlocks:
    """Tiles and the split policy (not yet tuned on an H200: benchmarks/decode_kernels.py times them)."""

    block_n: int = 64  # keys per loop step
    max_splits: int = 32
    target_programs: int = 512  # split until B * KVH * SPLITS reaches this (about 4 per H200 SM)
    num_warps: int = 4
    num_stages: int = 2


DEFAULT_ATTENTION_BLOCKS = AttentionBlocks()


@functools.cache
def _body() -> tuple[ModuleType, bool]:
    """(the kernel module, whether Triton's interpreter runs it)."""
    from triton.runtime.interpreter import InterpretedFunction

    from freetoken.runtime.models.kernels import decode_attention_triton as body

    return body, isinstance(body.split_attention_kernel, InterpretedFunction)


def decode_kernels_available(device: torch.device | str) -> bool:
    """Whether the Triton decode kernels (this module's and norm_rope's) run on tensors of `device`:
    CUDA ones, or CPU ones under TRITON_INTERPRET=1 (set before Triton is first imported)."""
    return kernel_runs_on(_body, device)


def check_device(t: torch.Tensor) -> None:
    if not decode_kernels_available(t.device):
        where = "CPU ones only under TRITON_INTERPRET=1"
        raise ValueError(f"the Triton decode kernels take CUDA tensors ({where}), not {t.device}")


def choose_splits(batch: int, kv_heads: int, capacity: int, blocks: AttentionBlocks) -> int:
    """Splits per (row, KV head), from shapes only: enough programs to fill the card, capped by
    `max_splits` and by the number of key blocks in a slot."""
    wanted = -(-blocks.target_programs // max(1, batch * kv_heads))
    return max(1, min(blocks.max_splits, -(-capacity // blocks.block_n), wanted))


def slot_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
    splits: int | None = None,
    blocks: AttentionBlocks = DEFAULT_ATTENTION_BLOCKS,
) -> torch.Tensor:
    """q [B, NH, D]; k_cache, v_cache [S, KVH, CAP, D] (D contiguous, same strides); slots, lengths [B]
    int32 on q's device -> [B, NH * D] in q's dtype. Row b attends to keys [0, lengths[b]) of slot
    slots[b] (the last `window` of them with a window); `sinks` [NH]: each head's sink logit joins its
    softmax's denominator (gpt-oss); a row with slot < 0 reads nothing and gets zeros. Lengths should lie
    in [1, CAP] for real rows (not checked, which would sync; the kernel clamps them to [0, CAP], and 0
    gives zeros)."""
    b, nh, d = q.shape
    _, kvh, cap, _ = k_cache.shape
    if k_cache.shape[-1] != d or v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        shapes = f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)}"
        raise ValueError(f"caches {shapes} do not fit q {tuple(q.shape)}")
    if k_cache.stride(-1) != 1:
        raise ValueError("the caches need a contiguous head dimension")
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"q ({q.dtype}) and the caches ({k_cache.dtype}, {v_cache.dtype}) need one dtype")
    if nh % kvh:
        raise ValueError(f"{nh} query heads do not group over {kvh} KV heads")
    if any(t.dtype != torch.int32 or t.shape != (b,) for t in (slots, lengths)):
        raise ValueError("slots and lengths must be int32 vectors of one entry per row")
    check_device(q)
    body, interpreted = _body()
    if q.stride(-1) != 1:
        q = q.contiguous()
    g = nh // kvh
    splits = splits or choose_splits(b, kvh, cap, blocks)
    block_d = next_pow2(max(d, 16))
    part_o = torch.empty(b, nh, splits, d, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(b, nh, splits, dtype=torch.float32, device=q.device)
    out = torch.empty(b, nh * d, dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    sinks32 = part_lse if sinks is None else sinks.float().contiguous()  # [NH]; never read without sinks
    body.split_attention_kernel[(b, kvh, splits)](
        q, k_cache, v_cache, slots, lengths, part_o, part_lse, scale * math.log2(math.e), cap, window or 0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NH=nh, G=g, D=d, SPLITS=splits, BLOCK_H=max(16, next_pow2(g)), BLOCK_N=blocks.block_n,
        BLOCK_D=block_d, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        COMPILED=not interpreted, num_warps=blocks.num_warps, num_stages=blocks.num_stages,
    )  # fmt: skip
    body.combine_splits_kernel[(b, nh)](
        part_o, part_lse, sinks32, out, NH=nh, D=d, SPLITS=splits, BLOCK_S=next_pow2(splits),
        BLOCK_D=block_d, HAS_SINKS=sinks is not None, num_warps=4,
    )  # fmt: skip
    return out


def slot_decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """The oracle (and a CPU path): same arguments and result as `slot_decode_attention`, row by row
    with the math of layers.decode_attention (scores in the dtype, softmax in fp32, probs back to it);
    with sinks or a window, that of layers.sink_window_attention (scores in fp32, the sink a column of
    the softmax that is dropped after it)."""
    b, nh, d = q.shape
    kvh = k_cache.shape[1]
    out = torch.zeros(b, nh * d, dtype=q.dtype, device=q.device)
    for row, (slot, length) in enumerate(zip(slots.tolist(), lengths.tolist(), strict=True)):
        if slot < 0:
            continue
        first = max(0, length - window) if window else 0
        k, v = k_cache[slot, :, first:length], v_cache[slot, :, first:length]  # [KVH, L, D]
        qg = q[row].reshape(kvh, nh // kvh, d)  # [KVH, G, D]
        if sinks is None and not window:
            scores = torch.bmm(qg, k.transpose(1, 2)) * scale  # [KVH, G, L]
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
        else:
            scores = torch.bmm(qg, k.transpose(1, 2)).float() * scale
            if sinks is not None:
                sink = sinks.float().view(kvh, nh // kvh, 1)
                scores = torch.cat((scores, sink), dim=-1)
            probs = torch.softmax(scores, dim=-1)[..., : length - first].to(v.dtype)
        out[row] = torch.bmm(probs, v).reshape(nh * d)
    return out
