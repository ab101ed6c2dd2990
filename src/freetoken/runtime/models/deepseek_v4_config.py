"""DeepSeek-V4's config.json -> its ModelConfig (the shared fields plus V4's own, in a frozen subclass).

Read in either spelling: as transformers 5 saves it (`layer_types`, `mlp_layer_types`, `compress_rates`,
`partial_rotary_factor`, `rope_parameters` nested as {"main": ..., "compress": ...} or flat) or as older
configs carry it (`compress_ratios` per layer, `compress_rate_csa` / `compress_rate_hca`,
`num_hash_layers`, `qk_rope_head_dim`, `rope_scaling`). A flat rope object (yarn) applies to the
compressed layers only, at `compress_rope_theta`, with its attention factor 1 unless it names one; the
sliding layers rotate with plain rope at `rope_theta`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from freetoken.runtime.config import ModelConfig, RopeConfig, rope_from_hf
from freetoken.runtime.json_keys import (
    COUNT,
    FRACTION,
    NON_NEGATIVE,
    OBJECT,
    POSITIVE,
    POSITIVE_INT,
    TEXTS,
    JsonObject,
    Kind,
)
from freetoken.runtime.models.qwen3_moe import decoder_fields

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_KINDS = (SLIDING, CSA, HCA)
HASH_MOE, ROUTED_MOE = "hash_moe", "moe"
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")
DEFAULT_RATES = {CSA: 4, HCA: 128}  # transformers' defaults (m = 4, m' = 128)
DEFAULT_HASH_LAYERS = 3
RATES = Kind(
    "an object of positive integers per attention kind",
    lambda v: isinstance(v, dict) and all(isinstance(n, int) and n > 0 for n in v.values()),
)


@dataclass(frozen=True)
class DeepseekV4ModelConfig(ModelConfig):
    """ModelConfig plus V4's layer schedule, hyper-connections, compression and output projection."""

    layer_kinds: tuple[str, ...] = ()  # per layer: one of LAYER_KINDS
    hash_layers: tuple[int, ...] = ()  # layers routed by the token-id -> experts table
    csa_rate: int = 4  # tokens per compressed entry on the compressed-sparse layers
    hca_rate: int = 128  # ... on the heavily-compressed layers
    compress_rope: RopeConfig = field(
        default_factory=RopeConfig
    )  # the compressed layers' rope (the sliding ones: `rope`)
    hc_mult: int = 4  # residual streams
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    o_groups: int = 8  # head groups of the grouped output projection
    o_lora_rank: int = 1024  # each group's projected width

    def rate(self, kind: str) -> int:
        """Tokens per compressed entry of a layer kind (0: sliding, nothing compressed)."""
        return {SLIDING: 0, CSA: self.csa_rate, HCA: self.hca_rate}[kind]

    @property
    def kv_dims(self) -> tuple[int, int, int]:
        """One row per position and layer ([1, S, width], no values): every kind's row fits (the
        widest kind present sets it; compressed_kv.RowLayout lays the columns out)."""
        from freetoken.runtime.models.compressed_kv import RowLayout

        width = max(RowLayout.of(self, kind).width for kind in set(self.layer_kinds))
        return 1, width, 0


def _layer_kinds(cfg: JsonObject, layers: int, rates: dict[str, int]) -> tuple[str, ...]:
    """Each layer's attention kind: `layer_types`, else per-layer `compress_ratios`, else transformers'
    default (two heavily-compressed layers, then alternating)."""
    kinds = cfg.get("layer_types", TEXTS, None)
    if kinds is None and cfg.raw.get("compress_ratios") is not None:
        by_ratio = {0: SLIDING, rates[CSA]: CSA, rates[HCA]: HCA}
        ratios = cfg.get("compress_ratios", Kind("a list of integers", lambda v: isinstance(v, list)))
        if any(r not in by_ratio for r in ratios):
            raise cfg.error("compress_ratios", f"expected each of {sorted(by_ratio)}, got {ratios}")
        kinds = tuple(by_ratio[r] for r in ratios)
    if kinds is None:
        kinds = tuple([HCA] * min(layers, 2) + [CSA if i % 2 else HCA for i in range(max(layers - 2, 0))])
    kinds = tuple(kinds[:layers])  # a longer list covers multi-token-prediction layers too
    if len(kinds) != layers or set(kinds) - set(LAYER_KINDS):
        raise cfg.error("layer_types", f"expected {layers} of {', '.join(LAYER_KINDS)}, got {list(kinds)}")
    return kinds


def _hash_layers(cfg: JsonObject, layers: int) -> tuple[int, ...]:
    kinds = cfg.get("mlp_layer_types", TEXTS, None)
    if kinds is None:
        count = cfg.get("num_hash_layers", COUNT, DEFAULT_HASH_LAYERS)
        return tuple(range(min(count, layers)))
    kinds = kinds[:layers]
    if len(kinds) != layers or set(kinds) - {HASH_MOE, ROUTED_MOE}:
        raise cfg.error(
            "mlp_layer_types", f"expected {layers} of {HASH_MOE} / {ROUTED_MOE}, got {list(kinds)}"
        )
    return tuple(i for i, kind in enumerate(kinds) if kind == HASH_MOE)


def _rates(cfg: JsonObject) -> dict[str, int]:
    rates = {**DEFAULT_RATES, **cfg.get("compress_rates", RATES, {})}
    for kind, key in ((CSA, "compress_rate_csa"), (HCA, "compress_rate_hca")):
        rates[kind] = cfg.get(key, POSITIVE_INT, rates[kind])
    return rates


def _ropes(cfg: JsonObject, rotary_fraction: float) -> tuple[RopeConfig, RopeConfig]:
    """(the sliding layers' rope, the compressed layers' rope) from either spelling."""
    max_positions = cfg.raw.get("max_position_embeddings")
    theta = cfg.get("rope_theta", POSITIVE, 10000.0)
    compress_theta = cfg.get("compress_rope_theta", POSITIVE, 160000.0)
    params = cfg.get("rope_parameters", OBJECT, None) or cfg.get("rope_scaling", OBJECT, None) or {}
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        main_params = {"rope_theta": theta, **params["main"]}
        compress_params = {"rope_theta": compress_theta, **params["compress"]}
    else:  # one flat object: it is the compressed layers' (yarn); the sliding ones keep plain rope
        flat = {k: v for k, v in params.items() if k not in ("main", "compress")}
        main_params = {"rope_type": "default", "rope_theta": theta}
        compress_params = {**flat, "rope_theta": compress_theta}
    ropes = []
    for sub in (main_params, compress_params):
        older = sub.pop("type", None)  # the older key of the rope type
        kind = sub.get("rope_type") or older or "default"
        sub = {**sub, "rope_type": kind, "partial_rotary_factor": rotary_fraction}
        if kind == "yarn" and sub.get("attention_factor") is None:
            sub["attention_factor"] = 1.0  # V4 does not scale its compressed layers' angles
        top = {"rope_parameters": sub, "max_position_embeddings": max_positions}
        ropes.append(rope_from_hf(top, cfg.source))
    return ropes[0], ropes[1]


def parse_config(raw: dict[str, Any], source: str = "config.json") -> DeepseekV4ModelConfig:
    cfg = JsonObject(raw, source)
    fields = decoder_fields(raw, source)
    layers, heads = fields["num_layers"], fields["num_heads"]
    head_dim = cfg.get("head_dim", POSITIVE_INT)  # required: the shared K=V head's width
    if raw.get("partial_rotary_factor") is not None:
        rotary_fraction = cfg.get("partial_rotary_factor", FRACTION)
    else:
        rotary_fraction = cfg.get("qk_rope_head_dim", POSITIVE_INT) / head_dim
    rope_dims = int(head_dim * rotary_fraction)
    if rope_dims % 2 or not 0 < rope_dims <= head_dim:
        raise cfg.error("partial_rotary_factor", f"gives {rope_dims} rope dims of head_dim={head_dim}")
    rates = _rates(cfg)
    kinds = _layer_kinds(cfg, layers, rates)
    o_groups = cfg.get("o_groups", POSITIVE_INT)
    if heads % o_groups:
        raise cfg.error("o_groups", f"num_attention_heads={heads} do not split into {o_groups} groups")
    index: dict[str, int] = dict(index_n_heads=0, index_head_dim=0, index_topk=0)
    if CSA in kinds:  # only the compressed-sparse layers run an indexer
        index = {key: cfg.get(key, POSITIVE_INT) for key in index}
        if index["index_head_dim"] < rope_dims:
            raise cfg.error("index_head_dim", f"expected at least the {rope_dims} rope dims")
    scoring = cfg.choice("scoring_func", SCORING_FUNCS, "sqrtsoftplus")
    main_rope, compress_rope = _ropes(cfg, rotary_fraction)
    fields.update(head_dim=head_dim, num_kv_heads=1, rope=main_rope)
    return DeepseekV4ModelConfig(
        architecture="deepseek_v4",
        raw={**raw, "layer_types": list(kinds)},
        intermediate_size=0,
        norm_topk_prob=True,  # the chosen experts' weights are always renormalised
        qk_norm="none",
        router_scoring=scoring,
        routed_scaling_factor=cfg.get("routed_scaling_factor", POSITIVE, 1.5),
        n_shared_experts=1,
        expert_act="clamped_silu",  # routed and shared experts: silu(min(g, L)) · clamp(u, −L, L)
        swiglu_limit=cfg.get("swiglu_limit", POSITIVE, 10.0),
        attention_sinks=True,
        sliding_window=cfg.get("sliding_window", POSITIVE_INT),
        sliding_layers=tuple(range(layers)),  # every layer's own keys are a window
        q_lora_rank=cfg.get("q_lora_rank", POSITIVE_INT),
        qk_rope_head_dim=rope_dims,
        rope_interleave=True,
        **index,
        layer_kinds=kinds,
        hash_layers=_hash_layers(cfg, layers),
        csa_rate=rates[CSA],
        hca_rate=rates[HCA],
        compress_rope=compress_rope,
        hc_mult=cfg.get("hc_mult", POSITIVE_INT),
        hc_sinkhorn_iters=cfg.get("hc_sinkhorn_iters", POSITIVE_INT, 20),
        hc_eps=cfg.get("hc_eps", NON_NEGATIVE, 1e-6),
        o_groups=o_groups,
        o_lora_rank=cfg.get("o_lora_rank", POSITIVE_INT),
        **fields,
    )


def older_spelling(raw: dict[str, Any]) -> dict[str, Any]:
    """transformers' config dict as DeepSeek's published files spell it (what llama.cpp's converter reads;
    parse_config reads both): per-layer compress ratios, scalar rates, a hash-layer
    count, rope dims and a flat `rope_scaling` (yarn for the compressed layers)."""
    old = {k: v for k, v in raw.items() if k not in ("layer_types", "mlp_layer_types", "compress_rates")}
    rates = raw["compress_rates"]
    by_kind = {"sliding_attention": 0, **rates}
    compress = raw["rope_parameters"]["compress"]
    old.update(
        compress_ratios=[by_kind[kind] for kind in raw["layer_types"]],
        compress_rate_csa=rates["compressed_sparse_attention"],
        compress_rate_hca=rates["heavily_compressed_attention"],
        num_hash_layers=raw["mlp_layer_types"].count("hash_moe"),
        qk_rope_head_dim=int(raw["head_dim"] * raw["partial_rotary_factor"]),
        rope_scaling={
            "type": "yarn",
            "factor": compress["factor"],
            "original_max_position_embeddings": compress["original_max_position_embeddings"],
        },
    )
    old.pop("partial_rotary_factor")
    old.pop("rope_parameters")
    return old
