"""Architecture registry: `model_type` -> the module that implements it (imported on first use), and
config.json parsed through it.

Adding an architecture is one file under this package and one line here.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from freetoken.errors import FreeTokenError
from freetoken.runtime.config import ModelConfig
from freetoken.runtime.json_keys import TEXT, JsonObject, read_json

if TYPE_CHECKING:
    from freetoken.runtime.models.base import Architecture

ARCHITECTURES: dict[str, str] = {
    "qwen3_moe": "freetoken.runtime.models.qwen3_moe",
    "qwen3_5_moe_text": "freetoken.runtime.models.qwen3_5_moe",
    "qwen3_5_moe": "freetoken.runtime.models.qwen3_5_moe_vl",
    "qwen3_next": "freetoken.runtime.models.qwen3_next",
    "mixtral": "freetoken.runtime.models.mixtral",
    "olmoe": "freetoken.runtime.models.olmoe",
    "glm4_moe": "freetoken.runtime.models.glm4_moe",
    "minimax_m2": "freetoken.runtime.models.minimax_m2",
    "gpt_oss": "freetoken.runtime.models.gpt_oss",
    "deepseek_v3": "freetoken.runtime.models.deepseek_v3",
    "deepseek_v32": "freetoken.runtime.models.deepseek_v32",
    "deepseek_v4": "freetoken.runtime.models.deepseek_v4",
    "glm_moe_dsa": "freetoken.runtime.models.glm_moe_dsa",
    "kimi_linear": "freetoken.runtime.models.kimi_linear",
}


def supported_architectures() -> tuple[str, ...]:
    return tuple(sorted(ARCHITECTURES))


def get_architecture(model_type: str) -> Architecture:
    module_name = ARCHITECTURES.get(model_type)
    if module_name is None:
        raise FreeTokenError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(supported_architectures())}"
        )
    return importlib.import_module(module_name).ARCHITECTURE


def model_config_from(raw: dict[str, Any], source: str) -> ModelConfig:
    """Parse a config.json object (already read from `source`) through the architecture registry."""
    model_type = JsonObject(raw, source).get("model_type", TEXT)
    return get_architecture(model_type).parse_config(raw, source)


def load_model_config(model_dir: Path) -> ModelConfig:
    """Parse `config.json` of a model folder through the architecture registry."""
    path = Path(model_dir) / "config.json"
    return model_config_from(read_json(path), str(path))
