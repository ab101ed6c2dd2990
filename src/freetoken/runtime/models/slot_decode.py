"""The decode step over the static KV pool: one new token per row, every input a device tensor.

Nothing here reads a value back to the host or allocates by data, so on CUDA the whole step (all layers,
the final norm, the LM head) is captured once per padded batch size and replayed (decode_graph.py). On
CUDA the norms, q/k norm + rotary + K/V write and attention are the Triton kernels of models/kernels and
the experts the fused MoE decode kernel; elsewhere the same step runs eagerly on their plain-torch
references, so CI checks the very function that is captured.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.runtime.kv.slot_pool import KVSlotPool
from freetoken.runtime.models.kernels.cpu_attention import cpu_attention_block
from freetoken.runtime.models.kernels.cpu_linear import cpu_linear
from freetoken.runtime.models.kernels.cpu_norm import cpu_add_rms_norm
from freetoken.runtime.models.kernels.decode_attention import (
    slot_decode_attention,
    slot_decode_attention_reference,
)
from freetoken.runtime.models.kernels.latent_attention import latent_attend_reference, latent_decode_attention
from freetoken.runtime.models.kernels.norm_rope import (
    add_rms_norm,
    qk_norm_rope_kv_write,
    qk_norm_rope_kv_write_reference,
)
from freetoken.runtime.models.kernels.slot_write import slot_write, slot_write_reference
from freetoken.runtime.models.latent_decode import latent_slot_attention
from freetoken.runtime.models.mla import LatentAttention
from freetoken.runtime.models.qwen3_moe import SparseMoeBlock


@dataclass(frozen=True)
class DecodeRows:
    """One decode step's rows, all on the compute device. A padding row has slot -1 (reads and writes
    nothing; its logits are garbage and ignored)."""

    tokens: torch.Tensor  # [B] int64: the token each row feeds
    positions: torch.Tensor  # [B] int32: where it goes (the sequence's length before the step)
    slots: torch.Tensor  # [B] int32: the row's KV slot
    lengths: torch.Tensor  # [B] int32: positions + 1, the keys attention sees


@dataclass(frozen=True)
class DecodeOps:
    """The kernels of one step: Triton on CUDA, the references elsewhere."""

    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    qk_norm_rope_kv_write: Callable[..., torch.Tensor]
    attention: Callable[..., torch.Tensor]
    linear: Callable[..., torch.Tensor]  # x [B, H], weight [N, H], bias -> [B, N]
    # the whole attention block at once (norms, rotary, K/V write, attention), or None where it declines
    attention_block: Callable[..., torch.Tensor | None] | None = None
    slot_write: Callable[..., None] = slot_write_reference  # a latent row into its slot (latent attention)
    latent_attention: Callable[..., torch.Tensor] = latent_attend_reference  # absorbed MLA over the slots

    @staticmethod
    def for_device(device: torch.device) -> DecodeOps:
        if device.type == "cuda":
            return DecodeOps(
                add_rms_norm,
                qk_norm_rope_kv_write,
                slot_decode_attention,
                F.linear,
                slot_write=slot_write,
                latent_attention=latent_decode_attention,
            )
        return DecodeOps(
            cpu_add_rms_norm,  # one native call where it takes the inputs, else the reference
            qk_norm_rope_kv_write_reference,
            slot_decode_attention_reference,
            cpu_linear,  # the native bf16 GEMV where it takes the inputs, else F.linear
            cpu_attention_block,  # one native call where it takes the inputs
        )


def supports_slot_decode(model: nn.Module) -> bool:
    """Whether the model's layers are the ones this step knows (grouped-query attention with per-head q/k
    norms or none, rope on every dim, sinks and sliding windows where the model has them; a routed MoE
    or dense MLP: Qwen3-MoE, gpt-oss, Mixtral; latent attention without an indexer: DeepSeek-V3, Kimi-K2)."""
    return bool(getattr(model, "slot_decode", False))


def prepare_for_slot_decode(model: nn.Module) -> None:
    """Once, after the weights are loaded: each attention layer's q, k, v weights become one matrix (latent
    attention keeps its own projections)."""
    for layer in model.model.layers:
        if not isinstance(layer.self_attn, LatentAttention):
            layer.self_attn.fuse_projections()


def decode_step(model: nn.Module, rows: DecodeRows, pool: KVSlotPool, ops: DecodeOps) -> torch.Tensor:
    """The model's layers (supports_slot_decode) over the slot pool -> logits [B, V]. The caller advances
    each sequence's length.

    The residual stream is carried beside the normed activations: each norm adds the branch output to
    it first (x + attn, then + mlp), exactly the sums the eager layer computes.
    """
    backbone = model.model
    x = backbone.embed_tokens(rows.tokens)  # [B, H]
    cos, sin = model.rotary(rows.positions, x.dtype)  # [B, D]
    residual: torch.Tensor | None = None
    real = rows.slots >= 0  # [B]: padding rows route to no expert
    for layer in backbone.layers:
        norm = layer.input_layernorm
        h, residual = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        attn = layer.self_attn
        if isinstance(attn, LatentAttention):
            x = latent_slot_attention(attn, h, cos, sin, pool, rows, ops.slot_write, ops.latent_attention)
        else:
            x = _attention(attn, h, cos, sin, pool, rows, ops)
        norm = layer.post_attention_layernorm
        h, residual = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        x = layer.mlp(h, real) if isinstance(layer.mlp, SparseMoeBlock) else layer.mlp(h)
    norm = backbone.norm
    h, _ = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
    return ops.linear(h, model.lm_head.weight)


def _attention(
    attn: nn.Module,
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pool: KVSlotPool,
    rows: DecodeRows,
    ops: DecodeOps,
) -> torch.Tensor:
    i = pool.index[attn.layer]
    k_cache, v_cache = pool.k[i], pool.v[i]  # [S, KVH, CAP, D]
    qkv = ops.linear(h, attn.qkv_weight, attn.qkv_bias)  # [B, (NH + 2 KVH) D]: one GEMV
    if ops.attention_block is not None:
        out = ops.attention_block(qkv, attn, cos, sin, k_cache, v_cache, rows.slots, rows.positions)
        if out is not None:
            return ops.linear(out, attn.o_proj.weight, attn.o_proj.bias)
    nq, nkv = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
    normed = attn.qk_norm == "head"
    q = ops.qk_norm_rope_kv_write(
        qkv[:, :nq],
        qkv[:, nq : nq + nkv],
        qkv[:, nq + nkv :],
        attn.q_norm.weight if normed else None,
        attn.k_norm.weight if normed else None,
        attn.q_norm.eps if normed else 0.0,
        cos,
        sin,
        k_cache,
        v_cache,
        rows.slots,
        rows.positions,
    )  # [B, NH, D]
    sinks = getattr(attn, "sinks", None)
    scale = attn.head_dim**-0.5
    out = ops.attention(q, k_cache, v_cache, rows.slots, rows.lengths, scale, sinks, attn.window)
    return ops.linear(out, attn.o_proj.weight, attn.o_proj.bias)
