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
    gguf_naming: ExpertNaming | None = None  # where a GGUF's names need another table (gpt-oss)

    def naming(self, gguf: bool) -> ExpertNaming:
        """The expert-name table for a checkpoint: a GGUF file's, or the safetensors/FTW one."""
        return self.gguf_naming if gguf and self.gguf_naming is not None else self.expert_naming
