"""Kimi-Linear (`KimiLinearForCausalLM`): a hybrid of Kimi Delta Attention layers (kda.py, a recurrent
state per sequence) and latent attention layers without rope (mla.py), over DeepSeek-V3's MoE (a sigmoid
router choosing within groups, a correction bias, renormalised weights times `routed_scaling_factor`,
shared experts) with the layers `mlp_layer_types` calls dense plain SwiGLU. The hybrid cache, state slots
and anchor checkpoints are Qwen3.5's (qwen3_5_moe.py). Both layer kinds are `self_attn` in checkpoints.

Configs come as transformers writes them (`layer_types`, `linear_num_heads`, ...) or as published
(`linear_attn_config` with 1-based `full_attn_layers` / `kda_layers`, `num_experts`, `num_expert_group`,
`moe_renormalize`, `num_experts_per_token`, `num_shared_experts`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from freetoken.formats.tensor_names import KIMI_LINEAR_EXPERTS
from freetoken.runtime.config import ModelConfig
from freetoken.runtime.json_keys import COUNT, OBJECT, POSITIVE_INT, TEXTS, JsonObject
from freetoken.runtime.models.base import Architecture
from freetoken.runtime.models.config_fields import (
    dense_layers,
    grouped_router_fields,
    latent_attention_fields,
)
from freetoken.runtime.models.kda import KimiDeltaAttention
from freetoken.runtime.models.layers import RMSNorm
from freetoken.runtime.models.mla import LatentAttention
from freetoken.runtime.models.qwen3_5_moe import HybridDecoderLayer, Qwen3_5MoeForCausalLM
from freetoken.runtime.models.qwen3_moe import decoder_fields, mlp_module

# the published config's names -> transformers'
ALIASES = {
    "num_expert_group": "n_group",
    "moe_renormalize": "norm_topk_prob",
    "num_experts_per_token": "num_experts_per_tok",
    "num_shared_experts": "n_shared_experts",
}


class KimiDecoderLayer(HybridDecoderLayer):
    def __init__(self, cfg: ModelConfig, layer: int, kind: str) -> None:
        nn.Module.__init__(self)
        self.layer, self.kind = layer, kind
        raw = cfg.raw
        self.self_attn: nn.Module = (
            KimiDeltaAttention(
                cfg.hidden_size,
                raw["linear_num_heads"],
                raw["linear_head_dim"],
                raw["linear_conv_kernel_dim"],
                cfg.rms_norm_eps,
            )
            if kind == "linear_attention"
            else LatentAttention(cfg, layer)
        )
        self.self_attn.layer = layer  # a recurrent layer's state key in the pool
        self.mlp = mlp_module(cfg, layer)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def recurrent(self) -> nn.Module:
        return self.self_attn


class KimiLinearForCausalLM(Qwen3_5MoeForCausalLM):
    layer_class = KimiDecoderLayer
    norm_class = RMSNorm


def _layer_kinds(cfg: JsonObject, layers: int) -> list[str]:
    """The attention kind of each layer, from either spelling."""
    kinds = cfg.get("layer_types", TEXTS, None)
    linear = cfg.get("linear_attn_config", OBJECT, {})
    if kinds is None and "full_attn_layers" in linear:
        full = set(linear["full_attn_layers"])  # 1-based in published configs
        kinds = ["full_attention" if i + 1 in full else "linear_attention" for i in range(layers)]
    if kinds is None:
        kinds = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(layers)]
    if len(kinds) != layers or set(kinds) - {"linear_attention", "full_attention"}:
        raise cfg.error("layer_types", f"expected {layers} of full_attention / linear_attention")
    return list(kinds)


def parse_config(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    raw = {**{new: raw[old] for old, new in ALIASES.items() if old in raw and new not in raw}, **raw}
    cfg = JsonObject(raw, source)
    linear = cfg.get("linear_attn_config", OBJECT, {})
    spelled = {
        "linear_num_heads": "num_heads",
        "linear_head_dim": "head_dim",
        "linear_conv_kernel_dim": "short_conv_kernel_size",
    }
    for key, inner in spelled.items():
        if key not in raw and inner in linear:
            raw[key] = linear[inner]
        cfg.get(key, POSITIVE_INT)  # the same dict: the spelled-out value is seen
    if "num_experts_per_tok" not in raw:  # named as published configs spell it
        raise cfg.error("num_experts_per_token", "missing")
    fields = decoder_fields(raw, source)
    layers = fields["num_layers"]
    kinds = _layer_kinds(cfg, layers)
    fields.update(latent_attention_fields(cfg, fields["num_heads"]))
    return ModelConfig(
        architecture="kimi_linear",
        raw={**raw, "layer_types": kinds},
        intermediate_size=cfg.get("intermediate_size", COUNT, 0),
        mlp_only_layers=dense_layers(cfg, layers, first_dense=1),  # transformers' default for Kimi
        qk_norm="none",
        mla_rope=False,
        **grouped_router_fields(cfg, fields["num_experts"]),
        **fields,
    )


ARCHITECTURE = Architecture(
    name="kimi_linear",
    hf_classes=("KimiLinearForCausalLM",),
    parse_config=parse_config,
    build_model=KimiLinearForCausalLM,
    expert_naming=KIMI_LINEAR_EXPERTS,
)
