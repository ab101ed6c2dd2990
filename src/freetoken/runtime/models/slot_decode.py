"""What a decode step over the static KV pool carries through the model: one new token per row, every
input a device tensor.

Each model owns its step (`model.decode(rows, pool, ops)`: its layer loop; each block's and each
mixer's `decode(h, step)`), written once. Nothing in it reads a value back to the host or allocates by
data, so on CUDA the whole step (all layers, the final norm, the LM head) is captured once per padded
batch size and replayed (decode_graph.py). The kernels come in `DecodeOps`: Triton on CUDA (norms, q/k
norm + rotary + K/V write, attention, the DeltaNet step, the fused MoE decode in the executor); elsewhere
the same step runs eagerly on their plain-torch references or native CPU calls, so CI checks the very
function that is captured.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from freetoken.runtime.kv.slot_pool import KVSlotPool
from freetoken.runtime.models.kernels.cpu_attention import cpu_attention_block
from freetoken.runtime.models.kernels.cpu_delta_step import cpu_conv_step, cpu_delta_step, cpu_kda_step
from freetoken.runtime.models.kernels.cpu_linear import cpu_linear
from freetoken.runtime.models.kernels.cpu_norm import cpu_add_rms_norm
from freetoken.runtime.models.kernels.decode_attention import (
    slot_decode_attention,
    slot_decode_attention_reference,
)
from freetoken.runtime.models.kernels.delta_step import (
    causal_conv_step,
    causal_conv_step_reference,
    delta_rule_step,
    delta_rule_step_reference,
    kda_rule_step,
    kda_rule_step_reference,
)
from freetoken.runtime.models.kernels.latent_attention import latent_attend_reference, latent_decode_attention
from freetoken.runtime.models.kernels.norm_rope import (
    add_rms_norm,
    qk_norm_rope_kv_write,
    qk_norm_rope_kv_write_reference,
)
from freetoken.runtime.models.kernels.slot_write import slot_write, slot_write_reference


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
    conv_step: Callable[..., torch.Tensor] = causal_conv_step_reference  # a DeltaNet layer's convolution
    delta_step: Callable[..., torch.Tensor] = delta_rule_step_reference  # its gates and delta rule
    kda_step: Callable[..., torch.Tensor] = kda_rule_step_reference  # Kimi Delta Attention's rule

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
                conv_step=causal_conv_step,
                delta_step=delta_rule_step,
                kda_step=kda_rule_step,
            )
        return DecodeOps(
            cpu_add_rms_norm,  # one native call where it takes the inputs, else the reference
            qk_norm_rope_kv_write_reference,
            slot_decode_attention_reference,
            cpu_linear,  # the native bf16 GEMV where it takes the inputs, else F.linear
            cpu_attention_block,  # one native call where it takes the inputs
            conv_step=cpu_conv_step,  # DeltaNet's and KDA's: native calls where they take the inputs
            delta_step=cpu_delta_step,
            kda_step=cpu_kda_step,
        )


@dataclass(frozen=True)
class DecodeStep:
    """One step as the model's modules see it: the rows, the pool they read and write, the kernels, and
    what every layer shares (the rows' rotary angles, which rows are real)."""

    rows: DecodeRows
    pool: KVSlotPool
    ops: DecodeOps
    cos: torch.Tensor  # [B, R]: the rotary dims of each row's position
    sin: torch.Tensor
    real: torch.Tensor  # [B] bool: padding rows (slot -1) route to no expert
    # sparse attention's choices in this step by indexing layer: (top [B, k] positions, valid [B, k])
    choices: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def add_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm: torch.nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): a block's residual add and the RMSNorm after it in one."""
        return self.ops.add_rms_norm(x, residual, norm.weight, norm.eps, norm.zero_centred)

    def norm(self, x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
        """norm(x) for x [B, N] (columns contiguous; a q or k projection normed whole)."""
        return self.ops.add_rms_norm(x, None, norm.weight, norm.eps, norm.zero_centred)[0]

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V caches [S, KVH, CAP, D]."""
        i = self.pool.index[layer]
        return self.pool.k[i], self.pool.v[i]


def slot_rows(
    cache: torch.Tensor, slots: torch.Tensor, at: torch.Tensor, cols: slice = slice(None)
) -> torch.Tensor:
    """Rows of each row's own slot: cache [S, 1, CAP, W], slots [B] (a padding row's -1 reads slot 0), at
    [B, L] positions (clamped into the slot) -> [B, L, cols]. No host sync."""
    return cache[slots.clamp(min=0).long()[:, None], 0, at.clamp(0, cache.shape[2] - 1), cols]
