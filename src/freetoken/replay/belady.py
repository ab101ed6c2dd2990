"""Belady's offline optimum over layer steps: on a miss with a full cache, evict the resident whose next
access is farthest in the future (never again = infinitely far), never one of the current step's experts;
and when the miss itself is needed no sooner than that resident, bypass it (compute it without admitting
it, as the runtime's CPU path does) rather than evict: the optimum of a cache that may bypass, so it bounds
the policies that never admit (static, prefill-pinned) too.

Time is the step index: a step's experts are read "at once", so they are never candidates (in use). Two
keys next read in the same step are told apart by the read after that, and so on: keys are ordered by
their whole future (the list of steps that read them, compared lexicographically, an end being farthest).
The same order picks which misses a too-full step admits (the soonest needed), which keeps the result
optimal when a step has more misses than free room. Victims come from a max-heap on that order with lazy
deletion (an entry is live iff its key is resident and the entry's rank is the key's current one).
"""

from __future__ import annotations

import heapq

import numpy as np


def future_ranks(keys: np.ndarray, when: np.ndarray, horizon: int) -> np.ndarray:
    """For reads (keys[i] at step when[i], in time order): a rank per read ordering the reads by the future
    of their key after them (the steps of its later reads, lexicographically; no later read = `horizon`,
    after everything). Prefix doubling over the next-read chain: O(n log² n)."""
    n = len(keys)
    order = np.argsort(keys, kind="stable")  # by key, then by time
    same = keys[order[1:]] == keys[order[:-1]]
    jump = np.full(n, -1, dtype=np.int64)  # next read of the same key
    jump[order[:-1][same]] = order[1:][same]
    rank = np.where(jump >= 0, when[np.maximum(jump, 0)], horizon)  # first element of each future
    while n and (jump >= 0).any():
        # rank encodes the first 2^m steps of each future; extend by the future of the read 2^m later
        tail = np.where(jump >= 0, rank[np.maximum(jump, 0)], -1)
        pair = np.lexsort((tail, rank))
        new = np.empty(n, dtype=np.int64)
        new[pair] = np.cumsum(np.r_[0, (np.diff(rank[pair]) != 0) | (np.diff(tail[pair]) != 0)])
        rank = new
        jump = np.where(jump >= 0, jump[np.maximum(jump, 0)], -1)
    return rank


def belady(
    steps: list[np.ndarray], num_keys: int, capacity: int, initial: np.ndarray
) -> tuple[list[int], int]:
    """steps: each step's distinct keys; initial: keys resident at the start. -> (hits per step, admissions).

    Misses beyond the free room (capacity − the step's hits) are not admitted."""
    sizes = [len(initial), *(len(s) for s in steps)]
    flat = np.concatenate([initial, *steps]).astype(np.int64)  # step 0 = the initial placement
    rank = future_ranks(flat, np.repeat(np.arange(len(sizes)), sizes), len(sizes)).tolist()
    keys_all = flat.tolist()

    resident, in_step = [False] * num_keys, [-1] * num_keys  # in_step: the step that last read the key
    current = [0] * num_keys  # rank of each resident key's latest read
    heap: list[tuple[int, int]] = []  # (-rank, key): the top is the resident needed last
    for key, r in zip(keys_all[: len(initial)], rank[: len(initial)], strict=True):
        resident[key], current[key] = True, r
        heap.append((-r, key))
    heapq.heapify(heap)
    count, start = len(initial), len(initial)
    hits_per_step, admitted_total = [], 0
    for t, size in enumerate(sizes[1:], start=1):
        hits, misses = 0, []
        for key, r in zip(keys_all[start : start + size], rank[start : start + size], strict=True):
            in_step[key] = t
            if resident[key]:
                hits += 1
                current[key] = r
                heapq.heappush(heap, (-r, key))
            else:
                misses.append((r, key))
        start += size
        hits_per_step.append(hits)
        admit = sorted(misses)[: capacity - hits]  # the ones needed soonest
        evict = count + len(admit) - capacity  # never more than the residents outside this step
        aside = []  # live entries of this step's own keys, put back after the evictions
        while evict > 0:
            neg, key = heapq.heappop(heap)
            if not resident[key] or current[key] != -neg:
                continue  # stale
            if in_step[key] == t:
                aside.append((neg, key))
                continue
            if admit and admit[-1][0] >= -neg:
                # bypass: the miss is needed no sooner than the farthest resident, so it is computed
                # where it is (the CPU) instead of evicting; the resident stays
                admit.pop()
                heapq.heappush(heap, (neg, key))
                evict -= 1
                continue
            resident[key], count, evict = False, count - 1, evict - 1
        for entry in aside:
            heapq.heappush(heap, entry)
        for r, key in admit:
            resident[key], current[key] = True, r
            heapq.heappush(heap, (-r, key))
        count += len(admit)
        admitted_total += len(admit)
    return hits_per_step, admitted_total
