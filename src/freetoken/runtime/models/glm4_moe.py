"""GLM-4.5/4.6/4.7 (`Glm4MoeForCausalLM`): Qwen3-MoE's layers with q/k/v biases but none on the output
projection, optional per-head q/k norms (`use_qk_norm`), rope on the first `partial_rotary_factor` of each
head, the first `first_k_dense_replace` layers dense, and a sigmoid router: experts chosen by score plus a
learned correction bias within the best `topk_group` of `n_group` groups, weighted by their scores
(renormalised if `norm_topk_prob`) times `routed_scaling_factor`, beside `n_shared_experts` always-computed
shared experts. The multi-token-prediction layers some checkpoints carry
(`num_nextn_predict_layers`) are skipped."""

from __future__ import annotations

from typing import Any

from freetoken.formats.tensor_names import QWEN3_MOE_EXPERTS
from freetoken.runtime.config import ModelConfig
from freetoken.runtime.json_keys import BOOL, COUNT, JsonObject
from freetoken.runtime.models.base import Architecture
from freetoken.runtime.models.config_fields import grouped_router_fields
from freetoken.runtime.models.qwen3_moe import Qwen3MoeForCausalLM, check_dense_layers, decoder_fields


def parse_config(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    cfg = JsonObject(raw, source)
    fields = decoder_fields(raw, source)
    dense = cfg.get("first_k_dense_replace", COUNT, 0)
    model = ModelConfig(
        architecture="glm4_moe",
        raw=raw,
        intermediate_size=cfg.get("intermediate_size", COUNT, 0),
        mlp_only_layers=tuple(range(min(dense, fields["num_layers"]))),
        qk_norm="head" if cfg.get("use_qk_norm", BOOL, False) else "none",
        o_proj_bias=False,
        **grouped_router_fields(cfg, fields["num_experts"]),
        **fields,
    )
    return check_dense_layers(model, source)


ARCHITECTURE = Architecture(
    name="glm4_moe",
    hf_classes=("Glm4MoeForCausalLM",),
    parse_config=parse_config,
    build_model=Qwen3MoeForCausalLM,
    expert_naming=QWEN3_MOE_EXPERTS,
)
