"""Latent attention (MLA: DeepSeek-V3/R1, Kimi-K2) in the decode step over the static KV pool
(models/slot_decode.py): the absorbed form against each row's cached latents, every input a device tensor
(graph-capturable).

Per row b: the new [c ; k_pe] goes to cache[slot_b, 0, position_b] (kernels/slot_write.py: padding rows
write nothing); the query is absorbed per head (q_latent = W_UKᵀ q_nope) and scored against every
position of the row's slot at once — [B, NH, CAP] scores, those at or past the row's length masked —
and the weighted latents go through W_UV. On CUDA the attention over the slots is the split kernel of
kernels/latent_attention.py (each row reads its own positions, blocks of 16 heads sharing each load);
elsewhere the torch reference reads the whole slot (CAP positions of r + d_rope numbers per row). The
math is LatentAttention._absorbed's, with the scores taken in one product over [c ; k_pe] instead of
two summed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from freetoken.runtime.models.mla import LatentAttention
    from freetoken.runtime.models.slot_decode import DecodeStep


def latent_slot_attention(attn: LatentAttention, h: torch.Tensor, step: DecodeStep) -> torch.Tensor:
    """h [B, H] normed -> the attention block's output [B, H] (o_proj applied), the rows' latents written.
    The absorbed attention over the slots is `step.ops.latent_attention` (kernels/latent_attention.py: the
    split kernels on CUDA, the torch reference elsewhere)."""
    rows, ops = step.rows, step.ops
    cache, _ = step.kv(attn.layer)  # [S, 1, CAP, r + dr]
    q_nope, q_pe, latent, _ = attn._project(h, step.cos, step.sin)  # [NH, B, dn], [NH, B, dr], [1, B, r + dr]
    ops.slot_write(latent[0].contiguous(), cache, rows.slots, rows.positions)
    b, nh, r = h.shape[0], attn.heads, attn.rank
    w = attn.kv_b_proj.weight.view(nh, attn.d_nope + attn.d_v, r)
    w_uk, w_uv = w[:, : attn.d_nope], w[:, attn.d_nope :]  # [NH, dn, r], [NH, dv, r]
    q = torch.cat((torch.bmm(q_nope, w_uk), q_pe), dim=-1).transpose(0, 1)  # [B, NH, r + dr]
    mixed = ops.latent_attention(q, cache, rows.slots, rows.lengths, attn.scale, r)  # [B, NH, r]
    out = torch.bmm(mixed.transpose(0, 1), w_uv.transpose(1, 2))  # [NH, B, dv]
    return attn.o_proj(out.transpose(0, 1).reshape(b, nh * attn.d_v))
