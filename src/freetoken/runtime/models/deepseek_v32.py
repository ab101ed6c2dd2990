"""DeepSeek-V3.2 (`DeepseekV32ForCausalLM`): DeepSeek-V3 (deepseek_v3.py) whose latent attention keeps, per
query, only the `index_topk` positions its indexer scores highest (dsa.py), with rope on interleaved pairs
always."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from freetoken.formats.tensor_names import QWEN3_MOE_EXPERTS
from freetoken.runtime.config import ModelConfig
from freetoken.runtime.json_keys import POSITIVE_INT, JsonObject
from freetoken.runtime.models import deepseek_v3
from freetoken.runtime.models.base import Architecture
from freetoken.runtime.models.qwen3_moe import Qwen3MoeForCausalLM


def parse_config(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    cfg = JsonObject(raw, source)
    base = deepseek_v3.parse_config(raw, source)
    if not base.q_lora_rank:
        raise cfg.error("q_lora_rank", "missing (the indexer reads the low-rank query)")
    index_head_dim = cfg.get("index_head_dim", POSITIVE_INT, 128)
    if index_head_dim < base.qk_rope_head_dim:
        raise cfg.error("index_head_dim", f"expected at least qk_rope_head_dim={base.qk_rope_head_dim}")
    return replace(
        base,
        architecture="deepseek_v32",
        rope_interleave=True,
        index_n_heads=cfg.get("index_n_heads", POSITIVE_INT, 64),
        index_head_dim=index_head_dim,
        index_topk=cfg.get("index_topk", POSITIVE_INT, 2048),
    )


ARCHITECTURE = Architecture(
    name="deepseek_v32",
    hf_classes=("DeepseekV32ForCausalLM",),
    parse_config=parse_config,
    build_model=Qwen3MoeForCausalLM,
    expert_naming=QWEN3_MOE_EXPERTS,
)
