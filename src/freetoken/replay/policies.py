"""Expert placement policies replayed on routing traces at equal capacity (`freetoken replay routing`).

Accounting. The cache holds `capacity` slots shared by all MoE layers (global), each one (layer, expert).
A trace is served group by group (`RoutingTrace.groups()`: pass by pass, layer by layer); every distinct
expert of a group is one access: a hit if resident when the group is served, else a miss, counted under
the group's phase (prefill / decode). A group's own experts never evict each other: demand policies admit
at most (capacity − the group's hits) of its misses, the lowest ids first (the runtime prefers those
serving the most tokens, then router weight, which a trace does not record); the rest are computed
elsewhere (on the host), as the runtime does. `fetches` counts every expert copied into the cache: the
initial placement (the warm start, or the static set), demand admissions and prefetches.

Every policy starts cold (empty) unless `warm`, then from the runtime's warm start
(`ExpertResidency.warm_start`: slot s holds layer s % L, expert s // L, oldest first). `static` and
`prefill-pinned` always start there.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from freetoken.replay.belady import belady as belady_hits
from freetoken.replay.trace import PREFILL, RoutingTrace
from freetoken.runtime.moe.lookahead import CoRouting, prefetch_next
from freetoken.runtime.moe.residency import ExpertResidency


@dataclass(frozen=True)
class ReplayResult:
    policy: str
    capacity: int
    decode_hits: int
    decode_misses: int
    prefill_hits: int
    prefill_misses: int
    fetches: int  # experts copied into the cache: initial placement, admissions, prefetches

    @staticmethod
    def _rate(misses: int, hits: int) -> float:
        return misses / (misses + hits) if misses + hits else 0.0

    @property
    def decode_miss_rate(self) -> float:
        return self._rate(self.decode_misses, self.decode_hits)

    @property
    def prefill_miss_rate(self) -> float:
        return self._rate(self.prefill_misses, self.prefill_hits)

    @property
    def miss_rate(self) -> float:
        return self._rate(self.decode_misses + self.prefill_misses, self.decode_hits + self.prefill_hits)


class _Tally:
    def __init__(self, fetches: int = 0) -> None:
        self.hits, self.misses, self.fetches = [0, 0], [0, 0], fetches

    def add(self, phase: int, hits: int, misses: int) -> None:
        i = 0 if phase == PREFILL else 1
        self.hits[i] += hits
        self.misses[i] += misses

    def result(self, policy: str, capacity: int) -> ReplayResult:
        return ReplayResult(
            policy, capacity, self.hits[1], self.misses[1], self.hits[0], self.misses[0], self.fetches
        )


def _shape(trace: RoutingTrace, capacity: int) -> tuple[int, int]:
    layers, experts = trace.num_layers, trace.num_experts
    if not 1 <= capacity <= layers * experts:
        raise ValueError(f"capacity {capacity}: must be in [1, {layers * experts}] ({layers} × {experts})")
    return layers, experts


def warm_keys(num_layers: int, num_experts: int, capacity: int) -> np.ndarray:
    """Flat keys (layer · E + expert) of the runtime's warm start, oldest first (ExpertResidency's)."""
    slots = np.arange(min(capacity, num_layers * num_experts))
    return (slots % num_layers) * num_experts + slots // num_layers


def _pass_rows(trace: RoutingTrace) -> list[np.ndarray]:
    """Row indices of each pass, split exactly as `RoutingTrace.groups()` splits them."""
    return np.split(np.arange(len(trace)), np.flatnonzero(np.diff(trace.pass_id)) + 1) if len(trace) else []


def lru(trace: RoutingTrace, capacity: int, warm: bool = False) -> ReplayResult:
    """The runtime's own global LRU (ExpertResidency on the cpu device: the policy's torch mirror),
    driven as the engine drives it in offload mode. When a step has more misses than free slots, the
    engine admits those serving the most tokens, then the largest router weight; a trace records no
    weights, so here the lowest expert ids go first."""
    layers, experts = _shape(trace, capacity)
    residency = ExpertResidency(range(layers), experts, capacity, "cpu")
    tally = _Tally(len(residency.warm_start()) if warm else 0)
    counts = residency.counters  # [L, 5]: hits, misses, fills, ...
    for g in trace.groups():
        before = counts[g.layer].clone()
        ids = torch.from_numpy(g.experts.astype(np.int64))[None]  # [1, M]: only the set matters here
        residency.ensure(g.layer, ids, torch.ones(ids.shape))
        hits, misses, fills = (counts[g.layer, :3] - before[:3]).tolist()
        tally.add(g.phase, hits, misses)
        tally.fetches += fills
    return tally.result("lru", capacity)


def lru_prefetch(
    trace: RoutingTrace, capacity: int, warm: bool = False, width: int | None = None
) -> ReplayResult:
    """`lru` with the engine's router-lookahead prefetch (`--moe-prefetch`: lookahead.py's CoRouting and
    ExpertResidency.prefetch on the cpu device, driven as the executor drives them): after each layer step
    of a pass, the pass's token rows teach the co-routing counts and up to `width` (default top-k) of the
    next layer's likely experts are prefetched. Prefetch fills count in `fetches`; width 0 is `lru`."""
    layers, experts = _shape(trace, capacity)
    width = trace.top_k if width is None else width
    if width <= 0:
        return replace(lru(trace, capacity, warm), policy="lru-prefetch")
    residency = ExpertResidency(range(layers), experts, capacity, "cpu")
    co = CoRouting(layers, experts, width, "cpu")
    tally = _Tally(len(residency.warm_start()) if warm else 0)
    counts = residency.counters  # [L, 5]: hits, misses, fills, ...
    rows = _pass_rows(trace)
    for i, g in enumerate(trace.groups()):
        before = counts[g.layer].clone()
        ids = torch.from_numpy(g.experts.astype(np.int64))[None]  # [1, M]: as `lru` steps
        residency.ensure(g.layer, ids, torch.ones(ids.shape))
        hits, misses, fills = (counts[g.layer, :3] - before[:3]).tolist()
        tally.add(g.phase, hits, misses)
        tally.fetches += fills
        chosen = torch.from_numpy(trace.experts[rows[i // layers]].astype(np.int64))  # [T, L, K]
        earlier = chosen[:, g.layer - 1] if g.layer > 0 else None
        step = prefetch_next(co, residency, g.layer, earlier, chosen[:, g.layer])
        if step is not None:
            tally.fetches += int(step[2].item())  # the prefetch's admissions
    return tally.result("lru-prefetch", capacity)


def lru_per_layer(trace: RoutingTrace, capacity: int, warm: bool = False) -> ReplayResult:
    """A fixed budget per layer (capacity // L, the remainder one extra to the first layers), LRU within."""
    layers, experts = _shape(trace, capacity)
    budget = [capacity // layers + (layer < capacity % layers) for layer in range(layers)]
    order: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(layers)]  # oldest first
    tally = _Tally()
    if warm:  # the warm start gives layer l exactly budget[l] experts
        for key in warm_keys(layers, experts, capacity).tolist():
            order[key // experts][key % experts] = None
            tally.fetches += 1
    for g in trace.groups():
        lru_l, ids = order[g.layer], g.experts.tolist()
        hits = [e for e in ids if e in lru_l]
        misses = [e for e in ids if e not in lru_l]
        for e in hits:
            lru_l.move_to_end(e)
        admit = misses[: budget[g.layer] - len(hits)]
        for e in admit:
            if len(lru_l) >= budget[g.layer]:
                # never one of this group: its hits are the newest and admissions fit beside them
                lru_l.popitem(last=False)
            lru_l[e] = None
        tally.add(g.phase, len(hits), len(misses))
        tally.fetches += len(admit)
    return tally.result("lru-per-layer", capacity)


def static(trace: RoutingTrace, capacity: int, warm: bool = False) -> ReplayResult:
    """Routing-blind (llama.cpp-like): the warm-start set is placed at load and never changes."""
    layers, experts = _shape(trace, capacity)
    placed = warm_keys(layers, experts, capacity)
    resident = np.zeros(layers * experts, dtype=bool)
    resident[placed] = True
    tally = _Tally(len(placed))
    for g in trace.groups():
        hits = int(resident[g.layer * experts + g.experts.astype(np.int64)].sum())
        tally.add(g.phase, hits, len(g.experts) - hits)
    return tally.result("static", capacity)


def prefill_pinned(trace: RoutingTrace, capacity: int, warm: bool = False) -> ReplayResult:
    """KTransformers-like: after each prefill pass pin the `capacity` (layer, expert) its token rows chose
    most often (ties: resident first, then lower layer, lower id); nothing else changes residency."""
    layers, experts = _shape(trace, capacity)
    placed = warm_keys(layers, experts, capacity)  # before any prefill: the static set
    resident = np.zeros(layers * experts, dtype=bool)
    resident[placed] = True
    tally = _Tally(len(placed))
    rows, keys = _pass_rows(trace), np.arange(layers * experts)
    for i, g in enumerate(trace.groups()):
        hits = int(resident[g.layer * experts + g.experts.astype(np.int64)].sum())
        tally.add(g.phase, hits, len(g.experts) - hits)  # misses are never admitted
        if g.phase == PREFILL and g.layer == layers - 1:  # the pass is over: re-pin
            chosen = (
                trace.experts[rows[i // layers]].astype(np.int64)
                + (np.arange(layers) * experts)[None, :, None]
            )
            freq = np.bincount(chosen.ravel(), minlength=layers * experts)
            pinned = np.zeros_like(resident)
            pinned[np.lexsort((keys, ~resident, -freq))[:capacity]] = True
            tally.fetches += int((pinned & ~resident).sum())
            resident = pinned
    return tally.result("prefill-pinned", capacity)


def lfu(trace: RoutingTrace, capacity: int, warm: bool = False) -> ReplayResult:
    """Evict the resident read least often since the start (ties: least recently used)."""
    layers, experts = _shape(trace, capacity)
    n = layers * experts
    freq, stamp, resident, mark = [0] * n, [-1] * n, [False] * n, [-1] * n
    heap: list[tuple[int, int, int]] = []  # (freq, stamp, key); live iff resident and both still current
    tally, clock, count = _Tally(), 0, 0
    if warm:
        for key in warm_keys(layers, experts, capacity).tolist():
            resident[key], stamp[key], clock, count = True, clock, clock + 1, count + 1
            heap.append((0, stamp[key], key))
        tally.fetches = count
    for i, g in enumerate(trace.groups()):
        keys = (g.layer * experts + g.experts.astype(np.int64)).tolist()
        hits, misses = [], []
        for key in keys:
            freq[key] += 1  # every read counts, resident or not
            mark[key] = i
            (hits if resident[key] else misses).append(key)
        for key in hits:  # recency as in the runtime's LRU: hits first, then admissions, one stamp each
            stamp[key], clock = clock, clock + 1
            heapq.heappush(heap, (freq[key], stamp[key], key))
        admit = misses[: capacity - len(hits)]
        evict, aside = count + len(admit) - capacity, []
        while evict > 0:
            f, s, key = heapq.heappop(heap)
            if not resident[key] or freq[key] != f or stamp[key] != s:
                continue  # stale entry
            if mark[key] == i:  # this group's own expert: protected
                aside.append((f, s, key))
                continue
            resident[key], count, evict = False, count - 1, evict - 1
        for entry in aside:
            heapq.heappush(heap, entry)
        for key in admit:
            resident[key], stamp[key], clock, count = True, clock, clock + 1, count + 1
            heapq.heappush(heap, (freq[key], stamp[key], key))
        tally.add(g.phase, len(hits), len(misses))
        tally.fetches += len(admit)
    return tally.result("lfu", capacity)


def belady(trace: RoutingTrace, capacity: int, warm: bool = False) -> ReplayResult:
    """Offline optimum of demand paging (see belady.py; checked against exhaustive search in the tests,
    too-full groups included): a lower bound on every demand policy's misses, and on the fetches of any
    policy, prefetching or not, that admits all its misses."""
    layers, experts = _shape(trace, capacity)
    groups = list(trace.groups())
    initial = warm_keys(layers, experts, capacity) if warm else np.empty(0, dtype=np.int64)
    steps = [g.layer * experts + g.experts.astype(np.int64) for g in groups]
    hits, admitted = belady_hits(steps, layers * experts, capacity, initial)
    tally = _Tally(len(initial) + admitted)
    for g, h in zip(groups, hits, strict=True):
        tally.add(g.phase, h, len(g.experts) - h)
    return tally.result("belady", capacity)


def lookahead(
    trace: RoutingTrace, capacity: int, warm: bool = False, width: int | None = None
) -> ReplayResult:
    """LRU demand paging (identical to `lru` when nothing is prefetched) plus cross-layer prefetch.

    Online counts C[l][e, e'] of token rows that chose e at layer l and e' at layer l+1 of the same pass,
    and W[e, e'] of "e in the last layer of a pass, e' in the first layer of the next"; both learned only
    from steps already served. After serving layer l, the `width` (default top-k) experts of the next layer
    with the highest count summed over the group's experts (count > 0) are prefetched when not resident,
    evicting LRU victims other than the group's experts, anything demanded in this pass, and the
    predicted set itself; when too few victims are left, fewer (the best scored) are prefetched."""
    layers, experts = _shape(trace, capacity)
    width = trace.top_k if width is None else width
    n = layers * experts
    stamp = np.full(n, -1, dtype=np.int64)  # recency, one global clock (as the runtime's LRU)
    resident = np.zeros(n, dtype=bool)
    demanded = np.full(n, -1, dtype=np.int64)  # pass that last demanded the key
    follow = np.zeros((max(layers - 1, 0), experts, experts), dtype=np.int64)
    wrap = np.zeros((experts, experts), dtype=np.int64)
    tally, clock = _Tally(), 0
    if warm:
        placed = warm_keys(layers, experts, capacity)
        resident[placed], stamp[placed], clock = True, np.arange(len(placed)), len(placed)
        tally.fetches = len(placed)

    def place(keys: np.ndarray, protected: np.ndarray) -> int:
        """Admit `keys` (not resident), evicting the least recent residents outside `protected`; returns
        how many were admitted (the first ones, when too few slots can be freed)."""
        nonlocal clock
        free = capacity - int(resident.sum())
        candidates = np.flatnonzero(resident & ~protected)
        keys = keys[: free + len(candidates)]
        evict = len(keys) - free
        if evict > 0:  # stamps of residents are distinct: the victim set is well defined
            resident[candidates[np.argpartition(stamp[candidates], evict - 1)[:evict]]] = False
        resident[keys], stamp[keys] = True, clock + np.arange(len(keys))
        clock += len(keys)
        return len(keys)

    rows, previous_last = _pass_rows(trace), np.empty(0, dtype=np.int64)
    for i, g in enumerate(trace.groups()):
        p, layer = i // layers, g.layer
        keys = layer * experts + g.experts.astype(np.int64)
        hit = resident[keys]
        stamp[keys[hit]] = clock + np.arange(int(hit.sum()))  # hits first, in order, as the runtime's LRU
        clock += int(hit.sum())
        demanded[keys] = p
        group = np.zeros(n, dtype=bool)
        group[keys] = True
        admitted = place(keys[~hit][: capacity - int(hit.sum())], group)
        tally.add(g.phase, int(hit.sum()), int((~hit).sum()))
        tally.fetches += admitted
        # learn from what was just served: the pair (layer-1 -> layer) of this pass, or the wrap pair
        if layer > 0:
            chosen = trace.experts[rows[p]]
            np.add.at(follow[layer - 1], (chosen[:, layer - 1, :, None], chosen[:, layer, None, :]), 1)
        elif p > 0:
            wrap[np.ix_(previous_last, g.experts)] += 1
        if layer == layers - 1:
            previous_last = g.experts
        if width <= 0:
            continue
        table, target = (follow[layer], layer + 1) if layer < layers - 1 else (wrap, 0)
        score = table[g.experts].sum(axis=0)
        best = np.lexsort((np.arange(experts), -score))[:width]
        predicted = target * experts + best[score[best] > 0]
        protected = group | (demanded == p)
        protected[predicted] = True
        tally.fetches += place(predicted[~resident[predicted]], protected)
    return tally.result("lookahead", capacity)


POLICIES: dict[str, Callable[..., ReplayResult]] = {
    "lru": lru,
    "lru-prefetch": lru_prefetch,
    "lru-per-layer": lru_per_layer,
    "static": static,
    "prefill-pinned": prefill_pinned,
    "lfu": lfu,
    "lookahead": lookahead,
    "belady": belady,
}


def simulate(
    policy: str, trace: RoutingTrace, capacity: int, warm: bool = False, **options: Any
) -> ReplayResult:
    """Replay `trace` through `policy` with `capacity` global slots (1 <= capacity <= L·E)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}: expected one of {', '.join(POLICIES)}")
    _shape(trace, capacity)
    return POLICIES[policy](trace, capacity, warm, **options)
