"""Router-lookahead prefetch: co-routing counts and predictions against a plain count by hand, and the
residency's prefetch step (fills apart from the demand counters; the LRU's invariants kept)."""

from __future__ import annotations

import numpy as np
import torch

from freetoken.runtime.moe.lookahead import CoRouting
from freetoken.runtime.moe.residency import ExpertResidency


def by_hand(passes: list[np.ndarray], experts: int) -> np.ndarray:
    """passes: [T, L, K] choices (-1: none) -> follow [L - 1, E, E] by loops."""
    layers = passes[0].shape[1]
    follow = np.zeros((layers - 1, experts, experts), dtype=np.int64)
    for ids in passes:
        for t in range(ids.shape[0]):
            for row in range(1, layers):
                for a in ids[t, row - 1]:
                    for b in ids[t, row]:
                        if a >= 0 and b >= 0:
                            follow[row - 1, a, b] += 1
    return follow


def test_counts_and_predictions_match_a_count_by_hand() -> None:
    rng = np.random.default_rng(0)
    layers, experts, k = 4, 12, 3
    co = CoRouting(layers, experts, width=4, device="cpu")
    passes = []
    for _ in range(30):
        t = int(rng.integers(1, 5))
        ids = np.stack([rng.permutation(experts)[:k] for _ in range(t * layers)]).reshape(t, layers, k)
        ids[rng.random(ids.shape) < 0.1] = -1
        passes.append(ids)
        for row in range(1, layers):
            co.learn(row, torch.from_numpy(ids[:, row - 1]), torch.from_numpy(ids[:, row]))
    follow = by_hand(passes, experts)
    assert np.array_equal(co.follow.numpy(), follow)
    ids = passes[-1][:, 1]  # [T, K] at row 1 -> row 2's likely experts
    present = np.zeros(experts, dtype=np.int64)
    present[ids[ids >= 0]] = 1
    score = present @ follow[1]
    order = sorted(range(experts), key=lambda e: (-score[e], e))[:4]
    want = [e if score[e] > 0 else -1 for e in order]
    got, scores = co.predict(1, torch.from_numpy(ids))
    assert got[0].tolist() == want
    assert scores[0].tolist() == [float(score[e]) for e in order]


def test_nothing_learned_predicts_nothing() -> None:
    co = CoRouting(3, 8, width=2, device="cpu")
    got, _ = co.predict(0, torch.tensor([[1, 2]]))
    assert got.tolist() == [[-1, -1]]


def inverse(res: ExpertResidency) -> bool:
    owner = res.owner.tolist()
    table = res.slot_of.view(-1).tolist()
    held = [(key, slot) for key, slot in enumerate(table) if slot >= 0]
    return all(owner[slot] == key for key, slot in held) and sum(o >= 0 for o in owner) == len(held)


def test_a_prefetch_admits_every_prediction_and_counts_apart() -> None:
    res = ExpertResidency((0, 1), 6, 3, "cpu")
    res.ensure(0, torch.tensor([[0, 1]]), torch.ones(1, 2))  # two slots: layer 0's 0 and 1
    plan, count = res.prefetch(1, torch.tensor([[4, 2, -1]]), torch.tensor([[5.0, 3.0, 0.0]]))
    # admitted in ascending id (the LRU step's order): 2 takes the empty slot, 4 the oldest (layer 0's 0)
    assert int(count) == 2 and plan[:2].tolist() == [[2, 2], [4, 0]]
    assert res.slot_of[1, 4] == 0 and res.slot_of[1, 2] == 2 and res.slot_of[0, 0] < 0
    hits, misses, fills, evictions, _ = res.prefetch_counters[1].tolist()
    assert (hits, misses, fills, evictions) == (0, 2, 2, 1)
    assert res.counters[1].sum() == 0  # the demand counters saw nothing
    assert inverse(res)
    res.ensure(1, torch.tensor([[2, 4]]), torch.ones(1, 2))
    assert res.counters[1, :3].tolist() == [2, 0, 0]  # both prefetched: hits
    assert inverse(res)


def test_slots_short_admit_the_likeliest() -> None:
    res = ExpertResidency((0, 1), 6, 2, "cpu")
    res.ensure(0, torch.tensor([[0]]), torch.ones(1, 1))
    # one slot free, layer 0's expert 0 the only other: both predictions fit only by evicting it
    plan, count = res.prefetch(1, torch.tensor([[5, 3, 1]]), torch.tensor([[1.0, 9.0, 4.0]]))
    assert int(count) == 2 and sorted(plan[:2, 0].tolist()) == [1, 3]  # 9 and 4 beat 1
    assert inverse(res)
