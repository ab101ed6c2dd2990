"""Latent attention's decode over the slot cache as flash-decoding splits (latent_attention_triton.py) and
decode_attention's combine: each row reads its own positions [0, length) once per block of heads, not
its whole slot, and nothing is gathered (graph-capturable; splits fixed from shapes only).

Reference: `latent_attend_reference` (plain torch over the whole slot, the positions past the row's
length masked), what the CPU runs; tests compare the two.
"""

from __future__ import annotations

import functools
import math
from types import ModuleType

import torch

from freetoken.runtime.models.kernels.decode_attention import (
    DEFAULT_ATTENTION_BLOCKS,
    AttentionBlocks,
    check_device,
    choose_splits,
)
from freetoken.runtime.triton_support import next_pow2

LATENT_BLOCK_H = 16  # query heads per split program (tl.dot's smallest tile; 128 heads: 8 programs a row)
LATENT_BLOCK_N = 32  # positions per step: a [32, 512] latent tile beside [16, 512] accumulators


@functools.cache
def _body() -> tuple[ModuleType, ModuleType, bool]:
    from triton.runtime.interpreter import InterpretedFunction

    from freetoken.runtime.models.kernels import decode_attention_triton as combine
    from freetoken.runtime.models.kernels import latent_attention_triton as body

    return body, combine, isinstance(body.split_latent_kernel, InterpretedFunction)


def latent_attend_reference(
    q: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor, scale: float, rank: int
) -> torch.Tensor:
    """q [B, NH, R + DR] (absorbed), cache [S, 1, CAP, R + DR], slots/lengths [B] int32 -> the mixed
    latents [B, NH, R]: each head's softmax over the row's positions [0, length) of q · [c ; k_pe], times
    c. A padding row (slot < 0) reads slot 0 and its result is ignored."""
    kv = cache[slots.clamp(min=0).long(), 0]  # [B, CAP, R + DR]
    scores = torch.bmm(q, kv.transpose(1, 2)) * scale  # [B, NH, CAP]
    positions = torch.arange(kv.shape[1], device=q.device)
    seen = positions[None, :] < lengths.clamp(min=1)[:, None]  # [B, CAP]
    scores = scores.masked_fill(~seen[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(kv.dtype)
    return torch.bmm(probs, kv[..., :rank])


def latent_decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    rank: int,
    splits: int | None = None,
    blocks: AttentionBlocks = DEFAULT_ATTENTION_BLOCKS,
) -> torch.Tensor:
    """`latent_attend_reference` by the split kernels: same arguments -> [B, NH, R] in q's dtype (zeros for
    a padding row)."""
    b, nh, width = q.shape
    _, one, cap, cw = cache.shape
    if one != 1 or cw != width or not 0 < rank < width:
        raise ValueError(f"cache {tuple(cache.shape)} does not fit q {tuple(q.shape)} with rank {rank}")
    if q.dtype != cache.dtype:
        raise ValueError(f"q ({q.dtype}) and the cache ({cache.dtype}) need one dtype")
    if cache.stride(-1) != 1:
        raise ValueError("the cache needs a contiguous last dimension")
    if any(t.dtype != torch.int32 or t.shape != (b,) for t in (slots, lengths)):
        raise ValueError("slots and lengths must be int32 vectors of one entry per row")
    check_device(q)
    body, combine, interpreted = _body()
    q = q if q.stride(-1) == 1 else q.contiguous()
    head_blocks = -(-nh // LATENT_BLOCK_H)
    splits = splits or choose_splits(b, head_blocks, cap, blocks)
    part_o = torch.empty(b, nh, splits, rank, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(b, nh, splits, dtype=torch.float32, device=q.device)
    out = torch.empty(b, nh * rank, dtype=q.dtype, device=q.device)
    if b == 0:
        return out.view(b, nh, rank)
    body.split_latent_kernel[(b, head_blocks, splits)](
        q, cache, slots, lengths, part_o, part_lse, scale * math.log2(math.e), cap,
        q.stride(0), q.stride(1), cache.stride(0), cache.stride(2),
        NH=nh, R=rank, DR=width - rank, SPLITS=splits, BLOCK_H=LATENT_BLOCK_H, BLOCK_N=LATENT_BLOCK_N,
        BLOCK_R=next_pow2(max(rank, 16)), BLOCK_P=next_pow2(max(width - rank, 16)),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", COMPILED=not interpreted,
        num_warps=8 if rank >= 256 else 4, num_stages=1,
    )  # fmt: skip
    combine.combine_splits_kernel[(b, nh)](
        part_o, part_lse, part_lse, out, NH=nh, D=rank, SPLITS=splits, BLOCK_S=next_pow2(splits),
        BLOCK_D=next_pow2(rank), HAS_SINKS=False, num_warps=4,
    )  # fmt: skip
    return out.view(b, nh, rank)
