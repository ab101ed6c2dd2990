"""Radix-tree prefix cache: matching, KV round trips, splitting, LRU eviction and the budget."""

from __future__ import annotations

import random

import pytest
import torch

from freetoken.runtime.kv.cache import KVCache
from freetoken.runtime.kv.prefix_cache import PrefixCache

LAYERS, HEADS, DIM = 2, 2, 4
TOKEN_BYTES = 2 * LAYERS * HEADS * DIM * 4  # k and v, every layer, float32


def new_kv() -> KVCache:
    return KVCache(LAYERS, HEADS, DIM, torch.float32, torch.device("cpu"), max_len=256)


def reference(ids: list[int], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """KV [HEADS, len(ids), DIM] that depends on the whole prefix, like real attention KV.

    Value = fingerprint(ids[: p + 1]) * 1000 + p + layer / 2 + head / 4 + dim / 16, exact in float32
    (< 2**20 with 4 fractional bits); v = -k so swapping k and v is caught.
    """
    fingerprints, f = [], 0
    for t in ids:
        f = (f * 31 + t + 1) % 997
        fingerprints.append(f)
    pos = torch.tensor(fingerprints, dtype=torch.float64) * 1000 + torch.arange(len(ids))
    head = torch.arange(HEADS, dtype=torch.float64)[:, None, None] / 4
    dim = torch.arange(DIM, dtype=torch.float64)[None, None, :] / 16
    k = (pos[None, :, None] + layer / 2 + head + dim).to(torch.float32)
    return k, -k


def filled(ids: list[int]) -> KVCache:
    kv = new_kv()
    kv.reserve(len(ids))
    for layer in range(LAYERS):
        kv.write(layer, 0, *reference(ids, layer))
    kv.advance(len(ids))
    return kv


def assert_loaded(cache: PrefixCache, query: list[int], expected_len: int, limit: int | None = None) -> None:
    kv = new_kv()
    assert cache.load(query, kv, limit=limit) == expected_len
    assert kv.length == expected_len
    for layer in range(LAYERS):
        k, v = reference(query[:expected_len], layer)
        assert torch.equal(kv.k[layer][:, :expected_len], k)
        assert torch.equal(kv.v[layer][:, :expected_len], v)


def insert(cache: PrefixCache, ids: list[int]) -> None:
    cache.insert(ids, filled(ids))


def test_load_after_insert_restores_kv() -> None:
    cache = PrefixCache(1000)
    ids = [5, 3, 8, 1, 9, 2, 7, 7, 4, 6]
    insert(cache, ids)
    assert cache.match_length(ids) == 10
    assert_loaded(cache, ids, 10)
    assert_loaded(cache, [*ids, 11, 12], 10)  # a longer query gets the cached prefix
    assert_loaded(cache, [6, *ids], 0)
    assert cache.stats.stored_tokens == 10 and cache.stats.nodes == 1


def test_stored_kv_is_a_copy() -> None:
    cache = PrefixCache(1000)
    ids = [1, 2, 3, 4, 5]
    kv = filled(ids)
    cache.insert(ids, kv)
    for layer in range(LAYERS):
        kv.k[layer].zero_()
        kv.v[layer].zero_()
    assert_loaded(cache, ids, 5)


def test_branching_splits_and_both_branches_load() -> None:
    cache = PrefixCache(1000)
    a, b, c, d, x, y = 1, 2, 3, 4, 24, 25
    insert(cache, [a, b, c, d])
    insert(cache, [a, b, x, y])
    assert cache.stats.nodes == 3  # [a b] -> {[c d], [x y]}
    assert cache.stats.stored_tokens == 6
    assert cache.match_length([a, b, c, d]) == 4
    assert cache.match_length([a, b, x, y]) == 4
    assert cache.match_length([a, b, 9]) == 2
    assert cache.match_length([a, b, c, y]) == 3
    assert_loaded(cache, [a, b, c, d], 4)
    assert_loaded(cache, [a, b, x, y], 4)
    assert_loaded(cache, [a, b, x, 9, 9], 3)
    # split the lower segment again, under an existing split
    insert(cache, [a, b, c, 7, 7])
    assert cache.stats.nodes == 5 and cache.stats.stored_tokens == 8
    for ids in ([a, b, c, d], [a, b, c, 7, 7], [a, b, x, y]):
        assert_loaded(cache, ids, len(ids))


def test_match_inside_a_segment_does_not_split() -> None:
    cache = PrefixCache(1000)
    ids = [1, 2, 3, 4, 5, 6, 7, 8]
    insert(cache, ids)
    assert cache.match_length([1, 2, 3]) == 3
    assert cache.match_length([1, 2, 3, 9]) == 3
    assert cache.match_length([9]) == 0
    assert cache.match_length([]) == 0
    assert_loaded(cache, [1, 2, 3, 9], 3)
    insert(cache, [1, 2, 3])  # a prefix of what is stored: nothing to add, nothing to split
    assert cache.stats.nodes == 1 and cache.stats.stored_tokens == 8
    assert_loaded(cache, ids, 8)


def test_limit() -> None:
    cache = PrefixCache(1000)
    insert(cache, [1, 2, 3, 4, 5, 6])
    insert(cache, [1, 2, 3, 9, 9, 9])  # [1 2 3] -> {[4 5 6], [9 9 9]}
    assert_loaded(cache, [1, 2, 3, 4, 5, 6], 5, limit=5)  # stops inside the second segment
    assert_loaded(cache, [1, 2, 3, 9, 9, 9], 2, limit=2)  # stops inside the first
    assert_loaded(cache, [1, 2, 3, 9, 9, 9], 3, limit=3)  # exactly at the boundary
    assert_loaded(cache, [1, 2, 3, 9], 4, limit=100)
    assert_loaded(cache, [1, 2, 3], 0, limit=0)


def test_bad_arguments() -> None:
    cache = PrefixCache(1000)
    insert(cache, [1, 2, 3])
    with pytest.raises(ValueError):
        cache.load([1, 2, 3], filled([7]))
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3, 4], filled([1, 2, 3]))
    with pytest.raises(ValueError):
        PrefixCache(-1)


def test_lru_eviction_order_and_budget() -> None:
    cache = PrefixCache(12)
    a, b, c, d = [1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3], [4, 4, 4, 4]
    for ids in (a, b, c):
        insert(cache, ids)
    assert cache.stats.stored_tokens == 12 and cache.stats.evicted_tokens == 0
    assert_loaded(cache, a, 4)  # touch the oldest: b is now least recently used
    insert(cache, d)
    assert cache.stats.stored_tokens == 12 and cache.stats.evicted_tokens == 4
    assert [cache.match_length(ids) for ids in (a, b, c, d)] == [4, 0, 4, 4]
    insert(cache, [5, 5])  # c is oldest now; only 2 tokens must go, trimmed from its end
    assert cache.stats.stored_tokens == 12 and cache.stats.evicted_tokens == 6
    assert [cache.match_length(ids) for ids in (a, c, d, [5, 5])] == [4, 2, 4, 2]
    assert_loaded(cache, c, 2)
    assert cache.nbytes == 12 * TOKEN_BYTES


def test_sequence_longer_than_budget_keeps_its_prefix() -> None:
    cache = PrefixCache(5)
    insert(cache, [9, 9])
    insert(cache, list(range(1, 9)))
    assert cache.stats.stored_tokens == 5
    assert cache.match_length([9, 9]) == 0
    assert_loaded(cache, list(range(1, 9)), 5)


def test_parents_are_not_evicted_before_children() -> None:
    cache = PrefixCache(1000)
    insert(cache, [1, 2, 3, 4])
    insert(cache, [1, 2, 5, 6])  # [1 2] -> {[3 4], [5 6]}
    insert(cache, [7, 7])
    assert_loaded(cache, [1, 2, 3, 4], 4)  # stamps [1 2] and [3 4] newest, together
    assert cache.evict(2) == 2  # [5 6]: least recently used leaf
    assert [cache.match_length(ids) for ids in ([1, 2, 3, 4], [1, 2, 5, 6], [7, 7])] == [4, 2, 2]
    assert cache.evict(2) == 2  # [7 7]
    assert cache.match_length([7, 7]) == 0
    assert cache.evict(2) == 2  # [3 4], not its parent [1 2] (same stamp)
    assert cache.match_length([1, 2, 3, 4]) == 2
    assert_loaded(cache, [1, 2], 2)
    assert cache.stats.nodes == 1
    assert cache.evict(5) == 2  # the parent is a leaf now; only 2 tokens left
    assert cache.stats.stored_tokens == 0 and cache.stats.nodes == 0 and cache.nbytes == 0


def test_partial_use_refreshes_only_the_nodes_used() -> None:
    cache = PrefixCache(1000)
    insert(cache, [1, 2, 3, 4])
    insert(cache, [1, 2, 5, 6])  # [1 2] -> {[3 4] (older), [5 6]}
    insert(cache, [7, 7])
    assert_loaded(cache, [1, 2, 3, 4], 2, limit=2)  # uses [1 2] only: [3 4] stays the oldest
    assert cache.evict(2) == 2
    assert [cache.match_length(ids) for ids in ([1, 2, 3, 4], [1, 2, 5, 6])] == [2, 4]
    assert cache.evict(4) == 4  # [5 6]; then [7 7], older than the parent [1 2] that just became a leaf
    assert cache.match_length([7, 7]) == 0 and cache.match_length([1, 2]) == 2


def test_reinsert_refreshes_recency() -> None:
    cache = PrefixCache(1000)
    insert(cache, [1, 2, 3, 4])
    insert(cache, [9, 9])
    insert(cache, [1, 2, 3, 4])  # stores nothing but counts as a use
    assert cache.evict(2) == 2
    assert cache.match_length([9, 9]) == 0 and cache.match_length([1, 2, 3, 4]) == 4


def test_subtree_goes_before_a_newer_branch() -> None:
    cache = PrefixCache(1000)
    insert(cache, [1, 2, 3, 4])
    insert(cache, [1, 2, 5, 6])
    insert(cache, [8, 8, 8, 8])
    assert cache.evict(6) == 6  # both children, then their parent, which became the oldest leaf
    assert cache.match_length([1]) == 0
    assert cache.match_length([8, 8, 8, 8]) == 4


def test_stats_counters() -> None:
    cache = PrefixCache(1000)
    insert(cache, [1, 2, 3, 4])
    insert(cache, [1, 2, 9])
    cache.match_length([1, 2, 3])  # not a lookup
    s = cache.stats
    assert (s.lookups, s.hit_tokens, s.stored_tokens, s.nodes, s.evicted_tokens) == (0, 0, 5, 3, 0)
    assert_loaded(cache, [1, 2, 3, 4], 4)
    assert_loaded(cache, [1, 2, 9, 9], 3)
    assert_loaded(cache, [5], 0)
    s = cache.stats
    assert (s.lookups, s.hit_tokens) == (3, 7)
    assert cache.nbytes == 5 * TOKEN_BYTES
    assert cache.evict(3) == 3
    assert cache.stats.evicted_tokens == 3 and cache.stats.stored_tokens == 2
    assert cache.evict(100) == 2 and cache.stats.evicted_tokens == 5
    cache.clear()
    assert cache.stats.lookups == 3 and cache.stats.nodes == 0


def test_budget_zero_stores_nothing() -> None:
    cache = PrefixCache(0)
    insert(cache, [1, 2, 3])
    assert cache.match_length([1, 2, 3]) == 0
    assert_loaded(cache, [1, 2, 3], 0)
    s = cache.stats
    assert (s.stored_tokens, s.nodes, s.evicted_tokens, cache.nbytes) == (0, 0, 0, 0)


def test_reinsert_stores_only_what_is_missing() -> None:
    cache = PrefixCache(1000)
    ids = [4, 5, 6, 7]
    insert(cache, ids)
    before = cache.stats
    insert(cache, ids)
    assert cache.stats == before
    insert(cache, [*ids, 8, 9])  # an extension adds only its suffix
    assert cache.stats.stored_tokens == 6 and cache.stats.nodes == 2
    assert_loaded(cache, [*ids, 8, 9], 6)


def test_clear() -> None:
    cache = PrefixCache(1000)
    insert(cache, [1, 2, 3])
    cache.clear()
    assert cache.match_length([1, 2, 3]) == 0 and cache.nbytes == 0 and cache.stats.stored_tokens == 0
    insert(cache, [1, 2])
    assert_loaded(cache, [1, 2, 3], 2)


def _random_sequences(rng: random.Random, count: int) -> list[list[int]]:
    seqs: list[list[int]] = []
    for _ in range(count):
        head = rng.choice(seqs)[: rng.randint(0, 20)] if seqs and rng.random() < 0.7 else []
        seqs.append(head + [rng.randrange(4) for _ in range(rng.randint(1, 20))])
    return seqs


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_against_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    seqs = _random_sequences(rng, 30)
    cache = PrefixCache(100_000)
    for ids in seqs:
        insert(cache, ids)
    distinct_prefixes = {tuple(ids[:n]) for ids in seqs for n in range(1, len(ids) + 1)}
    assert cache.stats.stored_tokens == len(distinct_prefixes)
    assert cache.stats.evicted_tokens == 0
    queries = [[*rng.choice(seqs)[: rng.randint(0, 45)], rng.randrange(5)] for _ in range(60)]
    queries += [[rng.randrange(4) for _ in range(rng.randint(1, 30))] for _ in range(20)]
    for query in queries:
        best = max(_lcp(query, ids) for ids in seqs)
        assert cache.match_length(query) == best
        assert_loaded(cache, query, best)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_under_a_small_budget_stays_consistent(seed: int) -> None:
    rng = random.Random(seed)
    seqs = _random_sequences(rng, 40)
    cache = PrefixCache(40)
    for ids in seqs:
        insert(cache, ids)
        assert cache.stats.stored_tokens <= 40
        assert cache.nbytes == cache.stats.stored_tokens * TOKEN_BYTES
        assert cache.match_length(ids) == min(len(ids), 40)  # the newest sequence is never evicted first
        for query in rng.sample(seqs, 3):
            assert_loaded(cache, query, cache.match_length(query))
