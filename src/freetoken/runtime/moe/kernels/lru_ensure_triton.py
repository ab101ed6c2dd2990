"""Triton kernel body of the device-side expert-cache LRU step (launcher and reference in lru_ensure.py).

One program (grid (1,)) over the step's N = T·K pairs, padded to BLOCK_P (a power of two <= 128).
Per-expert facts are computed per pair from [BLOCK_P, BLOCK_P] comparison matrices, so every pair of
one expert carries the same values and the expert's first occurrence acts for it:

  first, count, weight sum (fp64)     over the pairs with the same id
  slot = slot_of[row, id]             hit: slot >= 0, miss: slot < 0
  hit rank    = hits with a lower id          -> stamp[slot] = clock0 + rank
  miss rank   = misses before it in (count desc, weight desc, id asc); chosen: rank < q
  admit rank  = chosen with a lower id        -> the admit-rank-th victim

Victims: q rounds, each a scan of all slots for the smallest key (stamp + 1)·S + slot above the last
round's, among slots with stamp < clock0 (so this step's hits, stamped before a barrier, are out).
Keys are unique, so the rounds give the q smallest in ascending order without writing anything.
Then the admissions are stores to distinct addresses (victims, their old owners' keys, the chosen
keys), and slot_ids comes from registers (hit slot, victim, or -1), not from re-reading slot_of.
"""

from __future__ import annotations

import triton
import triton.language as tl

SENTINEL = tl.constexpr(
    2**63 - 1
)  # int64 max: above every key of an eligible slot (jit globals are constexpr)


@triton.jit
def _next_key(stamp_ptr, clock0, last, S: tl.constexpr, BLOCK_S: tl.constexpr):
    """The smallest key (stamp + 1)·S + slot above `last` among slots with stamp < clock0."""
    best = tl.full([BLOCK_S], SENTINEL, dtype=tl.int64)
    for start in range(0, S, BLOCK_S):
        s = start + tl.arange(0, BLOCK_S)
        st = tl.load(stamp_ptr + s, mask=s < S, other=SENTINEL)
        key = (st + 1) * S + s
        best = tl.minimum(best, tl.where((st < clock0) & (key > last), key, SENTINEL))
    return tl.min(best, axis=0)


@triton.jit(do_not_specialize=["row", "max_fetch"])
def lru_ensure_kernel(
    ids_ptr,  # [N] int64, -1 = no pair
    weights_ptr,  # [N], any float dtype
    slot_of_ptr,  # [L * E] int32, in place
    owner_ptr,  # [S] int32, in place
    stamp_ptr,  # [S] int64, in place
    clock_ptr,  # [1] int64, in place
    fetch_ptr,  # [L] fp32
    counters_ptr,  # [L * 5] int64, in place
    slot_ids_ptr,  # [N] int64 out
    plan_ptr,  # [P * 2] int32 out
    count_ptr,  # [1] int32 out
    row,
    max_fetch,
    N: tl.constexpr,  # T·K pairs
    E: tl.constexpr,  # experts per layer
    S: tl.constexpr,  # slots
    P: tl.constexpr,  # plan rows
    BLOCK_P: tl.constexpr,  # power of two >= N
    BLOCK_S: tl.constexpr,  # slots per scan step, a power of two
    BLOCK_F: tl.constexpr,  # plan rows per step of the (-1, -1) fill, a power of two
    COMPILED: tl.constexpr,  # False under Triton's interpreter
):
    offs = tl.arange(0, BLOCK_P)
    live = offs < N
    ids = tl.load(ids_ptr + offs, mask=live, other=-1).to(tl.int64)  # [BP]
    valid = live & (ids >= 0)
    w = tl.load(weights_ptr + offs, mask=valid, other=0.0).to(tl.float64)  # [BP]

    small = ids.to(tl.int32)  # ids < E <= 1024: the [BP, BP] matrices stay 32-bit
    id_i = small[:, None]  # [BP, 1]
    id_j = small[None, :]  # [1, BP]
    same = (id_i == id_j) & valid[:, None] & valid[None, :]  # [BP, BP]
    before = offs[None, :] < offs[:, None]  # [BP, BP]: j < i
    first = valid & (tl.sum((same & before).to(tl.int32), axis=1) == 0)  # [BP]
    cnt = tl.sum(same.to(tl.int32), axis=1)  # [BP]
    wsum = tl.sum(tl.where(same, w[None, :], 0.0), axis=1)  # [BP] fp64

    key_row = row.to(tl.int64) * E
    slot = tl.load(slot_of_ptr + key_row + ids, mask=valid, other=-1).to(tl.int64)  # [BP]
    hit = valid & (slot >= 0)
    miss = valid & (slot < 0)
    first_hit = first & hit
    first_miss = first & miss
    n_hits = tl.sum(first_hit.to(tl.int32), axis=0).to(tl.int64)
    m = tl.sum(first_miss.to(tl.int32), axis=0).to(tl.int64)

    lower = id_j < id_i  # [BP, BP]
    clock0 = tl.load(clock_ptr).to(tl.int64)
    hit_rank = tl.sum((first_hit[None, :] & lower).to(tl.int32), axis=1)  # [BP]
    tl.store(stamp_ptr + slot, clock0 + hit_rank, mask=first_hit)

    # q = clamp(floor(m·f + 0.5), 1, max(1, min(m, max_fetch))), 0 without misses or f <= 0; m·f is exact
    # in fp64 (a float32 times an integer < 2^29), so there is no rounding before the floor
    f = tl.load(fetch_ptr + row).to(tl.float64)
    cap = tl.maximum(tl.minimum(m, max_fetch.to(tl.int64)), 1)
    y = tl.minimum(tl.maximum(m.to(tl.float64) * f + 0.5, 1.0), cap.to(tl.float64))
    q = tl.where((m > 0) & (f > 0.0), y.to(tl.int64), 0)
    q = tl.minimum(q, S - n_hits)  # this step's hits are never evicted

    cnt_i = cnt[:, None]
    cnt_j = cnt[None, :]
    w_i = wsum[:, None]
    w_j = wsum[None, :]
    ahead = (cnt_j > cnt_i) | ((cnt_j == cnt_i) & ((w_j > w_i) | ((w_j == w_i) & lower)))  # [BP, BP]
    miss_rank = tl.sum((first_miss[None, :] & ahead).to(tl.int32), axis=1)  # [BP]
    chosen = miss & (miss_rank < q)
    first_chosen = first & chosen
    admit_rank = tl.sum((first_chosen[None, :] & lower).to(tl.int32), axis=1)  # [BP]

    tl.debug_barrier()  # the hits' stamps are visible to the scan
    victims = tl.full([BLOCK_P], -1, dtype=tl.int32)  # [BP]: the r-th victim at r
    last = clock0 * 0 - 1  # the previous round's key
    if COMPILED:
        for r in range(q):
            last = _next_key(stamp_ptr, clock0, last, S, BLOCK_S)
            victims = tl.where(offs == r, (last % S).to(tl.int32), victims)
    else:  # the interpreter cannot take computed values as range() bounds; the same body in a while loop
        r = q * 0
        while r < q:
            last = _next_key(stamp_ptr, clock0, last, S, BLOCK_S)
            victims = tl.where(offs == r, (last % S).to(tl.int32), victims)
            r += 1
    tl.debug_barrier()  # the scan's loads are done before the admissions write

    pick = admit_rank[:, None] == offs[None, :]  # [BP, BP]
    victim = tl.sum(tl.where(pick, victims[None, :], 0), axis=1)  # [BP]: the pair's victim if chosen
    old = tl.load(owner_ptr + victim, mask=first_chosen, other=-1).to(tl.int64)
    evicted = first_chosen & (old >= 0)
    n_evicted = tl.sum(evicted.to(tl.int32), axis=0).to(tl.int64)
    tl.store(slot_of_ptr + old, tl.full([BLOCK_P], -1, dtype=tl.int32), mask=evicted)
    tl.store(slot_of_ptr + key_row + ids, victim, mask=first_chosen)
    tl.store(owner_ptr + victim, (key_row + ids).to(tl.int32), mask=first_chosen)
    tl.store(stamp_ptr + victim, clock0 + n_hits + admit_rank, mask=first_chosen)
    tl.store(plan_ptr + admit_rank * 2, ids.to(tl.int32), mask=first_chosen)
    tl.store(plan_ptr + admit_rank * 2 + 1, victim, mask=first_chosen)
    for start in range(0, P, BLOCK_F):
        p = start + tl.arange(0, BLOCK_F)
        rest = (p >= q) & (p < P)
        tl.store(plan_ptr + p * 2, tl.full([BLOCK_F], -1, dtype=tl.int32), mask=rest)
        tl.store(plan_ptr + p * 2 + 1, tl.full([BLOCK_F], -1, dtype=tl.int32), mask=rest)

    out = tl.where(
        hit, slot, tl.where(chosen, victim.to(tl.int64), -1)
    )  # every pair of a chosen expert has its victim
    tl.store(slot_ids_ptr + offs, out, mask=live)
    tl.store(clock_ptr, clock0 + n_hits + q)
    tl.store(count_ptr, q.to(tl.int32))
    c = tl.arange(0, 8)
    totals = tl.where(
        c == 0, n_hits, tl.where(c == 1, m, tl.where(c == 2, q, tl.where(c == 3, n_evicted, m - q)))
    )
    at = counters_ptr + row.to(tl.int64) * 5 + c
    tl.store(at, tl.load(at, mask=c < 5, other=0) + totals, mask=c < 5)
