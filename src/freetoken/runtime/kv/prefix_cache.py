"""Radix-tree prefix cache: reuse the KV of shared prompt prefixes across requests.

Structure. A tree over token ids. The root holds no tokens; every other node holds a non-empty segment
`tokens` and, per layer, copies `k[layer]`, `v[layer]` [KVH, len(tokens), D] of the KV of those positions
(cloned, on the device and dtype of the KV cache they came from). A node at depth `start` (the number of
tokens on the path above it) covers positions [start, start + len(tokens)) of every sequence through it.

Invariants.
- Children are keyed by the first token of their segment, so siblings never share a first token and a
  walk from the root is deterministic; the path to a node spells the prefix its KV belongs to.
- `last_used` stamps come from a monotonic counter. Any insert or load that uses a node stamps it and all
  of its ancestors with the same value, so a parent's stamp is never older than any child's.
- Stored tokens (sum of segment lengths) never exceed `budget_tokens` after `insert` returns.

Recurrent state (hybrid models). K/V alone cannot resume a DeltaNet layer, so nodes also hold state
checkpoints: `states[p]` is every recurrent layer's state after positions [0, p), kept in the node whose
segment covers p (start < p <= start + len(tokens)). A cache that carries recurrent state (`kv.recurrent`)
is loaded only up to the deepest checkpoint within the match, and gets that checkpoint's states; at most
`checkpoint_budget` checkpoints are held. A checkpoint is dropped with the K/V it stands on (trim, evict),
and beyond the budget the oldest-used ones go first, chosen among those of one insert by the anchor
policy of state_checkpoints.py (the least gap to the previous checkpoint, weighed down with age).

Eviction takes the least recently used leaf first; a parent becomes a leaf once its children are gone, so
a node is never removed before its descendants. When a leaf is longer than what is left to free, it is
trimmed from its end (keeping its still-useful prefix) instead of removed whole, so `evict(n)` frees
exactly min(n, stored) tokens. Nodes are not re-merged after eviction; a single-child chain is still a
valid tree. Segments are cloned on split and trim so a node never pins storage it no longer covers.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from freetoken.runtime.kv.cache import KVCache
from freetoken.runtime.kv.state_checkpoints import Checkpoint, choose_victim


@dataclass
class PrefixCacheStats:
    lookups: int = 0  # calls to load
    hit_tokens: int = 0  # tokens returned by load, summed
    stored_tokens: int = 0  # tokens of KV held now (sum of segment lengths)
    nodes: int = 0  # nodes held now, root excluded
    evicted_tokens: int = 0  # tokens freed by eviction, summed (clear() does not count)
    checkpoints: int = 0  # recurrent-state checkpoints held now


@dataclass(eq=False)
class _Node:
    tokens: tuple[int, ...]
    k: list[torch.Tensor]  # per layer [KVH, len(tokens), D]
    v: list[torch.Tensor]  # per layer [KVH, len(tokens), D]
    parent: _Node | None = None
    children: dict[int, _Node] = field(default_factory=dict)
    last_used: int = 0
    states: dict[int, Checkpoint] = field(default_factory=dict)  # position -> checkpoint (see module doc)
    states_used: dict[int, int] = field(default_factory=dict)  # position -> stamp of its last use


def _common(tokens: tuple[int, ...], ids: tuple[int, ...], pos: int) -> int:
    """Length of the common prefix of `tokens` and `ids[pos:]`."""
    n = min(len(tokens), len(ids) - pos)
    i = 0
    while i < n and tokens[i] == ids[pos + i]:
        i += 1
    return i


class PrefixCache:
    def __init__(self, budget_tokens: int, checkpoint_budget: int = 0) -> None:
        """Keep at most `budget_tokens` tokens of KV (summed over nodes); 0 disables the cache. Hold at
        most `checkpoint_budget` recurrent-state checkpoints (0: none, so hybrid caches never hit)."""
        if budget_tokens < 0:
            raise ValueError(f"budget_tokens must be >= 0, got {budget_tokens}")
        if checkpoint_budget < 0:
            raise ValueError(f"checkpoint_budget must be >= 0, got {checkpoint_budget}")
        self.budget_tokens, self.checkpoint_budget = budget_tokens, checkpoint_budget
        self._clock = itertools.count(1)
        self._stats = PrefixCacheStats()
        self._root = _Node((), [], [])

    @property
    def stats(self) -> PrefixCacheStats:
        """A snapshot of the counters."""
        s = self._stats
        return PrefixCacheStats(
            s.lookups, s.hit_tokens, s.stored_tokens, s.nodes, s.evicted_tokens, s.checkpoints
        )

    @property
    def nbytes(self) -> int:
        total, stack = 0, [self._root]
        while stack:
            node = stack.pop()
            total += sum(t.numel() * t.element_size() for t in (*node.k, *node.v))
            total += sum(c.nbytes for c in node.states.values())
            stack.extend(node.children.values())
        return total

    def saved_checkpoints(self) -> list[Checkpoint]:
        """Every recurrent-state checkpoint held now (all branches)."""
        held, stack = [], [self._root]
        while stack:
            node = stack.pop()
            held.extend(node.states.values())
            stack.extend(node.children.values())
        return held

    def _walk(self, ids: tuple[int, ...]) -> tuple[list[tuple[_Node, int]], int]:
        """Nodes along the longest cached prefix of ids, each with how many of its tokens match."""
        path: list[tuple[_Node, int]] = []
        node, pos = self._root, 0
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                break
            m = _common(child.tokens, ids, pos)
            path.append((child, m))
            pos += m
            if m < len(child.tokens):
                break
            node = child
        return path, pos

    def match_length(self, ids: Sequence[int]) -> int:
        """Longest cached prefix of ids, in tokens (no side effects)."""
        return self._walk(tuple(int(t) for t in ids))[1]

    def load(self, ids: Sequence[int], kv: KVCache, limit: int | None = None) -> int:
        """Copy the KV of the longest cached prefix of ids (at most `limit` tokens) into the empty `kv`."""
        if kv.length != 0:
            raise ValueError(f"load needs an empty KV cache, this one holds {kv.length} positions")
        path, matched = self._walk(tuple(int(t) for t in ids))
        total = matched if limit is None else max(0, min(matched, limit))
        resume: tuple[_Node, Checkpoint] | None = None
        if kv.recurrent:  # only as far as the deepest saved state within the match
            saved = [(p, node) for node, _ in path for p in node.states if p <= total]
            if saved:
                deepest, holder = max(saved, key=lambda entry: entry[0])
                resume = (holder, holder.states[deepest])
            total = resume[1].position if resume is not None else 0
        self._stats.lookups += 1
        self._stats.hit_tokens += total
        if total == 0:
            return 0
        kv.reserve(total)
        stamp, pos = next(self._clock), 0
        for node, m in path:  # root-down, so every used node's ancestors are stamped too
            if pos >= total:
                break
            n = min(m, total - pos)
            for i, layer in enumerate(kv.layers):
                kv.write(layer, pos, node.k[i][:, :n], node.v[i][:, :n])
            node.last_used = stamp
            pos += n
        kv.advance(total)
        if resume is not None:
            node, checkpoint = resume
            node.states_used[checkpoint.position] = stamp
            kv.restore(checkpoint.position, checkpoint.states)  # type: ignore[attr-defined]
        return total

    def _split(self, node: _Node, m: int) -> None:
        """Keep the first m tokens in `node`; a new only child takes the rest and node's children."""
        tail = _Node(
            node.tokens[m:],
            [t[:, m:].clone() for t in node.k],
            [t[:, m:].clone() for t in node.v],
            parent=node,
            children=node.children,
            last_used=node.last_used,
        )
        boundary = self._depth(node) + m  # states past it stand on the tail's tokens
        for p in [p for p in node.states if p > boundary]:
            tail.states[p], tail.states_used[p] = node.states.pop(p), node.states_used.pop(p)
        for child in tail.children.values():
            child.parent = tail
        node.tokens = node.tokens[:m]
        node.k = [t[:, :m].clone() for t in node.k]
        node.v = [t[:, :m].clone() for t in node.v]
        node.children = {tail.tokens[0]: tail}
        self._stats.nodes += 1

    @staticmethod
    def _depth(node: _Node) -> int:
        """Positions on the path above `node` (where its segment starts)."""
        depth, up = 0, node.parent
        while up is not None:
            depth, up = depth + len(up.tokens), up.parent
        return depth

    def insert(
        self, ids: Sequence[int], kv: KVCache, checkpoints: dict[int, Checkpoint] | None = None
    ) -> None:
        """Store what the tree lacks of ids, whose KV is kv's positions [0, len(ids)), and the recurrent
        `checkpoints` along them (position -> checkpoint, taken over; those past len(ids) are ignored);
        then fit the budgets."""
        key = tuple(int(t) for t in ids)
        if kv.length < len(key):
            raise ValueError(f"KV cache holds {kv.length} positions, fewer than the {len(key)} ids")
        if self.budget_tokens == 0 or not key:
            return
        stamp, node, pos = next(self._clock), self._root, 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:  # new leaf for the missing suffix [pos, len(key))
                end = len(key)
                leaf = _Node(
                    key[pos:],
                    [k[:, pos:end].clone() for k in kv.k],
                    [v[:, pos:end].clone() for v in kv.v],
                    parent=node,
                    last_used=stamp,
                )
                node.children[key[pos]] = leaf
                self._stats.nodes += 1
                self._stats.stored_tokens += end - pos
                break
            m = _common(child.tokens, key, pos)
            if m < len(child.tokens) and pos + m < len(key):  # ids diverge inside the segment
                self._split(child, m)
            child.last_used = stamp
            node, pos = child, pos + m
        self._place_states(key, checkpoints or {}, stamp)
        excess = self._stats.stored_tokens - self.budget_tokens
        if excess > 0:
            self.evict(excess)
        self._fit_checkpoints()

    def _place_states(self, key: tuple[int, ...], checkpoints: dict[int, Checkpoint], stamp: int) -> None:
        """Put each checkpoint in the node covering its position along key's path; stamp the path's."""
        if self.checkpoint_budget == 0:
            return
        node, pos = self._root, 0
        while pos < len(key) and key[pos] in node.children:
            node = node.children[key[pos]]
            end = pos + len(node.tokens)
            for p, checkpoint in checkpoints.items():
                if pos < p <= min(end, len(key)) and p not in node.states:
                    node.states[p] = checkpoint
                    self._stats.checkpoints += 1
            for p in node.states:
                if p <= len(key):
                    node.states_used[p] = stamp
            pos = end

    def _fit_checkpoints(self) -> None:
        """Drop checkpoints past the budget: the oldest-used insert's, by the anchor policy among them."""
        while self._stats.checkpoints > self.checkpoint_budget:
            held: list[tuple[int, int, _Node]] = []  # (stamp, position, node)
            stack = [self._root]
            while stack:
                node = stack.pop()
                stack.extend(node.children.values())
                held.extend((node.states_used[p], p, node) for p in node.states)
            oldest = min(stamp for stamp, _, _ in held)
            group = {p: node for stamp, p, node in held if stamp == oldest}
            victim = choose_victim({p: group[p].states[p] for p in group})
            self._drop_state(group[victim], victim)

    def _drop_state(self, node: _Node, position: int) -> None:
        del node.states[position], node.states_used[position]
        self._stats.checkpoints -= 1

    def evict(self, tokens: int) -> int:
        """Free `tokens` tokens (or all stored, if fewer), least recently used leaves first."""
        order = itertools.count()  # tie-break so the heap never compares nodes
        heap: list[tuple[int, int, _Node]] = []
        stack = [self._root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if not node.children and node is not self._root:
                heap.append((node.last_used, next(order), node))
        heapq.heapify(heap)
        freed = 0
        while freed < tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            take = min(len(leaf.tokens), tokens - freed)
            keep = len(leaf.tokens) - take
            if keep > 0:  # trim from the end, with the states that stood on what goes
                boundary = self._depth(leaf) + keep
                for p in [p for p in leaf.states if p > boundary]:
                    self._drop_state(leaf, p)
                leaf.tokens = leaf.tokens[:keep]
                leaf.k = [t[:, :keep].clone() for t in leaf.k]
                leaf.v = [t[:, :keep].clone() for t in leaf.v]
            else:
                parent = leaf.parent
                assert parent is not None
                del parent.children[leaf.tokens[0]]
                leaf.parent = None
                self._stats.nodes -= 1
                self._stats.checkpoints -= len(leaf.states)
                if not parent.children and parent is not self._root:
                    heapq.heappush(heap, (parent.last_used, next(order), parent))
            freed += take
        self._stats.stored_tokens -= freed
        self._stats.evicted_tokens += freed
        return freed

    def clear(self) -> None:
        """Drop all stored KV; lookup, hit and eviction counters are kept."""
        self._root = _Node((), [], [])
        self._stats.stored_tokens = 0
        self._stats.nodes = 0
        self._stats.checkpoints = 0
