"""The device-side LRU step: its plain-torch reference on hand-made cases, and the Triton kernel against
the reference bit for bit (every state tensor and output after every step) under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from freetoken.runtime.moe.kernels.lru_ensure import (
    MAX_SCAN_BLOCK,
    lru_ensure,
    lru_ensure_reference,
    lru_kernel_available,
    use_lru_kernel,
)

State = dict[str, torch.Tensor]
STATE_KEYS = ("slot_of", "owner", "stamp", "clock", "fetch", "counters")
BIG = 1 << 20


def new_state(layers: int, experts: int, slots: int, fetch: list[float]) -> State:
    return {
        "slot_of": torch.full((layers, experts), -1, dtype=torch.int32),
        "owner": torch.full((slots,), -1, dtype=torch.int32),
        "stamp": torch.full((slots,), -1, dtype=torch.int64),
        "clock": torch.zeros(1, dtype=torch.int64),
        "fetch": torch.tensor(fetch, dtype=torch.float32),
        "counters": torch.zeros(layers, 5, dtype=torch.int64),
    }


def place(state: State, row: int, expert: int, slot: int, stamp: int) -> None:
    experts = state["slot_of"].shape[1]
    state["slot_of"][row, expert] = slot
    state["owner"][slot] = row * experts + expert
    state["stamp"][slot] = stamp
    state["clock"][0] = max(int(state["clock"][0]), stamp + 1)


def step(
    fn,
    state: State,
    ids: list[list[int]] | torch.Tensor,
    row: int,
    max_fetch: int = BIG,
    weights=None,
    plan_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step of `fn` on `state` (in place) -> (slot_ids, plan, count); plan rows T·K + 3 by default."""
    ids = torch.as_tensor(ids, dtype=torch.int64)
    weights = torch.full(ids.shape, 0.5) if weights is None else torch.as_tensor(weights)
    slot_ids = torch.full(ids.shape, -7, dtype=torch.int64)
    plan = torch.full((plan_rows or ids.numel() + 3, 2), -7, dtype=torch.int32)
    count = torch.full((1,), -7, dtype=torch.int32)
    fn(
        ids,
        weights,
        row,
        *(state[k] for k in STATE_KEYS[:5]),
        max_fetch,
        state["counters"],
        slot_ids,
        plan,
        count,
    )
    return slot_ids, plan, count


def check_invariants(
    state: State, before: State, ids: torch.Tensor, row: int, slot_ids: torch.Tensor
) -> None:
    slot_of, owner, stamp = state["slot_of"], state["owner"], state["stamp"]
    experts = slot_of.shape[1]
    flat = slot_of.flatten().long()
    for slot, key in enumerate(owner.tolist()):  # owner and slot_of are inverse
        if key >= 0:
            assert flat[key] == slot
        else:
            assert stamp[slot] == -1
    resident = (flat >= 0).nonzero().flatten()
    assert torch.equal(owner[flat[resident]].long(), resident)
    assert len(resident) <= owner.numel()
    clock0, clock = int(before["clock"][0]), int(state["clock"][0])
    assert int(stamp.max()) < clock
    hits = before["slot_of"][row, ids[ids >= 0]].long()
    hits = hits[hits >= 0]
    assert torch.equal(owner[hits].long(), (before["owner"][hits]).long())  # hits are never evicted
    assert bool((stamp[hits] >= clock0).all())
    live = slot_ids >= 0
    assert torch.equal(owner[slot_ids[live]].long(), row * experts + ids[live])
    assert bool((slot_ids[ids < 0] == -1).all())


def clone(state: State) -> State:
    return {k: v.clone() for k, v in state.items()}


# --- the reference on hand-made cases ---------------------------------------------------------------


def test_hits_are_stamped_in_ascending_expert_order() -> None:
    state = new_state(1, 8, 4, [1.0])
    for slot, expert in enumerate((5, 2, 7)):
        place(state, 0, expert, slot, stamp=slot)
    slot_ids, plan, count = step(lru_ensure_reference, state, [[7, 2], [5, -1], [2, 7]], row=0)
    assert state["stamp"].tolist() == [4, 3, 5, -1]  # expert 2 (slot 1), 5 (slot 0), 7 (slot 2)
    assert state["clock"].tolist() == [6]
    assert slot_ids.tolist() == [[2, 1], [0, -1], [1, 2]]
    assert count.tolist() == [0] and bool((plan == -1).all())
    assert state["counters"].tolist() == [[3, 0, 0, 0, 0]]


def test_empty_slots_go_first_then_the_oldest_and_eviction_clears_the_owner() -> None:
    state = new_state(2, 4, 3, [1.0, 1.0])
    place(state, 1, 3, slot=0, stamp=5)
    place(state, 0, 1, slot=2, stamp=2)
    slot_ids, plan, count = step(lru_ensure_reference, state, [[2, 0]], row=0)
    assert plan.tolist() == [[0, 1], [2, 2], [-1, -1], [-1, -1], [-1, -1]]  # ascending id, empty slot 1 first
    assert count.tolist() == [2]
    assert slot_ids.tolist() == [[2, 1]]
    assert state["slot_of"].tolist() == [[1, -1, 2, -1], [-1, -1, -1, 0]]  # (0, 1) lost slot 2
    assert state["owner"].tolist() == [7, 0, 2]
    assert state["stamp"].tolist() == [5, 6, 7]
    assert state["clock"].tolist() == [8]
    assert state["counters"].tolist() == [[0, 2, 2, 1, 0], [0, 0, 0, 0, 0]]
    slot_ids, plan, _ = step(lru_ensure_reference, state, [[1, 3]], row=1, max_fetch=1)
    assert plan[0].tolist() == [1, 1]  # (1, 3) is a hit in the oldest slot 0, so slot 1 goes
    assert slot_ids.tolist() == [[1, 0]]
    assert state["slot_of"].tolist() == [[-1, -1, 2, -1], [-1, 1, -1, 0]]
    assert state["counters"][1].tolist() == [1, 1, 1, 1, 0]


@pytest.mark.parametrize(
    ("misses", "fraction", "max_fetch", "want"),
    [
        (5, 0.0, BIG, 0),
        (5, 0.3, BIG, 2),  # 1.5 + 0.5
        (5, 0.5, BIG, 3),  # 2.5 rounds half up (Python's round would give 2)
        (5, 1.0, BIG, 5),
        (5, 4.0, BIG, 5),
        (5, 1.0, 2, 2),
        (5, 0.5, 0, 1),  # the cap is at least 1, as policy.quota
        (1, 0.3, BIG, 1),  # at least one
        (4, 0.3, BIG, 1),  # 1.7
        (3, 0.5, BIG, 2),
        (0, 1.0, BIG, 0),
        (5, -1.0, BIG, 0),
    ],
)
def test_fetch_count(misses: int, fraction: float, max_fetch: int, want: int) -> None:
    state = new_state(1, 16, 16, [fraction])
    ids = [list(range(misses))] if misses else [[-1, -1]]
    step(lru_ensure_reference, state, ids, row=0, max_fetch=max_fetch)
    assert state["counters"].tolist() == [[0, misses, want, 0, misses - want]]


def test_tokens_then_weight_then_id_choose_the_fetched_misses() -> None:
    state = new_state(1, 8, 8, [1.0])
    ids = [[3, 6], [3, 1], [3, 6], [1, 5], [4, 0]]
    weights = [[0.5, 0.25], [0.5, 0.5], [0.5, 0.25], [0.25, 0.5], [0.5, 0.5]]
    # tokens: 3 -> 3; 1, 6 -> 2 (weights 0.75 and 0.5); 0, 4, 5 -> 1 (0.5 each, so by id)
    slot_ids, plan, count = step(lru_ensure_reference, state, ids, row=0, max_fetch=4, weights=weights)
    assert count.tolist() == [4]
    assert plan[:4].tolist() == [[0, 0], [1, 1], [3, 2], [6, 3]]  # admitted in ascending id
    assert slot_ids.tolist() == [[2, 3], [2, 1], [2, 3], [1, -1], [-1, 0]]
    assert state["counters"].tolist() == [[0, 6, 4, 0, 2]]
    assert state["stamp"].tolist() == [0, 1, 2, 3, -1, -1, -1, -1]


def test_the_steps_own_hits_cap_the_fetches() -> None:
    state = new_state(1, 8, 3, [1.0])
    place(state, 0, 0, slot=0, stamp=0)
    place(state, 0, 1, slot=1, stamp=1)
    slot_ids, plan, count = step(
        lru_ensure_reference, state, [[0, 1, 2, 3]], row=0, weights=[[0.1, 0.1, 0.2, 0.3]]
    )
    assert count.tolist() == [1] and plan[0].tolist() == [3, 2]  # the heavier miss takes the one free slot
    assert slot_ids.tolist() == [[0, 1, -1, 2]]
    assert state["counters"].tolist() == [[2, 2, 1, 0, 1]]
    slot_ids, _, count = step(lru_ensure_reference, state, [[0, 1, 3, 4, 5]], row=0)
    assert count.tolist() == [0] and slot_ids.tolist() == [[0, 1, 2, -1, -1]]
    assert state["counters"].tolist() == [[5, 4, 1, 0, 3]]


def test_the_reference_takes_prefill_sized_steps() -> None:
    g = torch.Generator().manual_seed(1)
    state = new_state(2, 64, 51, [1.0, 0.4])
    for i in range(6):
        ids = torch.stack([torch.randperm(64, generator=g)[:8] for _ in range(300)])
        ids[torch.rand(ids.shape, generator=g) < 0.1] = -1
        assert not use_lru_kernel(ids, 64)
        before = clone(state)
        slot_ids, _, count = step(
            lru_ensure, state, ids, row=i % 2, weights=torch.rand(ids.shape, generator=g)
        )
        check_invariants(state, before, ids, i % 2, slot_ids)
        n_hits, m, q, _, cpu = (state["counters"][i % 2] - before["counters"][i % 2]).tolist()
        assert n_hits + m == len(ids[ids >= 0].unique()) and q == int(count[0]) and cpu == m - q
    assert int((state["owner"] >= 0).sum()) == 51


# --- the kernel against the reference ----------------------------------------------------------------


def random_ids(g: torch.Generator, tokens: int, k: int, experts: int, hot: int) -> torch.Tensor:
    """[tokens, k] distinct experts per row, mostly from the `hot` lowest ids (so steps repeat experts
    and hit), about one pair in eight -1."""
    rows = []
    for _ in range(tokens):
        pool = torch.randperm(hot if torch.rand(1, generator=g) < 0.7 and hot >= k else experts, generator=g)
        rows.append(pool[:k])
    ids = torch.stack(rows)
    ids[torch.rand(ids.shape, generator=g) < 0.125] = -1
    return ids


needs_interpreter = pytest.mark.skipif(not lru_kernel_available("cpu"), reason="needs Triton's interpreter")


@needs_interpreter
@pytest.mark.parametrize("experts", [8, 64, 128])
@pytest.mark.parametrize("share", [0.0, 0.4])  # 0: 10 slots, empty at first; 0.4: full at first
@pytest.mark.parametrize("k", [2, 8])
def test_the_kernel_matches_the_reference_step_by_step(experts: int, share: float, k: int) -> None:
    layers = 3
    slots = 10 if share == 0.0 else int(share * layers * experts)
    g = torch.Generator().manual_seed(experts * 10 + k + int(share * 100))
    kernel = new_state(layers, experts, slots, [1.0, 0.4, 0.0])
    if share:  # warm: full from the start (the small cache starts empty)
        for slot in range(slots):
            place(kernel, slot % layers, slot // layers, slot, stamp=slot)
    ref = clone(kernel)
    fetched = 0
    for i in range(40):
        tokens = (1, 3, 8, 16)[i % 4]
        row = (i // 4) % layers
        ids = random_ids(g, tokens, k, experts, hot=max(k, experts // 2))
        weights = (torch.randint(1, 9, ids.shape, generator=g) / 8).to(
            torch.bfloat16 if i % 3 else torch.float32
        )
        max_fetch = (2, BIG)[i % 2]
        assert use_lru_kernel(ids, experts)
        before = clone(ref)
        got = step(lru_ensure, kernel, ids, row, max_fetch, weights)
        want = step(lru_ensure_reference, ref, ids, row, max_fetch, weights)
        for name in STATE_KEYS:
            assert torch.equal(kernel[name], ref[name]), (i, name)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), (i, a, b)
        check_invariants(ref, before, ids, row, want[0])
        fetched += int(want[2][0])
    assert fetched > 0 and int(ref["counters"][:, 0].sum()) > 0  # the trace both fills and hits
    assert int(ref["counters"][:, 3].sum()) > 0  # and evicts


@needs_interpreter
def test_the_kernel_on_hand_made_cases() -> None:
    for fn in (lru_ensure, lru_ensure_reference):
        state = new_state(1, 8, 8, [1.0])
        place(state, 0, 2, slot=5, stamp=0)
        ids = [[3, 6], [3, 1], [3, 6], [1, 5], [4, 2]]
        weights = [[0.5, 0.25], [0.5, 0.5], [0.5, 0.25], [0.25, 0.5], [0.5, 0.5]]
        slot_ids, plan, count = step(fn, state, ids, row=0, max_fetch=3, weights=weights, plan_rows=1500)
        assert count.tolist() == [3]
        assert plan[:3].tolist() == [[1, 0], [3, 1], [6, 2]] and bool((plan[3:] == -1).all())
        assert slot_ids.tolist() == [[1, 2], [1, 0], [1, 2], [0, -1], [-1, 5]]
        assert state["stamp"].tolist() == [2, 3, 4, -1, -1, 1, -1, -1]
        assert state["counters"].tolist() == [[1, 5, 3, 0, 2]]


@needs_interpreter
def test_the_kernel_scans_many_blocks_of_slots() -> None:
    layers, experts, slots = 3, 1024, 2500
    g = torch.Generator().manual_seed(11)
    kernel = new_state(layers, experts, slots, [1.0, 0.5, 1.0])
    for slot in range(slots - 3):  # the last three slots, in the third scan block, stay empty
        place(kernel, slot % layers, slot // layers, slot, stamp=slot)
    ref = clone(kernel)
    for i in range(6):
        ids = random_ids(g, 16, 8, experts, hot=experts)
        weights = torch.rand(ids.shape, generator=g)
        got = step(lru_ensure, kernel, ids, i % layers, BIG, weights)
        want = step(lru_ensure_reference, ref, ids, i % layers, BIG, weights)
        if i == 0:
            assert want[1][:5, 1].tolist() == [2497, 2498, 2499, 0, 1]  # empty first, then the oldest
        for name in STATE_KEYS:
            assert torch.equal(kernel[name], ref[name]), (i, name)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), (i, a, b)


EMPTY_TAIL = 3


@needs_interpreter
@pytest.mark.parametrize(
    ("layers", "experts", "share", "fetch"),
    [(58, 256, 0.11, (1.0,)), (58, 256, 0.37, (1.0,)), (60, 384, 0.25, (1.0, 0.4))],
    ids=["deepseek-v3-11%", "deepseek-v3-37%", "kimi-k2-25%-hybrid"],
)
def test_the_kernel_at_full_expert_count(
    layers: int, experts: int, share: float, fetch: tuple[float, ...]
) -> None:
    """DeepSeek-V3's pool: 58 MoE layers of 256 experts (14,848), 8 chosen per token, at the paper's 11%
    and a consumer card's 37% of it in slots; Kimi-K2's: 60 layers of 384 (23,040; not a power of two) at
    25% with every other layer fetching 40% of its misses (hybrid). Full from the start but for the last
    EMPTY_TAIL slots, in the victim scan's partial last block, which the first fills take; decode steps of
    1-4 rows walking the layers in order: the kernel equals the reference bit for bit after every step
    (state, remapped slot ids, fill plan and count)."""
    slots = int(share * layers * experts)
    assert slots % MAX_SCAN_BLOCK > EMPTY_TAIL  # the scan's last block is partial and holds the empty slots
    g = torch.Generator().manual_seed(12)
    kernel = new_state(layers, experts, slots, [fetch[row % len(fetch)] for row in range(layers)])
    for slot in range(slots - EMPTY_TAIL):
        place(kernel, slot % layers, slot // layers, slot, stamp=slot)
    ref = clone(kernel)
    for i in range(2 * layers):
        ids = random_ids(g, 1 + i % 4, 8, experts, hot=32)
        weights = torch.rand(ids.shape, generator=g)
        got = step(lru_ensure, kernel, ids, i % layers, BIG, weights)
        want = step(lru_ensure_reference, ref, ids, i % layers, BIG, weights)
        for name in STATE_KEYS:
            assert torch.equal(kernel[name], ref[name]), (i, name)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), (i, a, b)
    hits, misses, fills, evictions, cpu = ref["counters"].sum(dim=0).tolist()
    assert hits > 0 and misses > 0 and evictions == fills - EMPTY_TAIL > 0  # then every fill evicted
    assert bool((ref["owner"][-EMPTY_TAIL:] >= 0).all())
    assert (cpu > 0) == (len(fetch) > 1)  # the hybrid layers left misses to the CPU


def test_dispatch_limits_and_shape_checks() -> None:
    assert use_lru_kernel(torch.zeros(16, 8, dtype=torch.int64), 1024) == lru_kernel_available("cpu")
    assert not use_lru_kernel(torch.zeros(17, 8, dtype=torch.int64), 64)
    assert not use_lru_kernel(torch.zeros(1, 8, dtype=torch.int64), 1025)
    state = new_state(1, 8, 4, [1.0])
    ids = torch.zeros(2, 2, dtype=torch.int64)
    args = (*(state[k] for k in STATE_KEYS[:5]), 4, state["counters"])
    out = (
        torch.empty(2, 2, dtype=torch.int64),
        torch.empty(4, 2, dtype=torch.int32),
        torch.empty(1, dtype=torch.int32),
    )
    with pytest.raises(ValueError, match="P >= 4"):
        lru_ensure(ids, torch.ones(2, 2), 0, *args, out[0], out[1][:3], out[2])
    with pytest.raises(ValueError, match="row"):
        lru_ensure(ids, torch.ones(2, 2), 1, *args, *out)
    with pytest.raises(ValueError, match="slot_ids"):
        lru_ensure(ids, torch.ones(2, 2), 0, *args, out[0].int(), out[1], out[2])
