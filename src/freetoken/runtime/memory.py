"""VRAM budget: the KV reserve first, then as many expert slots as fit."""

from __future__ import annotations

import torch

from freetoken.errors import FreeTokenError
from freetoken.runtime.config import ModelConfig, MoeConfig
from freetoken.runtime.moe.pool import HostExpertPool

# Held back beyond the KV reserve for activations, the lm head's logits and allocator slack.
ACTIVATION_MARGIN_BYTES = 1 << 30


def kv_layer_count(cfg: ModelConfig) -> int:
    """Layers that keep K/V: all, or a hybrid model's full-attention ones (`layer_types`)."""
    kinds = cfg.raw.get("layer_types")
    if not isinstance(kinds, list):
        return cfg.num_layers
    return sum(kind == "full_attention" for kind in kinds[: cfg.num_layers])


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    element = torch.empty(0, dtype=dtype).element_size()
    return 2 * kv_layer_count(cfg) * cfg.num_kv_heads * cfg.head_dim * element


def plan_slots(
    moe: MoeConfig, backend: str, cfg: ModelConfig, pool: HostExpertPool, device: torch.device
) -> int:
    """Number of expert slots on the compute device for a cached backend (0 for fused)."""
    if backend == "fused":
        return 0
    total = len(pool.layers) * pool.num_experts
    if moe.cache_size is not None:
        slots = moe.cache_size
    elif moe.cache_ratio is not None:
        slots = max(1, round(moe.cache_ratio * total))
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        reserve = moe.kv_reserve_tokens * kv_bytes_per_token(cfg, pool.dtype) + ACTIVATION_MARGIN_BYTES
        slots = min(total, max(0, free - reserve) // pool.expert_nbytes)
    elif backend == "cpu":
        slots = 0  # the cpu device computes straight from the pool: no second copy
    else:
        raise FreeTokenError(
            f"--moe-backend {backend} on a cpu device needs --moe-cache-size or --moe-cache-ratio "
            "(its slots are a second copy of those experts in RAM)"
        )
    if slots > total:
        raise FreeTokenError(f"--moe-cache-size {slots} is above the pool of {total} experts")
    if backend in ("offload", "hybrid") and slots < cfg.num_experts_per_tok:
        raise FreeTokenError(
            f"expert cache of {slots} slots is below one layer's top-k ({cfg.num_experts_per_tok}); "
            "give a larger --moe-cache-size or free GPU memory"
        )
    return int(slots)
