"""Which (layer, expert) sits in which GPU slot: one global LRU whose state lives on the compute device.

The tables are the one truth, on the device the slots are on (the cpu device when it stands in):
  slot_of   [L, E] int32  slot of (layer row, expert), -1 = not resident
  owner     [S] int32     flat key row·E + expert held by each slot, -1 = empty
  stamp     [S] int64     last use on one global clock, -1 = empty (taken first)
  clock     [1] int64     the next stamp
  fetch     [L] float32   per row, the fraction f of a step's misses to fetch (q* = m·B_P/B_H; 1 fetches
                          all, 0 none: the CPU computes them)
  counters  [L, 5] int64  hits, misses, fills, evictions, cpu (distinct experts), accumulated
  prefetch_counters [L, 5] the same for the router-lookahead prefetches (lookahead.py), kept apart so
                          the demand counters (miss rates) mean the same with or without them

`ensure` is one layer step of the policy (kernels/lru_ensure.py): dedup, hits stamped, the q misses to
fetch chosen (most tokens, then router weight), victims by least recent stamp outside the step's own
experts, a fill plan and each pair's slot id; on CUDA one Triton launch with no host sync, so a decode
step with misses is still one graph replay; elsewhere the torch mirror of the same policy (the oracle,
also what `replay`'s `lru` policy runs). The host touches the tables only at safe points (warm start,
prefill layer streaming, counters), through the methods below, which may sync.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from freetoken.runtime.moe.kernels.lru_ensure import lru_ensure, lru_ensure_reference

EMPTY = -1
COUNTER_NAMES = ("hits", "misses", "fills", "evictions", "cpu")
NO_FETCH_CAP = 1 << 30


class ExpertResidency:
    def __init__(
        self, moe_layers: Sequence[int], num_experts: int, num_slots: int, device: torch.device | str
    ) -> None:
        self.moe_layers = tuple(moe_layers)
        self.row_of = {layer: row for row, layer in enumerate(self.moe_layers)}
        self.num_experts, self.num_slots = num_experts, num_slots
        self.device = torch.device(device)
        n, dev = len(self.moe_layers), self.device
        self.slot_of = torch.full((n, num_experts), EMPTY, dtype=torch.int32, device=dev)  # [L, E]
        self.owner = torch.full((num_slots,), EMPTY, dtype=torch.int32, device=dev)  # [S]
        self.stamp = torch.full((num_slots,), EMPTY, dtype=torch.int64, device=dev)  # [S]
        self.clock = torch.zeros(1, dtype=torch.int64, device=dev)
        self.fetch = torch.ones(n, dtype=torch.float32, device=dev)  # [L]
        self.max_fetch = NO_FETCH_CAP
        self.counters = torch.zeros(n, len(COUNTER_NAMES), dtype=torch.int64, device=dev)  # [L, 5]
        self.prefetch_counters = torch.zeros_like(self.counters)  # [L, 5]
        self._fetch_all = torch.ones(n, dtype=torch.float32, device=dev)  # [L]
        self._ensure = lru_ensure if dev.type == "cuda" else lru_ensure_reference

    # -- the policy, one layer step (graph-capturable on CUDA) ----------------------------------------------

    def ensure(
        self, layer: int, ids: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ids, weights [T, K] (-1 = no pair) -> (slot_ids [T, K] int64, -1 where the CPU computes the
        pair; plan [T·K, 2] int32 (expert, slot) of each fill, the first `count` rows valid; count [1])."""
        t, k = ids.shape
        slot_ids = torch.empty((t, k), dtype=torch.int64, device=ids.device)
        plan = torch.empty((t * k, 2), dtype=torch.int32, device=ids.device)
        count = torch.empty(1, dtype=torch.int32, device=ids.device)
        self._ensure(
            ids, weights, self.row_of[layer], self.slot_of, self.owner, self.stamp, self.clock,
            self.fetch, self.max_fetch, self.counters, slot_ids, plan, count,
        )  # fmt: skip
        return slot_ids, plan, count

    def prefetch(
        self, layer: int, experts: torch.Tensor, scores: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The same LRU step for `experts` [1, W] of `layer` (-1: none) predicted before its own step:
        resident ones stamped, every other one admitted (fetched, never left to the CPU), the most
        likely first when slots run short. Returns (plan [W, 2] int32, count [1] int32) for the fill;
        counted in `prefetch_counters`."""
        w = experts.shape[1]
        slot_ids = torch.empty((1, w), dtype=torch.int64, device=experts.device)
        plan = torch.empty((w, 2), dtype=torch.int32, device=experts.device)
        count = torch.empty(1, dtype=torch.int32, device=experts.device)
        self._ensure(
            experts, scores, self.row_of[layer], self.slot_of, self.owner, self.stamp, self.clock,
            self._fetch_all, NO_FETCH_CAP, self.prefetch_counters, slot_ids, plan, count,
        )  # fmt: skip
        return plan, count

    def set_fetch(self, fractions: Sequence[float], max_fetch: int | None) -> None:
        """Per MoE layer row, the fraction of misses to fetch; `max_fetch` caps fetches per layer step."""
        self.fetch.copy_(torch.tensor(list(fractions), dtype=torch.float32))
        self.max_fetch = NO_FETCH_CAP if max_fetch is None else max(1, max_fetch)

    # -- safe points: the host reads or edits the tables (may sync) ------------------------------------------

    def warm_start(self) -> list[tuple[int, int, int]]:
        """Fill the empty cache with an equal share of every layer (lowest expert ids), oldest first;
        returns the (slot, layer, expert) placed so the caller can copy them in."""
        n = len(self.moe_layers)
        slots = np.arange(min(self.num_slots, n * self.num_experts))
        if len(slots):
            self._place(slots % n, slots // n, slots)
        return [(s, self.moe_layers[s % n], s // n) for s in slots.tolist()]

    def victims(self, count: int) -> np.ndarray:
        """The `count` least recently used slots (empty first), oldest first."""
        stamp = self.stamp.cpu().numpy()
        return np.argsort(stamp, kind="stable")[:count]

    def evict(self, slots: np.ndarray) -> None:
        """Empty `slots` (they are taken first by the next victims)."""
        index = torch.from_numpy(np.asarray(slots, dtype=np.int64)).to(self.device)
        keys = self.owner[index].long()
        held = keys[keys >= 0]
        self.slot_of.view(-1)[held] = EMPTY
        self.owner[index] = EMPTY
        self.stamp[index] = EMPTY

    def admit(self, layer: int, experts: np.ndarray, slots: np.ndarray) -> None:
        """Put `experts` of `layer` into `slots` (empty ones: evict first), stamped newest, in order."""
        if len(experts):
            self._place(np.full(len(experts), self.row_of[layer]), np.asarray(experts), np.asarray(slots))

    def _place(self, rows: np.ndarray, experts: np.ndarray, slots: np.ndarray) -> None:
        dev, n = self.device, len(slots)
        rows_t, experts_t, slots_t = (
            torch.from_numpy(a.astype(np.int64)).to(dev) for a in (rows, experts, slots)
        )
        self.slot_of[rows_t, experts_t] = slots_t.to(torch.int32)
        self.owner[slots_t] = (rows_t * self.num_experts + experts_t).to(torch.int32)
        self.stamp[slots_t] = self.clock + torch.arange(n, device=dev)
        self.clock += n

    def resize(self, num_slots: int) -> list[tuple[int, int, int]]:
        """`num_slots` slots from now on: the most recently used residents stay (the LRU's choice; the
        others are evictions), renumbered 0, 1, ... in their old order with their stamps. Returns the
        (slot, layer, expert) the bank must hold. The tables are new tensors: graphs are captured anew."""
        owner, stamp = self.owner.cpu().numpy(), self.stamp.cpu().numpy()
        used = np.flatnonzero(owner >= 0)
        newest = used[np.argsort(stamp[used], kind="stable")[::-1][:num_slots]]
        keep = np.sort(newest)
        dropped = np.setdiff1d(used, keep)
        evictions = np.bincount(owner[dropped] // self.num_experts, minlength=len(self.moe_layers))
        self.counters[:, COUNTER_NAMES.index("evictions")] += torch.from_numpy(evictions).to(self.device)
        kept = owner[keep].astype(np.int64)
        new_owner = np.full(num_slots, EMPTY, dtype=np.int32)
        new_stamp = np.full(num_slots, EMPTY, dtype=np.int64)
        new_owner[: len(keep)], new_stamp[: len(keep)] = kept, stamp[keep]
        table = np.full(self.slot_of.shape, EMPTY, dtype=np.int32)
        table.reshape(-1)[kept] = np.arange(len(keep))
        self.slot_of.copy_(torch.from_numpy(table))
        self.owner = torch.from_numpy(new_owner).to(self.device)
        self.stamp = torch.from_numpy(new_stamp).to(self.device)
        self.num_slots = num_slots
        e = self.num_experts
        return [(slot, self.moe_layers[key // e], key % e) for slot, key in enumerate(kept.tolist())]

    def table(self) -> np.ndarray:
        """[L, E] slot_of on the host."""
        return self.slot_of.cpu().numpy()

    def resident_count(self) -> int:
        return int((self.owner != EMPTY).sum())

    def read_counters(self) -> np.ndarray:
        """[L, 6] the accumulated counters (COUNTER_NAMES), then the experts prefetches filled, on the
        host."""
        fills = COUNTER_NAMES.index("fills")
        return torch.cat((self.counters, self.prefetch_counters[:, fills : fills + 1]), dim=1).cpu().numpy()
