"""Qwen3-Next (`Qwen3NextForCausalLM`, model_type `qwen3_next`): the hybrid layers of qwen3_5_moe.py with
two differences in the checkpoint. Each DeltaNet layer has two fused input projections, `in_proj_qkvz`
and `in_proj_ba`, their rows grouped by key head (delta_net.py splits them); and layers listed in
`mlp_only_layers` or off the `decoder_sparse_step` have a dense SwiGLU MLP instead of the MoE. Top-k
renormalisation follows `norm_topk_prob`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from freetoken.formats.tensor_names import QWEN3_MOE_EXPERTS
from freetoken.runtime.config import ModelConfig
from freetoken.runtime.models import qwen3_5_moe
from freetoken.runtime.models.base import Architecture
from freetoken.runtime.models.qwen3_moe import check_dense_layers, layout_fields


def parse_config(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    cfg = qwen3_5_moe.parse_config(raw, source)
    cfg = replace(
        cfg,
        architecture="qwen3_next",
        **layout_fields(raw, source, norm_topk_prob=True),
    )
    return check_dense_layers(cfg, source)


ARCHITECTURE = Architecture(
    name="qwen3_next",
    hf_classes=("Qwen3NextForCausalLM",),
    parse_config=parse_config,
    build_model=qwen3_5_moe.Qwen3_5MoeForCausalLM,
    expert_naming=QWEN3_MOE_EXPERTS,
)
