"""GLM-5 (`GlmMoeDsaForCausalLM`): DeepSeek-V3.2's layers (deepseek_v32.py) whose indexer ropes interleaved
pairs, and whose layers marked "shared" in `indexer_types` run no indexer but reuse the choice of the last
indexing layer before them (dsa.py)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from freetoken.formats.tensor_names import QWEN3_MOE_EXPERTS
from freetoken.runtime.config import ModelConfig
from freetoken.runtime.json_keys import COUNT, POSITIVE_INT, JsonObject, Kind
from freetoken.runtime.models import deepseek_v32
from freetoken.runtime.models.base import Architecture
from freetoken.runtime.models.qwen3_moe import Qwen3MoeForCausalLM

INDEXER_TYPES = Kind(
    'a list of "full" or "shared"', lambda v: isinstance(v, list) and set(v) <= {"full", "shared"}
)


def indexer_types(raw: dict[str, Any], layers: int, source: str) -> list[str]:
    """Per layer "full" or "shared": as given, else from `index_topk_pattern` ("FSSF..."), else from
    `index_topk_freq` and `index_skip_topk_offset` (transformers' defaults: every layer full)."""
    cfg = JsonObject(raw, source)
    kinds = cfg.get("indexer_types", INDEXER_TYPES, None)
    pattern = raw.get("index_topk_pattern")
    if kinds is None and isinstance(pattern, str):
        if set(pattern) - {"F", "S"}:
            raise cfg.error("index_topk_pattern", f'expected letters "F" and "S", got {pattern!r}')
        kinds = ["full" if c == "F" else "shared" for c in pattern]
    if kinds is None:
        freq = cfg.get("index_topk_freq", POSITIVE_INT, 1)
        offset = cfg.get("index_skip_topk_offset", COUNT, 2)
        kinds = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]
    if len(kinds) != layers or (kinds and kinds[0] != "full"):
        raise cfg.error("indexer_types", f"expected {layers} entries, the first one full")
    return kinds


def parse_config(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    base = deepseek_v32.parse_config(raw, source)
    kinds = indexer_types(raw, base.num_layers, source)
    return replace(
        base,
        architecture="glm_moe_dsa",
        index_rope_interleave=True,
        indexer_shared_layers=tuple(i for i, kind in enumerate(kinds) if kind == "shared"),
    )


ARCHITECTURE = Architecture(
    name="glm_moe_dsa",
    hf_classes=("GlmMoeDsaForCausalLM",),
    parse_config=parse_config,
    build_model=Qwen3MoeForCausalLM,
    expert_naming=QWEN3_MOE_EXPERTS,
)
