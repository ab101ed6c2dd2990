"""Tensor-name tables: which checkpoint tensors are experts, and where in the pool they go."""

from __future__ import annotations

import re
from dataclasses import dataclass

# Pool parts: `gate_up` [E, 2I, H] holds gate rows first, then up rows; `down` [E, H, I].
PER_EXPERT_PARTS = ("gate", "up", "down")
FUSED_PARTS = ("gate_up", "gate", "up", "down")  # whole-layer banks; GGUF stores gate and up apart
# experts' biases (gpt-oss): beside the banks, gate_up_bias [E, 2I] and down_bias [E, H]
BIAS_PARTS = ("gate_up_bias", "gate_bias", "up_bias", "down_bias")
# how a checkpoint lays a part out: "rows" as the pool ([E, out, in], gate rows before up rows), or gpt-oss's
# "interleaved_in_out" ([E, in, out], gate and up columns alternating)
LAYOUTS = ("rows", "interleaved_in_out")


@dataclass(frozen=True)
class ExpertTensor:
    """One checkpoint tensor that belongs in the host expert pool."""

    layer: int
    expert: int | None  # None: the tensor holds every expert of the layer
    part: str  # one of PER_EXPERT_PARTS, or FUSED_PARTS when expert is None, or BIAS_PARTS
    layout: str = "rows"  # one of LAYOUTS


@dataclass(frozen=True)
class ExpertNaming:
    """How an architecture names expert tensors: one by one (as HF saves them) or fused per layer."""

    per_expert: re.Pattern[str]  # groups: layer, expert, projection name
    fused: re.Pattern[str] | None  # groups: layer, projection name
    projection_parts: dict[str, str]  # checkpoint projection name -> pool part
    # checkpoint prefix -> the model's (a text model saved inside a multimodal wrapper); prefixes skipped
    renames: tuple[tuple[str, str], ...] = ()
    ignored: tuple[str, ...] = ()
    # inner renames (pattern, replacement), after the prefixes: e.g. Mixtral's router `block_sparse_moe.gate`
    rewrites: tuple[tuple[re.Pattern[str], str], ...] = ()
    layouts: dict[str, str] | None = None  # checkpoint projection name -> its layout, where not "rows"

    def canonical(self, name: str) -> str | None:
        """The model's name for checkpoint tensor `name`, or None for a tensor this model does not use."""
        if name.startswith(self.ignored):
            return None
        for old, new in self.renames:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        for pattern, replacement in self.rewrites:
            name = pattern.sub(replacement, name)
        return name

    def classify(self, name: str) -> ExpertTensor | None:
        match = self.per_expert.fullmatch(name)
        if match:
            layer, expert, proj = match.groups()
            return ExpertTensor(int(layer), int(expert), self.projection_parts[proj])
        if self.fused is not None:
            match = self.fused.fullmatch(name)
            if match:
                layer, proj = match.groups()
                layout = (self.layouts or {}).get(proj, "rows")
                return ExpertTensor(int(layer), None, self.projection_parts[proj], layout)
        return None


QWEN3_MOE_EXPERTS = ExpertNaming(
    per_expert=re.compile(
        r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight"
    ),
    fused=re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|gate_proj|up_proj|down_proj)"),
    projection_parts={"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "gate_up_proj": "gate_up"},
)

# Mixtral as published: experts w1 (gate), w3 (up), w2 (down) under `block_sparse_moe`, and its router
MIXTRAL_EXPERTS = ExpertNaming(
    per_expert=re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight"),
    fused=None,
    projection_parts={"w1": "gate", "w3": "up", "w2": "down"},
    rewrites=((re.compile(r"\.block_sparse_moe\.gate\."), ".mlp.gate."),),
)

# MiniMax-M2 as published: Mixtral's expert and router names, and the router's correction bias beside them
MINIMAX_M2_EXPERTS = ExpertNaming(
    per_expert=MIXTRAL_EXPERTS.per_expert,
    fused=QWEN3_MOE_EXPERTS.fused,  # a GGUF's whole-layer banks (formats/gguf_checkpoint.py's names)
    projection_parts={**MIXTRAL_EXPERTS.projection_parts, **QWEN3_MOE_EXPERTS.projection_parts},
    rewrites=(
        *MIXTRAL_EXPERTS.rewrites,
        (re.compile(r"\.block_sparse_moe\.e_score_correction_bias$"), ".mlp.gate.e_score_correction_bias"),
    ),
)

# Qwen3.5/3.6-MoE as published: the text model inside Qwen3_5MoeForConditionalGeneration
QWEN3_5_MOE_WRAPPED = ExpertNaming(
    per_expert=QWEN3_MOE_EXPERTS.per_expert,
    fused=QWEN3_MOE_EXPERTS.fused,
    projection_parts=QWEN3_MOE_EXPERTS.projection_parts,
    renames=(("model.language_model.", "model."),),
    ignored=("model.visual.", "mtp."),
)

# gpt-oss as transformers saves it: whole-layer banks [E, in, out] with gate and up columns alternating, and
# their biases; the router is `mlp.router`
GPT_OSS_EXPERTS = ExpertNaming(
    per_expert=QWEN3_MOE_EXPERTS.per_expert,
    fused=re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.((?:gate_up|down)_proj(?:_bias)?)"),
    projection_parts={
        "gate_up_proj": "gate_up", "down_proj": "down", "gate_up_proj_bias": "gate_up_bias",
        "down_proj_bias": "down_bias",
    },
    rewrites=((re.compile(r"\.mlp\.router\."), ".mlp.gate."),),
    layouts=dict.fromkeys(("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"), LAYOUTS[1]),
)  # fmt: skip

# gpt-oss from a GGUF (formats/gguf_checkpoint.py's names): banks as the pool lays them out, gate and up
# apart, each with its bias
GPT_OSS_GGUF_EXPERTS = ExpertNaming(
    per_expert=QWEN3_MOE_EXPERTS.per_expert,
    fused=re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.((?:gate|up|down)_proj(?:_bias)?)"),
    projection_parts={
        "gate_proj": "gate", "up_proj": "up", "down_proj": "down", "gate_proj_bias": "gate_bias",
        "up_proj_bias": "up_bias", "down_proj_bias": "down_bias",
    },
)  # fmt: skip

# Kimi-Linear as published: Mixtral's expert names, and every MLP (dense, router, shared experts) under
# `block_sparse_moe`
KIMI_LINEAR_EXPERTS = ExpertNaming(
    per_expert=MIXTRAL_EXPERTS.per_expert,
    fused=QWEN3_MOE_EXPERTS.fused,
    projection_parts={**MIXTRAL_EXPERTS.projection_parts, **QWEN3_MOE_EXPERTS.projection_parts},
    rewrites=((re.compile(r"\.block_sparse_moe\.(?!experts\.\d)"), ".mlp."),),
)
