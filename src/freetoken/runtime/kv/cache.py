"""One sequence's K/V: a view on its slot of the engine's KVSlotPool (fixed storage, never re-allocated).

Layout per attention layer: k, v [KVH, capacity, D]; `layers` names the model's layers that have K/V
(all by default; a hybrid model's recurrent layers have none). Positions [0, length) are valid; a
forward of T tokens at `start == length` writes [start, start + T) in every attention layer, then the
caller advances `length`. Without a pool (tests, tools) the cache makes a one-slot pool of its own.
"""

from __future__ import annotations

import weakref

import torch

from freetoken.errors import FreeTokenError
from freetoken.runtime.kv.slot_pool import KVSlotPool


class KVCache:
    recurrent = False  # whether the cache also carries recurrent state that K/V cannot rebuild

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        max_len: int,
        layers: tuple[int, ...] | None = None,
        pool: KVSlotPool | None = None,
    ) -> None:
        self.num_layers = num_layers
        self.layers = tuple(range(num_layers)) if layers is None else tuple(layers)  # those with K/V
        if pool is None:
            pool = KVSlotPool(1, self.layers, num_kv_heads, head_dim, max_len, dtype, device)
        self._slot = {layer: i for i, layer in enumerate(self.layers)}  # model layer -> index in k, v
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.pool = pool
        self.slot = pool.acquire(self)
        self._release = weakref.finalize(self, pool.release, self.slot)  # at most once: release() or GC
        self.capacity = pool.capacity
        self.max_len = min(max_len, pool.capacity)
        self.length = 0
        self.bind()

    def bind(self) -> None:
        """(Re)read this slot's views from the pool: k, v per attention layer [KVH, capacity, D]."""
        pool = self.pool
        self.k = [pool.k[pool.index[layer]][self.slot] for layer in self.layers]
        self.v = [pool.v[pool.index[layer]][self.slot] for layer in self.layers]

    def reserve(self, needed: int) -> None:
        """Check that `needed` positions fit (the storage is fixed: nothing is allocated)."""
        if needed > self.max_len:
            raise FreeTokenError(f"sequence of {needed} tokens exceeds the context of {self.max_len}")

    def write(
        self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [KVH, T, D] of model layer `layer` at [start, start + T); views of [0, start + T)."""
        end = start + k.shape[1]
        i = self._slot[layer]
        self.k[i][:, start:end] = k
        self.v[i][:, start:end] = v
        return self.k[i][:, :end], self.v[i][:, :end]

    def advance(self, n: int) -> None:
        self.length += n

    def can_truncate(self, length: int) -> bool:
        """Whether `truncate(length)` keeps a valid prefix (always, for attention K/V)."""
        return True

    def truncate(self, length: int) -> None:
        """Forget positions >= length (the prefix before them stays valid)."""
        self.length = min(self.length, max(0, length))

    def release(self) -> None:
        """Give the slot back to the pool; the cache is not used afterwards."""
        self._release()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))  # the slot's share
