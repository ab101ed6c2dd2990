"""The slot cache's LRU against a naive reference LRU on random access streams."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

from freetoken.runtime.moe.slot_cache import EMPTY, SlotCache


class ReferenceLRU:
    """Textbook LRU over (layer, expert) keys, one layer step at a time."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.order: OrderedDict[tuple[int, int], None] = OrderedDict()

    def step(self, layer: int, experts: list[int]) -> tuple[list[bool], list[tuple[int, int]]]:
        demanded = {(layer, e) for e in experts}
        hits = [(layer, e) in self.order for e in experts]
        for e, hit in zip(experts, hits, strict=True):
            if hit:
                self.order.move_to_end((layer, e))
        evicted = []
        for e, hit in zip(experts, hits, strict=True):
            if hit:
                continue
            if len(self.order) >= self.capacity:
                victim = next(k for k in self.order if k not in demanded)
                del self.order[victim]
                evicted.append(victim)
            self.order[(layer, e)] = None
        return hits, evicted


def cache_step(cache: SlotCache, layer: int, experts: list[int]) -> tuple[list[bool], list[tuple[int, int]]]:
    arr = np.array(experts)
    slots = cache.lookup(layer, arr)
    hit = slots != EMPTY
    cache.touch(slots[hit])
    victims = cache.victims(int((~hit).sum()), protected=slots[hit])
    evicted = []
    for slot, expert in zip(victims.tolist(), arr[~hit].tolist(), strict=True):
        old = cache.admit(layer, expert, slot)
        if old is not None:
            evicted.append(old)
    return hit.tolist(), evicted


@pytest.mark.parametrize(
    ("capacity", "seed", "skew"), [(4, 0, 0.0), (10, 1, 1.2), (24, 2, 0.6), (64, 3, 1.0)]
)
def test_lru_equals_reference_on_random_streams(capacity: int, seed: int, skew: float) -> None:
    layers, experts, top_k = (0, 1, 3), 16, 4
    rng = np.random.default_rng(seed)
    popularity = 1.0 / np.arange(1, experts + 1) ** skew
    popularity /= popularity.sum()
    cache, ref = SlotCache(layers, experts, capacity), ReferenceLRU(capacity)
    for _ in range(400):
        layer = int(rng.choice(layers))
        chosen = sorted(rng.choice(experts, size=top_k, replace=False, p=popularity).tolist())
        ours = cache_step(cache, layer, chosen)
        theirs = ref.step(layer, chosen)
        assert ours[0] == theirs[0]
        assert sorted(ours[1]) == sorted(theirs[1])
        assert cache.resident() == set(ref.order)
    # the tables agree with each other
    for slot, (row, expert) in enumerate(cache.owner):
        if row != EMPTY:
            assert cache.slot_of[row, expert] == slot
    assert (cache.slot_of != EMPTY).sum() == len(cache.resident())


def test_victims_are_the_k_oldest_unprotected_in_one_pass() -> None:
    cache = SlotCache((0,), 32, 8)
    for slot in range(8):
        cache.admit(0, slot, slot)
    cache.touch(np.array([3, 1]))  # slots 3 and 1 become the newest
    victims = cache.victims(3, protected=np.array([0]))
    assert victims.tolist() == [2, 4, 5]
    with pytest.raises(ValueError):
        cache.victims(8, protected=np.array([0]))


def test_empty_slots_go_first_and_evictions_are_reported() -> None:
    cache = SlotCache((5, 9), 4, 3)
    assert cache.admit(5, 1, 0) is None
    assert sorted(cache.victims(2, protected=np.array([0])).tolist()) == [1, 2]
    cache.admit(9, 2, 1)
    cache.admit(9, 3, 2)
    assert cache.victims(1, protected=np.array([], dtype=np.int64)).tolist() == [0]
    assert cache.admit(9, 0, 0) == (5, 1)
    assert cache.lookup(5, np.array([1]))[0] == EMPTY and cache.lookup(9, np.array([0]))[0] == 0
