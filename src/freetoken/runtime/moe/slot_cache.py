"""Residency bookkeeping for the GPU expert slots: one global LRU over (layer, expert), integer ids only.

Recency is a stamp per slot from a global clock; each demanded expert gets its own stamp, hits first
(in the order given), then admitted misses. Empty slots carry stamp -1 and are taken first. Victims
for a step come from one O(N) pass (argpartition) over the stamps with the step's own slots protected.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

EMPTY = -1


class SlotCache:
    def __init__(self, moe_layers: Sequence[int], num_experts: int, num_slots: int) -> None:
        self.moe_layers = tuple(moe_layers)
        self.row_of = {layer: row for row, layer in enumerate(self.moe_layers)}
        self.num_experts = num_experts
        self.num_slots = num_slots
        self.slot_of = np.full((len(self.moe_layers), num_experts), EMPTY, dtype=np.int32)  # [L, E]
        self.owner = np.full((num_slots, 2), EMPTY, dtype=np.int32)  # slot -> (layer row, expert)
        self.last_used = np.full(num_slots, EMPTY, dtype=np.int64)  # [N]
        self.clock = 0

    def lookup(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """experts [M] -> their slots [M], EMPTY where not resident."""
        return self.slot_of[self.row_of[layer], experts]

    def touch(self, slots: np.ndarray) -> None:
        """Mark slots as demanded now, in the given order."""
        n = len(slots)
        self.last_used[slots] = self.clock + np.arange(n)
        self.clock += n

    def victims(self, count: int, protected: np.ndarray) -> np.ndarray:
        """The `count` least recently demanded slots outside `protected`, oldest first (one pass)."""
        if count <= 0:
            return np.empty(0, dtype=np.int64)
        stamps = self.last_used.copy()
        stamps[protected] = np.iinfo(np.int64).max
        available = self.num_slots - len(np.unique(protected))
        if count > available:
            raise ValueError(f"{count} victims asked, {available} slots are not protected")
        if count < self.num_slots:
            candidates = np.argpartition(stamps, count - 1)[:count]
        else:
            candidates = np.arange(self.num_slots)
        return candidates[np.argsort(stamps[candidates], kind="stable")]

    def admit(self, layer: int, expert: int, slot: int) -> tuple[int, int] | None:
        """Put (layer, expert) in `slot`; returns the (layer, expert) it evicted, if any. Touches the slot."""
        row = self.row_of[layer]
        old_row, old_expert = (int(v) for v in self.owner[slot])
        evicted = None
        if old_row != EMPTY:
            self.slot_of[old_row, old_expert] = EMPTY
            evicted = (self.moe_layers[old_row], old_expert)
        self.slot_of[row, expert] = slot
        self.owner[slot] = (row, expert)
        self.touch(np.array([slot]))
        return evicted

    def evict(self, slot: int) -> tuple[int, int] | None:
        """Empty `slot` (it is taken first by the next victims call); returns the (layer, expert) it held."""
        old_row, old_expert = (int(v) for v in self.owner[slot])
        self.owner[slot] = EMPTY
        self.last_used[slot] = EMPTY
        if old_row == EMPTY:
            return None
        self.slot_of[old_row, old_expert] = EMPTY
        return self.moe_layers[old_row], old_expert

    def warm_start(self) -> list[tuple[int, int, int]]:
        """Fill the empty cache with an equal share of every layer (lowest expert ids), oldest first;
        returns the (slot, layer, expert) admitted so the caller can copy them in."""
        layers = self.moe_layers
        placed = []
        for slot in range(min(self.num_slots, len(layers) * self.num_experts)):
            layer, expert = layers[slot % len(layers)], slot // len(layers)
            self.admit(layer, expert, slot)
            placed.append((slot, layer, expert))
        return placed

    def demand(self, layer: int, experts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One layer step asks for `experts` [M] (distinct): their slots [M] and hit mask [M]; the hits
        are touched (recency follows the router)."""
        slots = self.lookup(layer, experts)
        hit = slots != EMPTY
        self.touch(slots[hit])
        return slots, hit

    def admit_misses(self, layer: int, experts: np.ndarray, protected: np.ndarray) -> tuple[np.ndarray, int]:
        """Admit `experts` (misses of this step) into the least recent slots outside `protected`;
        returns (their slots, evictions)."""
        victims = self.victims(len(experts), protected)
        evictions = 0
        for slot, expert in zip(victims.tolist(), experts.tolist(), strict=True):
            evictions += self.admit(layer, expert, slot) is not None
        return victims, evictions

    def resident(self) -> set[tuple[int, int]]:
        return {(self.moe_layers[r], int(e)) for r, e in self.owner if r != EMPTY}
