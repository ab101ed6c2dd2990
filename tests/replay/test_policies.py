"""Cache policies replayed on routing traces: hand-computed counts, brute-force optima, the runtime's LRU."""

from __future__ import annotations

from collections import OrderedDict
from functools import cache
from itertools import combinations

import numpy as np
import pytest
import torch

from freetoken.replay.policies import POLICIES, ReplayResult, simulate
from freetoken.replay.trace import DECODE, PREFILL, RoutingTrace
from freetoken.runtime.moe.residency import ExpertResidency

DEMAND = ("lru", "lru-per-layer", "lfu", "belady")  # admit every miss that fits (lookahead prefetches too)


def make_trace(
    experts: np.ndarray | list,
    num_experts: int,
    phase: list[int] | None = None,
    pass_id: list[int] | None = None,
) -> RoutingTrace:
    """experts [N, L, K]; default: every row a decode pass of its own."""
    ex = np.asarray(experts, dtype=np.int64)
    n, layers, k = ex.shape
    return RoutingTrace(
        ex,
        np.full(n, DECODE, dtype=np.uint8) if phase is None else np.asarray(phase, dtype=np.uint8),
        np.zeros(n, dtype=np.int32),
        np.arange(n, dtype=np.int32) if pass_id is None else np.asarray(pass_id, dtype=np.int32),
        {"model": "t", "moe_layers": list(range(layers)), "num_experts": num_experts, "top_k": k},
    )


def random_trace(seed: int, rows: int = 300, layers: int = 3, experts: int = 16, k: int = 2) -> RoutingTrace:
    rng = np.random.default_rng(seed)
    ex = np.array([[rng.choice(experts, k, replace=False) for _ in range(layers)] for _ in range(rows)])
    return make_trace(ex, experts)


def misses(r: ReplayResult) -> int:
    return r.decode_misses + r.prefill_misses


def brute_force_optimum(keys: list[int], capacity: int, initial: frozenset[int] = frozenset()) -> int:
    """Fewest misses over every sequence of choices at a miss: bypass it, or admit it (evicting any resident
    when full)."""

    @cache
    def best(t: int, resident: frozenset[int]) -> int:
        if t == len(keys):
            return 0
        key = keys[t]
        if key in resident:
            return best(t + 1, resident)
        options = [best(t + 1, resident)]  # bypass
        if len(resident) < capacity:
            options.append(best(t + 1, resident | {key}))
        options += [best(t + 1, (resident - {victim}) | {key}) for victim in resident]
        return 1 + min(options)

    return best(0, initial)


CYCLE = make_trace(np.arange(50).reshape(50, 1, 1) % 5, 5)  # 0 1 2 3 4 0 1 2 ... , 50 single reads


@pytest.mark.parametrize(
    ("policy", "cold", "warm"),
    [
        # the 4 most recent are resident, the next read is always the fifth: every read misses; warm
        # {0,1,2,3} only saves the first four
        ("lru", 50, 46),
        ("lru-per-layer", 50, 46),  # one layer: the same as lru
        # on a cycle the counts stay level, so the least frequent resident is the least recent one: = lru
        ("lfu", 50, 46),
        # {0,1,2,3} forever (warm or not): only the 10 reads of expert 4 miss
        ("static", 10, 10),
        ("prefill-pinned", 10, 10),  # no prefill pass: the static set
        # with bypass: 4 compulsory misses fill {0,1,2,3}; expert 4 is always needed no sooner than the
        # farthest resident, so it is bypassed, never admitted: its 10 reads miss -> 14; warm -> 10
        # (forced admission would give 16 / 12: every 4th read)
        ("belady", 14, 10),
        # wrap counts learn i -> i+1; the first usable prediction comes after t=5 (wrap[0] -> 1 was learnt
        # at t=1), from then on the next expert is always prefetched: cold misses t=0..5, warm t=4, 5
        ("lookahead", 6, 2),
    ],
)
def test_cyclic_access_exact_counts(policy: str, cold: int, warm: int) -> None:
    assert misses(simulate(policy, CYCLE, 4)) == cold
    assert misses(simulate(policy, CYCLE, 4, warm=True)) == warm


def test_cyclic_belady_is_the_brute_force_optimum_and_fetches() -> None:
    keys = (np.arange(50) % 5).tolist()
    assert brute_force_optimum(keys, 4) == 14
    assert brute_force_optimum(keys, 4, frozenset(range(4))) == 10
    assert simulate("belady", CYCLE, 4).fetches == 4
    assert simulate("belady", CYCLE, 4, warm=True).fetches == 4
    assert simulate("static", CYCLE, 4).fetches == 4
    assert simulate("lookahead", CYCLE, 4).fetches == 6 + 45  # one prefetch after each of t = 5..49


@pytest.mark.parametrize("seed", range(4))
def test_belady_equals_exhaustive_search(seed: int) -> None:
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, 4, 14)
    trace = make_trace(keys.reshape(14, 1, 1), 4)
    assert misses(simulate("belady", trace, 2)) == brute_force_optimum(keys.tolist(), 2)
    warm = frozenset({0, 1})  # warm start of one layer, capacity 2: experts 0, 1
    assert misses(simulate("belady", trace, 2, warm=True)) == brute_force_optimum(keys.tolist(), 2, warm)


def brute_force_groups(steps: list[list[int]], capacity: int, initial: frozenset[int] = frozenset()) -> int:
    """Fewest misses over every choice per group: which of its misses to admit (any number that fits
    beside its hits, none included: the rest are bypassed) and which non-group residents to evict."""

    @cache
    def best(t: int, resident: frozenset[int]) -> int:
        if t == len(steps):
            return 0
        group = frozenset(steps[t])
        hits, misses = group & resident, sorted(group - resident)
        most = min(len(misses), capacity - len(hits))
        others = sorted(resident - group)
        return len(misses) + min(
            best(t + 1, (resident - set(gone)) | set(chosen))
            for admit in range(most + 1)
            for chosen in combinations(misses, admit)
            for gone in combinations(others, max(0, len(resident) + admit - capacity))
        )

    return best(0, initial)


@pytest.mark.parametrize("seed", range(8))
def test_belady_equals_exhaustive_search_with_batched_groups(seed: int) -> None:
    # passes of 1..3 rows: groups of up to 3 distinct experts, often more misses than fit at capacity 2
    rng = np.random.default_rng(100 + seed)
    pass_id = np.repeat(np.arange(9), rng.integers(1, 4, 9))
    ex = rng.integers(0, 5, (len(pass_id), 1, 1))
    trace = make_trace(ex, 5, pass_id=pass_id.tolist())
    steps = [g.experts.tolist() for g in trace.groups()]
    for capacity in (1, 2, 3):
        assert misses(simulate("belady", trace, capacity)) == brute_force_groups(steps, capacity), capacity
        warm = frozenset(range(capacity))  # one layer: the warm start holds experts 0 .. capacity-1
        got = simulate("belady", trace, capacity, warm=True)
        assert misses(got) == brute_force_groups(steps, capacity, warm), capacity


@pytest.mark.parametrize("capacity", [6, 7, 10])
def test_fixed_working_set_misses_once_each(capacity: int) -> None:
    # layer 0 and layer 1 both read only experts {0, 1, 2}: W = 6 (layer, expert), and the warm start at
    # capacity >= 6 (slot s -> layer s % 2, expert s // 2) holds all six, as does the static set
    rng = np.random.default_rng(capacity)
    ex = np.array([[rng.choice(3, 2, replace=False) for _ in range(2)] for _ in range(40)])
    trace = make_trace(ex, 8)
    for policy in (*DEMAND, "lookahead"):
        assert misses(simulate(policy, trace, capacity)) == 6, policy
        assert misses(simulate(policy, trace, capacity, warm=True)) == 0, policy
    for policy in ("static", "prefill-pinned"):
        assert misses(simulate(policy, trace, capacity)) == 0, policy


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("warm", [False, True])
def test_belady_bounds_every_policy_on_random_traces(seed: int, warm: bool) -> None:
    trace = random_trace(seed)
    for capacity in range(4, 41, 3):
        best = simulate("belady", trace, capacity, warm=warm)
        placed = capacity if warm else 0
        assert best.fetches <= placed + misses(best)  # bypassed misses are not fetched
        for policy in DEMAND:
            assert misses(best) <= misses(simulate(policy, trace, capacity, warm=warm)), (policy, capacity)
        # any policy that admits all its misses loads at least the optimum's misses, prefetching or not
        assert misses(best) <= simulate("lookahead", trace, capacity, warm=warm).fetches - placed


def reference_lru(trace: RoutingTrace, capacity: int, warm: bool) -> tuple[int, int, int]:
    """Textbook LRU over (layer, expert): hits touched in ascending order, then at most (capacity − hits)
    misses admitted in ascending order, evicting the oldest non-group entry. -> (hits, misses, fetches)"""
    order: OrderedDict[tuple[int, int], None] = OrderedDict()
    layers = trace.num_layers
    if warm:
        for s in range(capacity):
            order[(s % layers, s // layers)] = None
    hits = miss = fetches = 0
    for g in trace.groups():
        ids = g.experts.tolist()
        present = [e for e in ids if (g.layer, e) in order]
        for e in present:
            order.move_to_end((g.layer, e))
        absent = [e for e in ids if (g.layer, e) not in order]
        for e in absent[: capacity - len(present)]:
            if len(order) == capacity:
                del order[next(k for k in order if k[0] != g.layer or k[1] not in ids)]
            order[(g.layer, e)] = None
            fetches += 1
        hits, miss = hits + len(present), miss + len(absent)
    return hits, miss, fetches + (capacity if warm else 0)


def batched_trace(seed: int) -> RoutingTrace:
    """Passes of 1..5 rows (prefill chunks and batched decode), L=3, E=16, top-4: groups up to 16."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 6, 80)
    pass_id = np.repeat(np.arange(80), sizes)
    ex = np.array([[rng.choice(16, 4, replace=False) for _ in range(3)] for _ in pass_id])
    phase = np.where(rng.random(80) < 0.3, PREFILL, DECODE)[pass_id]
    return make_trace(ex, 16, phase=phase.tolist(), pass_id=pass_id.tolist())


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("warm", [False, True])
def test_lru_is_the_runtime_residency(seed: int, warm: bool) -> None:
    trace = batched_trace(seed)
    for capacity in (1, 3, 8, 17, 30, 48):
        residency = ExpertResidency(range(3), 16, capacity, "cpu")
        fetches = len(residency.warm_start()) if warm else 0
        for g in trace.groups():  # the engine's policy step, on the group's experts
            ids = torch.from_numpy(g.experts.astype(np.int64))[None]
            residency.ensure(g.layer, ids, torch.full(ids.shape, 0.5))
        hits, miss, fills = residency.counters[:, :3].sum(dim=0).tolist()
        fetches += fills
        got = simulate("lru", trace, capacity, warm=warm)
        assert (got.decode_hits + got.prefill_hits, misses(got), got.fetches) == (hits, miss, fetches)
        assert (hits, miss, fetches) == reference_lru(trace, capacity, warm)
        # lookahead without prefetching is exactly lru
        plain = simulate("lookahead", trace, capacity, warm=warm, width=0)
        assert plain.__dict__ | {"policy": "lru"} == got.__dict__
        plain = simulate("lru-prefetch", trace, capacity, warm=warm, width=0)  # likewise the engine's
        assert plain.__dict__ | {"policy": "lru"} == got.__dict__


def test_whole_pool_misses_each_expert_once() -> None:
    trace = batched_trace(7)
    distinct = len({(g.layer, int(e)) for g in trace.groups() for e in g.experts})
    for policy in (*DEMAND, "lookahead"):
        assert misses(simulate(policy, trace, 48)) == distinct, policy
        assert misses(simulate(policy, trace, 48, warm=True)) == 0, policy


def test_prefill_and_decode_are_counted_apart() -> None:
    # L=1, E=4, top-2, capacity 2. prefill pass {0,1,2}: 3 misses, room for 2 -> admit 0, 1 (2 is
    # computed elsewhere). decode {2,3}: 2 misses, evict 0 and 1. decode {0,3}: 3 hits, 0 misses and
    # evicts 2. -> prefill 0 hits / 3 misses, decode 1 / 3, fetches 2 + 2 + 1
    trace = make_trace([[[0, 1]], [[1, 2]], [[2, 3]], [[0, 3]]], 4, [0, 0, 1, 1], [0, 0, 1, 2])
    got = simulate("lru", trace, 2)
    assert (got.prefill_hits, got.prefill_misses, got.decode_hits, got.decode_misses) == (0, 3, 1, 3)
    assert got.fetches == 5
    assert (got.prefill_miss_rate, got.decode_miss_rate, got.miss_rate) == (1.0, 0.75, 6 / 7)
    empty = ReplayResult("lru", 2, 0, 0, 0, 0, 0)
    assert (empty.decode_miss_rate, empty.prefill_miss_rate, empty.miss_rate) == (0.0, 0.0, 0.0)


def test_prefill_pinned_by_hand() -> None:
    # L=2, E=4, top-2, capacity 3; static set (0,0) (1,0) (0,1)
    ex = [
        [[0, 1], [0, 2]],  # pass 0 decode: hits (0,0) (0,1) (1,0), miss (1,2)
        [[2, 3], [3, 1]],  # pass 1 prefill, 3 rows: l0 {1,2,3} 1 hit 2 misses, l1 {0,1,3} 1 hit 2 misses
        [[2, 3], [3, 0]],
        [[2, 1], [3, 1]],  # freq (0,2)=3 (1,3)=3 (0,3)=2 (1,1)=2 ... -> pin (0,2) (1,3) (0,3): 3 fetched
        [[2, 3], [3, 0]],  # pass 2 decode: 3 hits, miss (1,0)
        [[0, 1], [1, 3]],  # pass 3 prefill: 1 hit (1,3), 3 misses; all freq 1 -> resident (1,3) first,
        #                    then (0,0) (0,1): 2 fetched
        [[0, 2], [3, 2]],  # pass 4 decode: hits (0,0) (1,3), misses (0,2) (1,2)
    ]
    trace = make_trace(ex, 4, [1, 0, 0, 0, 1, 0, 1], [0, 1, 1, 1, 2, 3, 4])
    for warm in (False, True):  # routing-blind start either way
        got = simulate("prefill-pinned", trace, 3, warm=warm)
        assert (got.decode_hits, got.decode_misses, got.prefill_hits, got.prefill_misses) == (8, 4, 3, 7)
        assert got.fetches == 3 + 3 + 2
    static = simulate("static", trace, 3)
    assert (static.decode_hits, static.decode_misses, static.prefill_hits, static.prefill_misses) == (
        5,
        7,
        4,
        6,
    )


def test_lru_per_layer_budgets() -> None:
    # L=2, capacity 3 -> budgets 2 (layer 0) and 1 (layer 1); both layers alternate experts 0, 1.
    # global lru cycles 4 keys through 3 slots: all 20 reads miss; per layer: layer 0 misses twice,
    # layer 1 (one slot, alternating) every time: 2 + 10
    trace = make_trace((np.arange(10) % 2)[:, None, None].repeat(2, axis=1), 2)
    assert misses(simulate("lru", trace, 3)) == 20
    assert misses(simulate("lru-per-layer", trace, 3)) == 12
    keys = [layer * 2 + t % 2 for t in range(10) for layer in range(2)]
    assert misses(simulate("belady", trace, 3)) == brute_force_optimum(keys, 3)
    assert misses(simulate("lru-per-layer", trace, 1)) == 20  # capacity < L: layer 1 has no slot


def test_lookahead_beats_lru_on_cross_layer_structure() -> None:
    # layer 0 random, layer l+1 = perm_l(layer l): once learnt, layers 1..3 are always prefetched
    rng = np.random.default_rng(0)
    layers, experts, rows = 4, 16, 400
    perms = [rng.permutation(experts) for _ in range(layers - 1)]
    first = np.array([rng.choice(experts, 2, replace=False) for _ in range(rows)])
    ex = [first]
    for perm in perms:
        ex.append(perm[ex[-1]])
    trace = make_trace(np.stack(ex, axis=1), experts)
    for capacity in (12, 24, 40):
        base = simulate("lru", trace, capacity)
        for policy in ("lookahead", "lru-prefetch"):
            ours = simulate(policy, trace, capacity)
            assert misses(ours) < 0.5 * misses(base), (policy, capacity)
            assert misses(simulate("belady", trace, capacity)) <= ours.fetches


def test_lookahead_by_hand_keeps_the_pass_resident() -> None:
    # L=2, E=2, capacity 2, passes alternate (0,0)(1,0) / (0,1)(1,1). Passes 0 and 1 miss everything and
    # learn follow[0]: 0->0, 1->1 and wrap 0->1, 1->0. From pass 2 on, after layer 0 the matching layer-1
    # expert is prefetched (evicting the other layer-1 expert) and hits; the wrap prediction after layer 1
    # finds both slots held by this pass (protected), so layer 0 still misses: 2 + 2 + 6 · 1 misses,
    # fetches = 10 misses + 6 prefetches
    trace = make_trace((np.arange(8) % 2)[:, None, None].repeat(2, axis=1), 2)
    got = simulate("lookahead", trace, 2)
    assert (misses(got), got.fetches) == (10, 16)
    assert misses(simulate("lru", trace, 2)) == 16


def test_lookahead_by_hand_keeps_the_predicted_resident() -> None:
    # L=2, E=3, top-2, capacity 3. Pass 0: l0 {0,2} fills 2 slots, l1 {1,2} evicts (0,0); learnt
    # follow[0] = 0->{1,2}, 2->{1,2}. Pass 1: l0 {0,1} evicts (0,2) (1,1); predicted for layer 1:
    # (1,1) and (1,2), (1,2) still resident; the only victim would be (1,2) itself, which is protected
    # with the prediction: no prefetch. l1 {0,2}: (1,2) hits, (1,0) evicts (0,0). The wrap prediction
    # (0,0) (0,1) finds every slot held by this pass. -> 1 hit, 7 misses, 7 fetches (2 + 2 + 2 + 1)
    trace = make_trace([[[2, 0], [1, 2]], [[1, 0], [0, 2]]], 3)
    got = simulate("lookahead", trace, 3)
    assert (got.decode_hits, got.decode_misses, got.fetches) == (1, 7, 7)


@pytest.mark.parametrize("capacity", [0, -1, 3 * 16 + 1])
def test_capacity_out_of_range(capacity: int) -> None:
    trace = random_trace(0, rows=5)
    for policy in POLICIES:
        with pytest.raises(ValueError, match="capacity"):
            simulate(policy, trace, capacity)


def test_unknown_policy_and_registry() -> None:
    assert list(POLICIES) == [
        "lru",
        "lru-prefetch",
        "lru-per-layer",
        "static",
        "prefill-pinned",
        "lfu",
        "lookahead",
        "belady",
    ]
    with pytest.raises(ValueError, match="unknown policy"):
        simulate("fifo", random_trace(0, rows=5), 4)
