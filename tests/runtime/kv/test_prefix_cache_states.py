"""The prefix tree with recurrent-state checkpoints: a hybrid cache resumes from the deepest saved state
within its match; states follow splits, go with trimmed K/V, and fit their own budget."""

from __future__ import annotations

import torch

from freetoken.runtime.kv.cache import KVCache
from freetoken.runtime.kv.prefix_cache import PrefixCache
from freetoken.runtime.kv.state_checkpoints import Checkpoint
from freetoken.runtime.models.delta_net import LinearState
from freetoken.runtime.models.qwen3_5_moe import HybridCache


def filled(cls: type[KVCache], n: int, base: float = 0.0) -> KVCache:
    """A cache of 2 layers holding n positions whose K is base + position (V its negative)."""
    kv = cls(2, 1, 2, torch.float32, torch.device("cpu"), 128)
    kv.reserve(n)
    for layer in range(2):
        k = (base + torch.arange(n, dtype=torch.float32)).view(1, n, 1).expand(1, n, 2)
        kv.write(layer, 0, k, -k)
    kv.advance(n)
    return kv


def states(positions: list[int], kind: str = "turn:open", tag: float = 0.0) -> dict[int, Checkpoint]:
    """Checkpoints whose state holds tag + position, so a restore can be told apart."""
    return {
        p: Checkpoint(p, kind, {0: LinearState(torch.full((2,), tag + p), torch.full((2, 2), tag + p))})
        for p in positions
    }


def load(tree: PrefixCache, ids: list[int], limit: int | None = None) -> tuple[int, HybridCache]:
    kv = HybridCache(2, 1, 2, torch.float32, torch.device("cpu"), 128)
    return tree.load(ids, kv, limit=limit), kv


IDS = list(range(100, 116))  # 16 tokens


def test_resumes_from_the_deepest_state_within_the_match() -> None:
    tree = PrefixCache(1000, checkpoint_budget=8)
    tree.insert(IDS, filled(HybridCache, 16), states([4, 8, 12]))
    got, kv = load(tree, [*IDS, 7, 7])
    assert got == 12 and kv.length == 12
    assert float(kv.linear[0].recurrent[0, 0]) == 12  # the states saved at 12, restored
    assert torch.equal(kv.k[1][0, :12, 0], torch.arange(12, dtype=torch.float32))
    assert load(tree, [*IDS[:10], 1, 2])[0] == 8  # diverges at 10: the state at 8
    assert load(tree, IDS, limit=11)[0] == 8
    assert load(tree, IDS[:3])[0] == 0  # no state that early: nothing reusable
    assert load(tree, [*IDS[:12], 5], limit=12)[0] == 12  # a state exactly at the limit counts


def test_states_follow_a_split_and_stay_on_their_own_branch() -> None:
    tree = PrefixCache(1000, checkpoint_budget=8)
    tree.insert(IDS, filled(HybridCache, 16), states([4, 8, 12]))
    other = [*IDS[:6], 1, 2, 3, 4]
    tree.insert(other, filled(HybridCache, 10), states([3, 9], tag=1000))  # 3 is new on the shared part
    assert tree.stats.checkpoints == 5
    assert load(tree, IDS)[0] == 12
    got, kv = load(tree, other)
    assert got == 9 and float(kv.linear[0].conv[0]) == 1009
    assert load(tree, [*IDS[:6], 1, 2, 9])[0] == 4  # on the new branch before 9: the shared state at 4


def test_trimmed_kv_takes_its_states_along() -> None:
    tree = PrefixCache(16, checkpoint_budget=8)
    tree.insert(IDS, filled(HybridCache, 16), states([4, 8, 12, 16]))
    assert tree.evict(6) == 6  # the leaf keeps positions [0, 10)
    assert tree.stats.checkpoints == 2
    assert load(tree, IDS)[0] == 8
    tree.evict(10)
    assert tree.stats.checkpoints == 0 and load(tree, IDS)[0] == 0


def test_checkpoint_budget_drops_the_oldest_insert_first() -> None:
    tree = PrefixCache(1000, checkpoint_budget=5)
    first = [1, *IDS]
    tree.insert(first, filled(HybridCache, 17), states([4, 8, 12, 16]))
    tree.insert(IDS, filled(HybridCache, 16), states([5, 10, 15], tag=500))
    assert tree.stats.checkpoints == 5
    assert load(tree, IDS)[0] == 15  # the newer conversation keeps all of its states
    got, _ = load(tree, first)
    assert got == 16  # the older lost two: the newest of its kind stays


def test_plain_kv_ignores_states_and_hybrid_needs_them() -> None:
    tree = PrefixCache(1000)  # no checkpoint budget: a hybrid cache can resume nowhere
    tree.insert(IDS, filled(KVCache, 16), states([8]))
    assert tree.stats.checkpoints == 0
    kv = filled(KVCache, 0)
    assert tree.load(IDS, kv) == 16  # attention-only K/V: the whole match
    assert load(tree, IDS)[0] == 0
