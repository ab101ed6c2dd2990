"""Mixtral (`MixtralForCausalLM`): Qwen3-MoE's layers without q/k norms; softmax over the experts, top-k,
weights renormalised (as Qwen3's norm_topk_prob); every layer MoE; with `sliding_window`, every layer's
queries see that many keys. Checkpoints name experts `block_sparse_moe.experts.{e}.w1/w3/w2` (gate/up/down);
llama.cpp stores Mixtral as its `llama` arch with whole-layer banks (formats/gguf_meta.py). Decoding runs
over the static KV pool (models/slot_decode.py: no q/k norm, the window in the attention kernel)."""

from __future__ import annotations

from typing import Any

from freetoken.formats.tensor_names import MIXTRAL_EXPERTS, QWEN3_MOE_EXPERTS
from freetoken.runtime.config import ModelConfig
from freetoken.runtime.json_keys import POSITIVE_INT, JsonObject
from freetoken.runtime.models.base import Architecture
from freetoken.runtime.models.qwen3_moe import Qwen3MoeForCausalLM, decoder_fields


def parse_config(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    cfg = JsonObject(raw, source)
    fields = decoder_fields(raw, source, expert_size="intermediate_size")
    window = cfg.get("sliding_window", POSITIVE_INT, None)
    if window is not None and window < fields["max_position_embeddings"]:
        fields.update(sliding_window=window, sliding_layers=tuple(range(fields["num_layers"])))
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
    gguf_naming=QWEN3_MOE_EXPERTS,  # formats/gguf_checkpoint.py's names
)
