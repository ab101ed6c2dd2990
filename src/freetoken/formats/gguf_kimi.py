"""Kimi-Linear (`kimi-linear`) as llama.cpp's converter writes it, read back into transformers' names and
values: its Kimi Delta Attention layers' projections and gates under `ssm_*` names, the convolutions as
[1, C, 1, W], A_log written as −exp(A_log) [1, 1, H, 1], dt_bias as `ssm_dt.bias`; which layers are
latent attention is the per-layer `attention.head_count_kv` (0 on a delta-attention layer). The latent
attention layers, router and experts are deepseek2's (gguf_checkpoint.LAYER_NAMES)."""

from __future__ import annotations

from typing import Any

import torch

ARCHS = ("kimi-linear",)
LAYER_NAMES = {
    "ssm_conv1d_q.weight": "self_attn.q_conv1d.weight",
    "ssm_conv1d_k.weight": "self_attn.k_conv1d.weight",
    "ssm_conv1d_v.weight": "self_attn.v_conv1d.weight",
    "ssm_f_a.weight": "self_attn.f_a_proj.weight",
    "ssm_f_b.weight": "self_attn.f_b_proj.weight",
    "ssm_g_a.weight": "self_attn.g_a_proj.weight",
    "ssm_g_b.weight": "self_attn.g_b_proj.weight",
    "ssm_beta.weight": "self_attn.b_proj.weight",
    "ssm_a": "self_attn.A_log",
    "ssm_dt.bias": "self_attn.dt_bias",
    "ssm_norm.weight": "self_attn.o_norm.weight",
}
_CONVS = ("self_attn.q_conv1d.weight", "self_attn.k_conv1d.weight", "self_attn.v_conv1d.weight")


def converted(name: str) -> bool:
    """Whether reading `name` changes its values or shape (so it is never read as a plain view)."""
    return name.endswith((*_CONVS, "self_attn.A_log"))


def hf_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A convolution [1, C, 1, W] in the file is [C, 1, W]; A_log keeps the file's [1, 1, H, 1]."""
    if name.endswith(_CONVS) and len(shape) == 4:
        return shape[1], 1, shape[3]
    return shape


def from_file(name: str, t: torch.Tensor, fields: dict[str, Any]) -> torch.Tensor:
    """`name`'s values as transformers holds them, from the file's (float32 out)."""
    t = t.float().reshape(hf_shape(name, tuple(t.shape)))
    return torch.log(-t) if name.endswith("self_attn.A_log") else t


def config_fields(head_count_kv: list[int], kda_heads: int) -> dict[str, Any]:
    """Kimi's layer kinds (a latent attention layer has KV heads in the file, a delta one none) and its
    delta attention's head count (from a delta layer's b_proj rows)."""
    kinds = ["full_attention" if n else "linear_attention" for n in head_count_kv]
    return {"layer_types": kinds, "linear_num_heads": kda_heads}
