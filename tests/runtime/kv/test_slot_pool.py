"""The static KV pool: slots handed out and back, growth at a safe point that keeps live sequences."""

from __future__ import annotations

import gc

import pytest
import torch

from freetoken.errors import FreeTokenError
from freetoken.runtime.kv.cache import KVCache
from freetoken.runtime.kv.slot_pool import KVSlotPool

CPU = torch.device("cpu")


def pool(slots: int = 2, capacity: int = 16) -> KVSlotPool:
    return KVSlotPool(
        slots, (0, 2), num_kv_heads=2, head_dim=4, capacity=capacity, dtype=torch.float32, device=CPU
    )


def cache(p: KVSlotPool) -> KVCache:
    return KVCache(3, 2, 4, torch.float32, CPU, max_len=64, layers=(0, 2), pool=p)


def test_slots_are_views_of_the_pool_and_come_back() -> None:
    p = pool()
    a, b = cache(p), cache(p)
    assert (a.slot, b.slot) == (0, 1) and p.free == 0
    assert a.max_len == 16  # the pool's capacity bounds the context
    a.write(2, 0, torch.ones(2, 3, 4), torch.ones(2, 3, 4))
    assert p.k[1][0, :, :3].eq(1).all() and p.k[1][1].eq(0).all()  # layer 2 is the pool's second
    a.release()
    a.release()  # once only
    c = cache(p)
    assert c.slot == 0 and p.free == 0
    del b
    gc.collect()
    assert p.free == 1 and c.slot == 0  # a dropped cache gives its slot back too


def test_growth_keeps_live_sequences_and_changes_generation() -> None:
    p = pool(slots=1)
    a = cache(p)
    a.write(0, 0, torch.full((2, 5, 4), 7.0), torch.full((2, 5, 4), 8.0))
    generation = p.generation
    b = cache(p)  # no free slot: the pool grows by one
    assert p.slots == 2 and p.generation == generation + 1 and b.slot == 1
    assert a.k[0].data_ptr() == p.k[0][0].data_ptr()  # re-bound to the new storage
    assert a.k[0][:, :5].eq(7).all() and a.v[0][:, :5].eq(8).all()


def test_reserve_checks_the_context_and_bad_slots_are_refused() -> None:
    p = pool(capacity=8)
    a = cache(p)
    a.reserve(8)
    with pytest.raises(FreeTokenError, match="exceeds the context of 8"):
        a.reserve(9)
    with pytest.raises(ValueError, match="not in use"):
        p.release(1)
