"""DeepSeek-V3/R1 and Kimi-K2 (`DeepseekV3ForCausalLM`): multi-head latent attention (mla.py: q through an
optional low-rank projection, keys and values from one cached latent per position, rope on interleaved
pairs, yarn's mscale folded into the softmax scale), and GLM-4.5's MoE: the first `first_k_dense_replace`
layers dense, a sigmoid router choosing by score plus a correction bias within the best `topk_group` of
`n_group` groups, weights renormalised and scaled by `routed_scaling_factor`, beside `n_shared_experts`
always-computed shared experts. Decoding runs eagerly (the latent attention's absorbed form). The
multi-token-prediction layers published checkpoints carry after the trunk (`num_nextn_predict_layers`) are
skipped."""

from __future__ import annotations

from typing import Any

from freetoken.formats.tensor_names import QWEN3_MOE_EXPERTS
from freetoken.runtime.config import ModelConfig
from freetoken.runtime.json_keys import BOOL, COUNT, POSITIVE, POSITIVE_INT, JsonObject, Kind
from freetoken.runtime.models.base import Architecture
from freetoken.runtime.models.qwen3_moe import Qwen3MoeForCausalLM, check_dense_layers, decoder_fields

MLP_LAYER_TYPES = Kind(
    'a list of "dense" or "sparse"',
    lambda v: isinstance(v, list) and all(k in ("dense", "sparse") for k in v),
)


def parse_config(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    cfg = JsonObject(raw, source)
    fields = decoder_fields(raw, source)
    experts = fields["num_experts"]
    groups = cfg.get("n_group", POSITIVE_INT, 1)
    if experts % groups:
        raise cfg.error("n_group", f"{experts} experts do not split into {groups} groups")
    topk_group = cfg.get("topk_group", POSITIVE_INT, 1)
    if topk_group > groups:
        raise cfg.error("topk_group", f"expected at most n_group={groups}, got {topk_group}")
    rope_dim = cfg.get("qk_rope_head_dim", POSITIVE_INT)
    if rope_dim % 2:
        raise cfg.error("qk_rope_head_dim", f"expected an even number, got {rope_dim}")
    nope = cfg.get("qk_nope_head_dim", POSITIVE_INT)
    fields.update(head_dim=nope + rope_dim, num_kv_heads=fields["num_heads"])
    dense_layers = tuple(range(min(cfg.get("first_k_dense_replace", COUNT, 0), fields["num_layers"])))
    kinds = cfg.get("mlp_layer_types", MLP_LAYER_TYPES, None)  # newer configs spell it per layer
    if kinds is not None:
        if len(kinds) != fields["num_layers"]:
            raise cfg.error("mlp_layer_types", f"expected {fields['num_layers']} entries, got {len(kinds)}")
        dense_layers = tuple(i for i, kind in enumerate(kinds) if kind == "dense")
    model = ModelConfig(
        architecture="deepseek_v3",
        raw=raw,
        intermediate_size=cfg.get("intermediate_size", COUNT, 0),
        norm_topk_prob=cfg.get("norm_topk_prob", BOOL, True),
        mlp_only_layers=dense_layers,
        qk_norm="none",
        router_scoring="sigmoid",
        n_group=groups,
        topk_group=topk_group,
        routed_scaling_factor=cfg.get("routed_scaling_factor", POSITIVE, 1.0),
        n_shared_experts=cfg.get("n_shared_experts", COUNT, 0),
        q_lora_rank=cfg.get("q_lora_rank", POSITIVE_INT, None),
        kv_lora_rank=cfg.get("kv_lora_rank", POSITIVE_INT),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=cfg.get("v_head_dim", POSITIVE_INT),
        rope_interleave=cfg.get("rope_interleave", BOOL, True),
        **fields,
    )
    return check_dense_layers(model, source)


ARCHITECTURE = Architecture(
    name="deepseek_v3",
    hf_classes=("DeepseekV3ForCausalLM",),
    parse_config=parse_config,
    build_model=Qwen3MoeForCausalLM,
    expert_naming=QWEN3_MOE_EXPERTS,
)
