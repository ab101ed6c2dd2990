"""Write a tiny Qwen3.5-MoE GGUF (`qwen35moe`), or Qwen3-Next (`qwen3next`: its fused in_proj_qkvz split
into q, k, v of every head and z; in_proj_ba as it is; no value-head reorder), from a transformers model
the way llama.cpp's converter does (the test's oracle, written from the converter's rules, independently
of the runtime's reader):
the zero-centred norms as 1 + w, A_log as −exp(A_log), dt_bias as `ssm_dt.bias`, the convolution
squeezed to [C, W], and with fewer key than value heads the value heads tiled (v0 of every key head,
then v1, ...) in in_proj_qkv's value rows, in_proj_z, in_proj_a/b, A_log, dt_bias, the convolution's
value channels and out_proj's columns."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from gguf_fixture import LAYER_NAMES, add_tokenizer, random_blocks

NAMES = {  # transformers name -> GGUF name, per layer
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    **{k: v for k, v in LAYER_NAMES.items() if k.startswith("self_attn.") and k.endswith(".weight")},
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "linear_attn.in_proj_ba.weight": "ssm_ba.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",  # a dense layer (Qwen3-Next's mlp_only_layers)
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}


def tiled(a: np.ndarray, axis: int, key_heads: int, per_key: int, head_dim: int) -> np.ndarray:
    """Value heads along `axis` from grouped by key head to tiled (the converter's reorder)."""
    shape = a.shape
    a = a.reshape(*shape[:axis], key_heads, per_key, head_dim, *shape[axis + 1 :])
    return np.swapaxes(a, axis, axis + 1).reshape(shape)


def split_qkvz(a: np.ndarray, cfg: Any) -> tuple[np.ndarray, np.ndarray]:
    """Qwen3-Next's in_proj_qkvz (per key head: q, k, its value heads' v, their z) -> (q, k, v of every
    head; z), as the converter writes attn_qkv and attn_gate."""
    nk, r = cfg.linear_num_key_heads, cfg.linear_num_value_heads // cfg.linear_num_key_heads
    dk, rv = cfg.linear_key_head_dim, r * cfg.linear_value_head_dim
    per_head = a.reshape(nk, 2 * dk + 2 * rv, -1)
    q, k, v, z = np.split(per_head, [dk, 2 * dk, 2 * dk + rv], axis=1)
    return np.concatenate([part.reshape(-1, a.shape[-1]) for part in (q, k, v)]), z.reshape(-1, a.shape[-1])


def converted(name: str, a: np.ndarray, cfg: Any, tiles: bool = True) -> np.ndarray:
    """A transformers tensor as the converter writes it (`tiles`: qwen35moe's value-head reorder)."""
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, nv // nk
    qk = 2 * nk * dk
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return a + 1.0
    if name.endswith("conv1d.weight"):
        a = a.reshape(a.shape[0], -1)
    if nk != nv and tiles:
        if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
            a = np.concatenate([a[:qk], tiled(a[qk:], 0, nk, r, dv)])
        elif name.endswith("in_proj_z.weight"):
            a = tiled(a, 0, nk, r, dv)
        elif name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
            a = tiled(a, 0, nk, r, 1)
        elif name.endswith("out_proj.weight"):
            a = tiled(a, 1, nk, r, dv)
    if name.endswith("A_log"):
        return -np.exp(a)
    return a


def write_qwen35_gguf(
    hf: Any,
    folder: Path,
    path: Path,
    expert_types: tuple[str, str] | None = None,
    recurrent_layers: bool = False,
    arch: str = "qwen35moe",
) -> Path:
    """hf: a Qwen3_5MoeForCausalLM; folder: where its tokenizer files are. Everything in F32, or with
    `expert_types` (gate/up type, down type) the routed experts as random raw blocks of those types;
    layer kinds as full_attention_interval, or with `recurrent_layers` as newer files list them."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    cfg = hf.config
    interval = next(i for i, kind in enumerate(cfg.layer_types) if kind == "full_attention") + 1
    assert all(
        (kind == "full_attention") == ((i + 1) % interval == 0) for i, kind in enumerate(cfg.layer_types)
    )
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    if getattr(cfg, "intermediate_size", None):  # a dense layer's size, as the converter writes it
        w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_dimension_count(int(cfg.head_dim * rope.get("partial_rotary_factor", 0.25)))
    w.add_rope_dimension_sections([11, 11, 10, 0])
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    w.add_ssm_state_size(cfg.linear_key_head_dim)
    w.add_ssm_group_count(cfg.linear_num_key_heads)
    w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    w.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    if recurrent_layers:
        w.add_array(
            "qwen35moe.attention.recurrent_layers", [k == "linear_attention" for k in cfg.layer_types]
        )
    else:
        w.add_full_attention_interval(interval)
    add_tokenizer(w, folder, "qwen35" if arch == "qwen35moe" else "qwen2")

    def add(name: str, a: np.ndarray) -> None:
        w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))

    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    add("token_embd.weight", sd["model.embed_tokens.weight"])
    add("output_norm.weight", sd["model.norm.weight"] + 1.0)
    add("output.weight", sd["lm_head.weight"])
    e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    for layer in range(cfg.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        for hf_name, g_name in NAMES.items():
            if prefix + hf_name in sd:
                add(
                    f"blk.{layer}.{g_name}",
                    converted(hf_name, sd[prefix + hf_name], cfg, arch == "qwen35moe"),
                )
        if prefix + "linear_attn.in_proj_qkvz.weight" in sd:
            qkv, z = split_qkvz(sd[prefix + "linear_attn.in_proj_qkvz.weight"], cfg)
            add(f"blk.{layer}.attn_qkv.weight", qkv)
            add(f"blk.{layer}.attn_gate.weight", z)
        if prefix + "mlp.experts.gate_up_proj" not in sd:
            continue  # a dense layer
        if expert_types is not None:
            for n, (part, shape, kind) in enumerate(
                (("gate", (e, i, h), expert_types[0]), ("up", (e, i, h), expert_types[0]),
                 ("down", (e, h, i), expert_types[1]))
            ):  # fmt: skip
                raw = random_blocks(kind, shape, seed=10 * layer + n)
                w.add_tensor(f"blk.{layer}.ffn_{part}_exps.weight", raw, raw_dtype=Q[kind])
            continue
        gate_up = sd[prefix + "mlp.experts.gate_up_proj"]  # [E, 2I, H]
        add(f"blk.{layer}.ffn_gate_exps.weight", gate_up[:, :i])
        add(f"blk.{layer}.ffn_up_exps.weight", gate_up[:, i:])
        add(f"blk.{layer}.ffn_down_exps.weight", sd[prefix + "mlp.experts.down_proj"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
