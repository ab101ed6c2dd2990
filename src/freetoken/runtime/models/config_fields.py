"""ModelConfig fields several families read the same way: DeepSeek-style grouped sigmoid routing (GLM-4.5,
DeepSeek-V3, Kimi-Linear) and latent attention's geometry (DeepSeek-V3, Kimi-Linear)."""

from __future__ import annotations

from typing import Any

from freetoken.runtime.json_keys import BOOL, COUNT, POSITIVE, POSITIVE_INT, JsonObject, Kind

MLP_LAYER_TYPES = Kind(
    'a list of "dense" or "sparse"',
    lambda v: isinstance(v, list) and all(k in ("dense", "sparse") for k in v),
)


def dense_layers(cfg: JsonObject, layers: int, first_dense: int = 0) -> tuple[int, ...]:
    """The layers with a dense MLP: as `mlp_layer_types` spells them per layer (newer configs), else the
    first `first_k_dense_replace` (`first_dense` when the config says neither)."""
    kinds = cfg.get("mlp_layer_types", MLP_LAYER_TYPES, None)
    if kinds is None:
        return tuple(range(min(cfg.get("first_k_dense_replace", COUNT, first_dense), layers)))
    if len(kinds) != layers:
        raise cfg.error("mlp_layer_types", f"expected {layers} entries, got {len(kinds)}")
    return tuple(i for i, kind in enumerate(kinds) if kind == "dense")


def grouped_router_fields(cfg: JsonObject, experts: int) -> dict[str, Any]:
    """Sigmoid scores chosen with a correction bias within the best `topk_group` of `n_group` groups,
    weights renormalised if `norm_topk_prob`, times `routed_scaling_factor`; `n_shared_experts` beside."""
    groups = cfg.get("n_group", POSITIVE_INT, 1)
    if experts % groups:
        raise cfg.error("n_group", f"{experts} experts do not split into {groups} groups")
    topk_group = cfg.get("topk_group", POSITIVE_INT, 1)
    if topk_group > groups:
        raise cfg.error("topk_group", f"expected at most n_group={groups}, got {topk_group}")
    return dict(
        router_scoring="sigmoid",
        n_group=groups,
        topk_group=topk_group,
        norm_topk_prob=cfg.get("norm_topk_prob", BOOL, True),
        routed_scaling_factor=cfg.get("routed_scaling_factor", POSITIVE, 1.0),
        n_shared_experts=cfg.get("n_shared_experts", COUNT, 0),
    )


def latent_attention_fields(cfg: JsonObject, heads: int) -> dict[str, Any]:
    """MLA's ranks and head dims; `head_dim` as q and k heads have it (nope + rope)."""
    rope_dim = cfg.get("qk_rope_head_dim", POSITIVE_INT)
    if rope_dim % 2:
        raise cfg.error("qk_rope_head_dim", f"expected an even number, got {rope_dim}")
    nope = cfg.get("qk_nope_head_dim", POSITIVE_INT)
    return dict(
        head_dim=nope + rope_dim,
        num_kv_heads=heads,
        q_lora_rank=cfg.get("q_lora_rank", POSITIVE_INT, None),
        kv_lora_rank=cfg.get("kv_lora_rank", POSITIVE_INT),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=cfg.get("v_head_dim", POSITIVE_INT),
    )
