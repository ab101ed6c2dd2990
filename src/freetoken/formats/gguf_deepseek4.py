"""DeepSeek-V4 (`deepseek4`) as llama.cpp's converter writes it, read back into the names DeepSeek
publishes (`layers.N.attn.wq_a.weight`, `hc_head_fn`, ...), which the architecture's own naming
(runtime/models/deepseek_v4_names.py) already turns into the model's: the hyper-connections' mixes, the
compressors and the indexer's, the grouped output projection, the token-id routing table (I32) of the
hash-routed layers. Nothing is permuted or rescaled on the way (the converter moves bits only: the
routed experts are MXFP4 blocks, the codec's own); the metadata's V4 fields give the config in the
spelling DeepSeek's files use (per-layer compress ratios, a hash-layer count, a flat yarn rope)."""

from __future__ import annotations

from typing import Any

import torch

ARCHS = ("deepseek4",)
# GGUF layer name -> the published one (after `layers.N.`)
LAYER_NAMES = {
    "hc_attn_fn.weight": "hc_attn_fn",
    "hc_attn_base.weight": "hc_attn_base",
    "hc_attn_scale.weight": "hc_attn_scale",
    "hc_ffn_fn.weight": "hc_ffn_fn",
    "hc_ffn_base.weight": "hc_ffn_base",
    "hc_ffn_scale.weight": "hc_ffn_scale",
    "attn_sinks.weight": "attn.attn_sink",
    "attn_q_a.weight": "attn.wq_a.weight",
    "attn_q_b.weight": "attn.wq_b.weight",
    "attn_q_a_norm.weight": "attn.q_norm.weight",
    "attn_kv.weight": "attn.wkv.weight",
    "attn_kv_a_norm.weight": "attn.kv_norm.weight",
    "attn_output_a.weight": "attn.wo_a.weight",
    "attn_output_b.weight": "attn.wo_b.weight",
    "attn_compressor_ape.weight": "attn.compressor.ape",
    "attn_compressor_kv.weight": "attn.compressor.wkv.weight",
    "attn_compressor_gate.weight": "attn.compressor.wgate.weight",
    "attn_compressor_norm.weight": "attn.compressor.norm.weight",
    "indexer.attn_q_b.weight": "attn.indexer.wq_b.weight",
    "indexer.proj.weight": "attn.indexer.weights_proj.weight",
    "indexer_compressor_ape.weight": "attn.indexer.compressor.ape",
    "indexer_compressor_kv.weight": "attn.indexer.compressor.wkv.weight",
    "indexer_compressor_gate.weight": "attn.indexer.compressor.wgate.weight",
    "indexer_compressor_norm.weight": "attn.indexer.compressor.norm.weight",
    "attn_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "ffn_gate_inp.weight": "ffn.gate.weight",
    "exp_probs_b.bias": "ffn.gate.bias",
    "ffn_gate_tid2eid.weight": "ffn.gate.tid2eid",
    "ffn_gate_shexp.weight": "ffn.shared_experts.w1.weight",
    "ffn_down_shexp.weight": "ffn.shared_experts.w2.weight",
    "ffn_up_shexp.weight": "ffn.shared_experts.w3.weight",
}
GLOBAL_NAMES = {"output_hc_fn.weight": "hc_head_fn", "output_hc_base.weight": "hc_head_base"}
GLOBAL_NAMES["output_hc_scale.weight"] = "hc_head_scale"
# llama.cpp's expert gating function numbers -> V4's scoring_func
SCORING = {1: "softmax", 2: "sigmoid", 4: "sqrtsoftplus"}


def converted(name: str) -> bool:
    """Nothing the converter writes for V4 changed its values or shape."""
    return False


def hf_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    return shape


def from_file(name: str, t: torch.Tensor, fields: dict[str, Any]) -> torch.Tensor:
    return t.float()


def config_fields(get: Any, indexed: set[int]) -> dict[str, Any]:
    """V4's own config fields from the file's `deepseek4.*` metadata (`get(key)`, None where absent);
    `indexed`: the layers that carry an indexer (the compressed-sparse ones, whose ratio is the CSA
    rate; the other compressing layers' ratio the heavily-compressed one)."""
    ratios = [int(r) for r in get("attention.compress_ratios")]
    csa = {ratios[i] for i in indexed if ratios[i]}
    hca = {r for i, r in enumerate(ratios) if r and i not in indexed}
    out: dict[str, Any] = {
        "compress_ratios": ratios,
        "num_hash_layers": int(get("hash_layer_count") or 0),
        "o_groups": get("attention.output_group_count"),
        "o_lora_rank": get("attention.output_lora_rank"),
        "compress_rope_theta": float(get("attention.compress_rope_freq_base")),
        "hc_mult": get("hyper_connection.count"),
        "hc_sinkhorn_iters": get("hyper_connection.sinkhorn_iterations"),
        "hc_eps": float(get("hyper_connection.epsilon")),
        "qk_rope_head_dim": get("rope.dimension_count"),
        "scoring_func": SCORING.get(int(get("expert_gating_func") or 4), "sqrtsoftplus"),
    }
    clamp = get("swiglu_clamp_exp")
    if clamp:
        out["swiglu_limit"] = float(clamp[0])
    if csa:
        out["compress_rate_csa"] = min(csa)
    if hca:
        out["compress_rate_hca"] = max(hca)
    return {k: v for k, v in out.items() if v is not None}
