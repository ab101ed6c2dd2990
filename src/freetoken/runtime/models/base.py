"""What an architecture module provides to the rest of the runtime."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from freetoken.formats.tensor_names import ExpertNaming
from freetoken.runtime.config import ModelConfig


@dataclass(frozen=True)
class Architecture:
    """One registry entry: parse its config, build its modules, name its checkpoint tensors."""

    name: str
    hf_classes: tuple[str, ...]
    parse_config: Callable[[dict[str, Any], str], ModelConfig]
    build_model: Callable[[ModelConfig], nn.Module]
    expert_naming: ExpertNaming
