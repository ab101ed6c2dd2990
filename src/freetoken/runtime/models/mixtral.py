"""Mixtral (`MixtralForCausalLM`): Qwen3-MoE's layers without q/k norms; softmax over the experts, top-k,
weights renormalised (as Qwen3's norm_topk_prob); every layer MoE. Checkpoints name experts
`block_sparse_moe.experts.{e}.w1/w3/w2` (gate/up/down). Decoding runs eagerly (no per-head q/k norm for
the slot-decode kernels)."""

from __future__ import annotations

from typing import Any

from freetoken.errors import FreeTokenError
from freetoken.formats.tensor_names import MIXTRAL_EXPERTS
from freetoken.runtime.config import ModelConfig
from freetoken.runtime.json_keys import POSITIVE_INT, JsonObject
from freetoken.runtime.models.base import Architecture
from freetoken.runtime.models.qwen3_moe import Qwen3MoeForCausalLM, decoder_fields


def parse_config(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    cfg = JsonObject(raw, source)
    fields = decoder_fields(raw, source, expert_size="intermediate_size")
    window = raw.get("sliding_window")
    if window is not None and cfg.get("sliding_window", POSITIVE_INT) < fields["max_position_embeddings"]:
        raise FreeTokenError(
            f"{source}: 'sliding_window' {window}: sliding-window attention is not supported yet"
        )
    return ModelConfig(
        architecture="mixtral",
        raw=raw,
        intermediate_size=0,
        norm_topk_prob=True,
        qk_norm="none",
        **fields,
    )


ARCHITECTURE = Architecture(
    name="mixtral",
    hf_classes=("MixtralForCausalLM",),
    parse_config=parse_config,
    build_model=Qwen3MoeForCausalLM,
    expert_naming=MIXTRAL_EXPERTS,
)
