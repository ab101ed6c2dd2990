"""MiniMax-M2 (`MiniMaxM2ForCausalLM`): Qwen3-MoE's layers with q and k RMS-normed over the whole
projection, rope on the first `rotary_dim` of each head (the Hub's key; or rope_parameters'
partial_rotary_factor), and a sigmoid router: experts chosen by score plus a learned correction bias,
weighted by their scores renormalised; every layer MoE, Mixtral's checkpoint names
(`block_sparse_moe.experts.{e}.w1/w3/w2`, `block_sparse_moe.gate`) and the bias beside them
(`block_sparse_moe.e_score_correction_bias`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from freetoken.formats.tensor_names import MINIMAX_M2_EXPERTS
from freetoken.runtime.config import ModelConfig
from freetoken.runtime.json_keys import POSITIVE_INT, JsonObject
from freetoken.runtime.models.base import Architecture
from freetoken.runtime.models.qwen3_moe import Qwen3MoeForCausalLM, decoder_fields


def parse_config(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    cfg = JsonObject(raw, source)
    fields = decoder_fields(raw, source, expert_size="intermediate_size")
    if raw.get("rotary_dim") is not None and fields["rope"].partial_rotary_factor == 1.0:
        rotary = cfg.get("rotary_dim", POSITIVE_INT)
        if rotary > fields["head_dim"] or rotary % 2:
            raise cfg.error(
                "rotary_dim", f"expected an even number up to head_dim={fields['head_dim']}, got {rotary}"
            )
        fields["rope"] = replace(fields["rope"], partial_rotary_factor=rotary / fields["head_dim"])
    return ModelConfig(
        architecture="minimax_m2",
        raw=raw,
        intermediate_size=0,
        norm_topk_prob=True,
        qk_norm="full",
        router_scoring="sigmoid",
        **fields,
    )


ARCHITECTURE = Architecture(
    name="minimax_m2",
    hf_classes=("MiniMaxM2ForCausalLM",),
    parse_config=parse_config,
    build_model=Qwen3MoeForCausalLM,
    expert_naming=MINIMAX_M2_EXPERTS,
)
