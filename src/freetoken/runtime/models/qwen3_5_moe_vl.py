"""Qwen3.5/3.6-MoE as published (`Qwen3_5MoeForConditionalGeneration`, model_type `qwen3_5_moe`): its
text model, read from the wrapper. The config nests the text model under `text_config`; the weights live
under `model.language_model.` (the vision tower and the multi-token-prediction head are not loaded).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from freetoken.errors import FreeTokenError
from freetoken.formats.tensor_names import QWEN3_5_MOE_WRAPPED
from freetoken.runtime.config import ModelConfig
from freetoken.runtime.models import qwen3_5_moe
from freetoken.runtime.models.base import Architecture


def parse_config(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise FreeTokenError(f"{source}: model_type qwen3_5_moe needs a 'text_config' object")
    inherited = {
        k: raw[k] for k in ("eos_token_id", "tie_word_embeddings", "dtype") if k in raw and k not in text
    }
    cfg = qwen3_5_moe.parse_config({**text, **inherited}, f"{source} (text_config)")
    return replace(cfg, architecture="qwen3_5_moe")


ARCHITECTURE = Architecture(
    name="qwen3_5_moe",
    hf_classes=("Qwen3_5MoeForConditionalGeneration",),
    parse_config=parse_config,
    build_model=qwen3_5_moe.Qwen3_5MoeForCausalLM,
    expert_naming=QWEN3_5_MOE_WRAPPED,
)
