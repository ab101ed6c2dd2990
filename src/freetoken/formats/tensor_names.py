"""Tensor-name tables: which checkpoint tensors are experts, and where in the pool they go."""

from __future__ import annotations

import re
from dataclasses import dataclass

# Pool parts: `gate_up` [E, 2I, H] holds gate rows first, then up rows; `down` [E, H, I].
PER_EXPERT_PARTS = ("gate", "up", "down")
FUSED_PARTS = ("gate_up", "gate", "up", "down")  # whole-layer banks; GGUF stores gate and up apart


@dataclass(frozen=True)
class ExpertTensor:
    """One checkpoint tensor that belongs in the host expert pool."""

    layer: int
    expert: int | None  # None: the tensor holds every expert of the layer
    part: str  # one of PER_EXPERT_PARTS, or FUSED_PARTS when expert is None


@dataclass(frozen=True)
class ExpertNaming:
    """How an architecture names expert tensors: one by one (as HF saves them) or fused per layer."""

    per_expert: re.Pattern[str]  # groups: layer, expert, projection name
    fused: re.Pattern[str] | None  # groups: layer, projection name
    projection_parts: dict[str, str]  # checkpoint projection name -> pool part

    def classify(self, name: str) -> ExpertTensor | None:
        match = self.per_expert.fullmatch(name)
        if match:
            layer, expert, proj = match.groups()
            return ExpertTensor(int(layer), int(expert), self.projection_parts[proj])
        if self.fused is not None:
            match = self.fused.fullmatch(name)
            if match:
                layer, proj = match.groups()
                return ExpertTensor(int(layer), None, self.projection_parts[proj])
        return None


QWEN3_MOE_EXPERTS = ExpertNaming(
    per_expert=re.compile(
        r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight"
    ),
    fused=re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|gate_proj|up_proj|down_proj)"),
    projection_parts={"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "gate_up_proj": "gate_up"},
)
