"""DeepSeek-V3/R1 and Kimi-K2 (`DeepseekV3ForCausalLM`): multi-head latent attention (mla.py: q through an
optional low-rank projection, keys and values from one cached latent per position, rope on interleaved
pairs, yarn's mscale folded into the softmax scale), and GLM-4.5's MoE: the first `first_k_dense_replace`
layers dense, a sigmoid router choosing by score plus a correction bias within the best `topk_group` of
`n_group` groups, weights renormalised and scaled by `routed_scaling_factor`, beside `n_shared_experts`
always-computed shared experts. Decoding runs over the static KV pool (models/latent_decode.py: the latent
attention's absorbed form). The multi-token-prediction layers published checkpoints carry after the trunk
(`num_nextn_predict_layers`) are skipped."""

from __future__ import annotations

from typing import Any

from freetoken.formats.tensor_names import QWEN3_MOE_EXPERTS
from freetoken.runtime.config import ModelConfig
from freetoken.runtime.json_keys import BOOL, COUNT, JsonObject
from freetoken.runtime.models.base import Architecture
from freetoken.runtime.models.config_fields import (
    dense_layers,
    grouped_router_fields,
    latent_attention_fields,
)
from freetoken.runtime.models.qwen3_moe import Qwen3MoeForCausalLM, check_dense_layers, decoder_fields


def parse_config(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    cfg = JsonObject(raw, source)
    fields = decoder_fields(raw, source)
    fields.update(latent_attention_fields(cfg, fields["num_heads"]))
    model = ModelConfig(
        architecture="deepseek_v3",
        raw=raw,
        intermediate_size=cfg.get("intermediate_size", COUNT, 0),
        mlp_only_layers=dense_layers(cfg, fields["num_layers"]),
        qk_norm="none",
        rope_interleave=cfg.get("rope_interleave", BOOL, True),
        **grouped_router_fields(cfg, fields["num_experts"]),
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
