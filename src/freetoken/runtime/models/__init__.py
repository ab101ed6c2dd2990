"""Architecture registry: `model_type` -> the module that implements it (imported on first use).

Adding an architecture is one file under this package and one line here.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from freetoken.errors import FreeTokenError

if TYPE_CHECKING:
    from freetoken.runtime.models.base import Architecture

ARCHITECTURES: dict[str, str] = {
    "qwen3_moe": "freetoken.runtime.models.qwen3_moe",
    "qwen3_5_moe_text": "freetoken.runtime.models.qwen3_5_moe",
    "qwen3_5_moe": "freetoken.runtime.models.qwen3_5_moe_vl",
    "qwen3_next": "freetoken.runtime.models.qwen3_next",
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
