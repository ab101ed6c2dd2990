"""Qwen3.5/3.6 MoE (`qwen35moe`) and Qwen3-Next (`qwen3next`) as llama.cpp's converter writes them, read
back into transformers' names and values.

The converter changes some of the hybrid layers' tensors on the way out; reading undoes each:
- the zero-centred norms (every RMS norm but the DeltaNet's gated one) are written as 1 + w;
- a DeltaNet layer's A_log is written as −exp(A_log) (`ssm_a`), its dt_bias as `ssm_dt.bias`, its
  convolution [C, 1, W] squeezed to [C, W];
- qwen35moe, where a layer has fewer key heads than value heads: the value heads are reordered from
  grouped by key head (k0's v0..v{r−1}, k1's ...) to tiled (v0 of every key head, then v1, ...), along
  the value rows of in_proj_qkv, in_proj_z, in_proj_a, in_proj_b, the convolution's value channels,
  A_log and dt_bias, and along out_proj's columns;
- qwen3next: its fused in_proj_qkvz (per key head: q, k, its value heads' v, then their z) is written as
  q, k, v of every head (`attn_qkv`) and z (`attn_gate`); reading joins them back (join_qkvz).
Experts are whole-layer banks as in every other arch (and keep their codec as stored).
"""

from __future__ import annotations

from typing import Any

import torch

ARCHS = ("qwen35moe", "qwen3next")
QKV, Z = "linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight"
QKVZ = "linear_attn.in_proj_qkvz.weight"
# GGUF name -> HF name, per layer, where these archs' differ from (or add to) gguf_checkpoint.LAYER_NAMES
# (qwen3next's attn_qkv and attn_gate are the two halves of its in_proj_qkvz)
LAYER_NAMES = {
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_a": "linear_attn.A_log",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    "ssm_ba.weight": "linear_attn.in_proj_ba.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}
_SHIFTED_NORMS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "model.norm.weight",
)
_REORDERED = (
    "linear_attn.in_proj_qkv.weight",
    "linear_attn.in_proj_z.weight",
    "linear_attn.in_proj_a.weight",
    "linear_attn.in_proj_b.weight",
    "linear_attn.A_log",
    "linear_attn.dt_bias",
    "linear_attn.conv1d.weight",
    "linear_attn.out_proj.weight",
)


def converted(name: str) -> bool:
    """Whether reading `name` changes its values, order or shape (so it is never read as a plain view)."""
    return name.endswith((*_SHIFTED_NORMS, *_REORDERED, "mlp.shared_expert_gate.weight"))


def hf_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A tensor's HF shape from the file's: the convolution [C, W] is [C, 1, W]; the shared experts' gate
    [H] (a vector in the file) [1, H]."""
    if name.endswith("linear_attn.conv1d.weight") and len(shape) == 2:
        return shape[0], 1, shape[1]
    if name.endswith("mlp.shared_expert_gate.weight") and len(shape) == 1:
        return 1, shape[0]
    return shape


def _heads(fields: dict[str, Any]) -> tuple[int, int, int, int]:
    """(key heads, value heads, key dims, value dims) of the DeltaNet layers."""
    arch = fields["general.architecture"]
    nk, nv = int(fields[f"{arch}.ssm.group_count"]), int(fields[f"{arch}.ssm.time_step_rank"])
    return nk, nv, int(fields[f"{arch}.ssm.state_size"]), int(fields[f"{arch}.ssm.inner_size"]) // nv


def join_qkvz(qkv: torch.Tensor, z: torch.Tensor, fields: dict[str, Any]) -> torch.Tensor:
    """qwen3next's in_proj_qkvz [Hk·(2 Dk + 2 r Dv), H] from the file's q, k, v of every head and z."""
    nk, nv, dk, dv = _heads(fields)
    h, rv = qkv.shape[-1], nv // nk * dv
    q, k, v = (part.reshape(nk, -1, h) for part in qkv.float().split([nk * dk, nk * dk, nk * rv]))
    return torch.cat((q, k, v, z.float().reshape(nk, rv, h)), dim=1).reshape(-1, h)


def _grouped(t: torch.Tensor, dim: int, key_heads: int, per_key: int, head_dim: int) -> torch.Tensor:
    """Value heads along `dim` from the file's tiled order back to grouped by key head."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], per_key, key_heads, head_dim, *shape[dim + 1 :])
    return t.transpose(dim, dim + 1).reshape(shape)


def from_file(name: str, t: torch.Tensor, fields: dict[str, Any]) -> torch.Tensor:
    """`name`'s values as transformers holds them, from the file's (float32 or bf16 in, float32 out)."""
    t = t.float().reshape(hf_shape(name, tuple(t.shape)))
    if name.endswith(_SHIFTED_NORMS):
        return t - 1.0
    if name.endswith("linear_attn.A_log"):
        t = torch.log(-t)
    arch = fields["general.architecture"]
    nk, nv, dk, dv = _heads(fields)
    if arch != "qwen35moe" or nk == nv or not name.endswith(_REORDERED):
        return t
    r = nv // nk
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):  # the value rows after q's and k's
        qk = 2 * nk * dk
        return torch.cat((t[:qk], _grouped(t[qk:], 0, nk, r, dv)))
    if name.endswith("in_proj_z.weight"):
        return _grouped(t, 0, nk, r, dv)
    if name.endswith("out_proj.weight"):
        return _grouped(t, 1, nk, r, dv)
    return _grouped(t, 0, nk, r, 1)  # in_proj_a / in_proj_b rows, A_log, dt_bias: a value head each
