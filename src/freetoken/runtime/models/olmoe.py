"""OLMoE (`OlmoeForCausalLM`): Qwen3-MoE's layers with q and k RMS-normed over the whole projection
(before the heads are split), an optional clamp of the q/k/v projections (`clip_qkv`), top-k weights not
renormalised unless `norm_topk_prob`; every layer MoE."""

from __future__ import annotations

from typing import Any

from freetoken.formats.tensor_names import QWEN3_MOE_EXPERTS
from freetoken.runtime.config import ModelConfig
from freetoken.runtime.json_keys import BOOL, POSITIVE, JsonObject
from freetoken.runtime.models.base import Architecture
from freetoken.runtime.models.qwen3_moe import Qwen3MoeForCausalLM, decoder_fields


def parse_config(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    cfg = JsonObject(raw, source)
    clip = cfg.get("clip_qkv", POSITIVE) if raw.get("clip_qkv") is not None else None
    return ModelConfig(
        architecture="olmoe",
        raw=raw,
        intermediate_size=0,
        norm_topk_prob=cfg.get("norm_topk_prob", BOOL, False),
        qk_norm="full",
        clip_qkv=clip,
        **decoder_fields(raw, source, expert_size="intermediate_size"),
    )


ARCHITECTURE = Architecture(
    name="olmoe",
    hf_classes=("OlmoeForCausalLM",),
    parse_config=parse_config,
    build_model=Qwen3MoeForCausalLM,
    expert_naming=QWEN3_MOE_EXPERTS,
)
