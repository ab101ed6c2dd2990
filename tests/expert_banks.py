"""Small random expert banks and decode-sized steps over them, for the CPU branch tests."""

from __future__ import annotations

import torch

from freetoken.runtime.moe.pool import HostExpertPool


def pool(dtype: torch.dtype, e: int = 6, h: int = 128, i: int = 48) -> HostExpertPool:
    gen = torch.Generator().manual_seed(3)
    p = HostExpertPool.allocate((0, 1), e, h, i, dtype)
    for layer in (0, 1):
        p.gate_up[layer].copy_(torch.randn(p.gate_up[layer].shape, generator=gen) * 0.1)
        p.down[layer].copy_(torch.randn(p.down[layer].shape, generator=gen) * 0.1)
    p.mark_filled()
    return p


def step(seed: int, t: int = 5, k: int = 3, e: int = 6, h: int = 128):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    ids[min(1, t - 1), 0] = -1
    return x, ids, torch.rand(t, k, generator=gen)
