"""VRAM budget: the KV reserve first, then as many expert slots as fit.

With `--vram-budget` the engine's device memory — the dense weights, the static KV pool, on CUDA the
activation margin and the prefix-cache reserve, and the expert slots (the bank's probe slot too) — stays
under the budget: the slots get what the rest leaves. The engine re-splits at safe points
(`Engine.set_vram_budget`, or when the KV pool grows), so the slots shrink and grow with what KV needs.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from freetoken.errors import FreeTokenError
from freetoken.runtime.config import ModelConfig, MoeConfig, vram_budget_form
from freetoken.runtime.moe.pool import HostExpertPool
from freetoken.runtime.moe.slot_bank import PROBE_SLOTS

# Held back beyond the KV reserve for activations, the lm head's logits and allocator slack.
ACTIVATION_MARGIN_BYTES = 1 << 30


def kv_layer_count(cfg: ModelConfig) -> int:
    """Layers that keep K/V: all, or a hybrid model's full-attention ones (`layer_types`)."""
    kinds = cfg.raw.get("layer_types")
    if not isinstance(kinds, list):
        return cfg.num_layers
    return sum(kind != "linear_attention" for kind in kinds[: cfg.num_layers])  # sliding layers keep K/V


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, expanded: bool = False) -> int:
    """K/V bytes a position costs over every attention layer; `expanded`: what keys and values per head
    would cost (heads × (key + value dims)), against which latent attention's cache is measured."""
    element = torch.empty(0, dtype=dtype).element_size()
    heads, k_dim, v_dim = cfg.kv_dims
    if expanded and cfg.kv_lora_rank:
        heads, k_dim, v_dim = cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    return kv_layer_count(cfg) * heads * (k_dim + v_dim) * element


def device_memory_total(device: torch.device) -> int:
    """Bytes of memory on `device` (the cpu device: the machine's RAM)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def budget_bytes(moe: MoeConfig, device: torch.device) -> int | None:
    """`--vram-budget` in bytes (a share of the device's memory, or a size); None without one."""
    form = vram_budget_form(moe.vram_budget)
    if form is None:
        return None
    kind, value = form
    return int(value * device_memory_total(device)) if kind == "share" else int(value)


def held_bytes(
    model: nn.Module,
    kv_pool_bytes: int,
    moe: MoeConfig,
    cfg: ModelConfig,
    device: torch.device,
    probe_bytes: int = 0,
) -> int:
    """What the engine holds on `device` besides the expert slots: the model's weights there, the static
    KV pool, a cached backend's probe slot (`probe_bytes`: probe_slot_bytes) and, on CUDA, the activation
    margin and the prefix-cache reserve."""
    tensors = [*model.parameters(), *model.buffers()]
    dense = sum(t.numel() * t.element_size() for t in tensors if t.device == device)
    extra = 0
    if device.type == "cuda":
        element = next((t.dtype for t in tensors if t.is_floating_point()), torch.bfloat16)
        extra = ACTIVATION_MARGIN_BYTES + moe.kv_reserve_tokens * kv_bytes_per_token(cfg, element)
    return dense + kv_pool_bytes + probe_bytes + extra


def probe_slot_bytes(backend: str, pool: HostExpertPool | None) -> int:
    """Bytes of the slots a cached backend's bank holds beyond its cache (PROBE_SLOTS experts; none for
    fused), whatever the cache's size."""
    return PROBE_SLOTS * pool.expert_nbytes if backend != "fused" and pool is not None else 0


def slot_ceiling(
    moe: MoeConfig, backend: str, cfg: ModelConfig, pool: HostExpertPool, device: torch.device
) -> int:
    """Expert slots a cached backend takes without a budget (0 for fused): --moe-cache-size, a share of
    the pool, or what free VRAM leaves after the KV reserve; on a cpu device with a budget, the pool."""
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
        reserve += probe_slot_bytes(backend, pool)
        slots = min(total, max(0, free - reserve) // pool.expert_nbytes)
    elif backend == "cpu" and moe.vram_budget is None:
        slots = 0  # the cpu device computes straight from the pool: no second copy
    elif moe.vram_budget is not None:
        slots = total
    else:
        raise FreeTokenError(
            f"--moe-backend {backend} on a cpu device needs --moe-cache-size or --moe-cache-ratio "
            "(its slots are a second copy of those experts in RAM)"
        )
    if slots > total:
        raise FreeTokenError(f"--moe-cache-size {slots} is above the pool of {total} experts")
    return int(slots)


def plan_slots(
    moe: MoeConfig,
    backend: str,
    cfg: ModelConfig,
    pool: HostExpertPool,
    ceiling: int,
    held: int,
    device: torch.device,
) -> int:
    """Expert slots now: the `ceiling` (slot_ceiling), under `--vram-budget` at most what the budget
    leaves beside `held` (held_bytes, the probe slot included)."""
    budget = budget_bytes(moe, device)
    slots = ceiling if budget is None else min(ceiling, max(0, budget - held) // pool.expert_nbytes)
    if backend in ("offload", "hybrid") and slots < cfg.num_experts_per_tok:
        if slots < ceiling:
            raise FreeTokenError(
                f"--vram-budget {moe.vram_budget} leaves room for {slots} expert slots beside "
                f"{held / 2**30:.2f} GiB of weights and KV, below one layer's top-k "
                f"({cfg.num_experts_per_tok})"
            )
        raise FreeTokenError(
            f"expert cache of {slots} slots is below one layer's top-k ({cfg.num_experts_per_tok}); "
            "give a larger --moe-cache-size or free GPU memory"
        )
    return int(slots)
