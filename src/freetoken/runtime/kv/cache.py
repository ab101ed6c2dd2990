"""Contiguous per-sequence KV cache for full-attention layers, grown by doubling.

Layout per attention layer: k, v [KVH, capacity, D]; `layers` names the model's layers that have K/V
(all by default; a hybrid model's recurrent layers have none). Positions [0, length) are valid; a
forward of T tokens at `start == length` writes [start, start + T) in every attention layer, then the
caller advances `length`.
"""

from __future__ import annotations

import torch

_GROW_QUANTUM = 256


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
        initial_capacity: int = _GROW_QUANTUM,
        layers: tuple[int, ...] | None = None,
    ) -> None:
        self.num_layers = num_layers
        self.layers = tuple(range(num_layers)) if layers is None else tuple(layers)  # those with K/V
        self._slot = {layer: i for i, layer in enumerate(self.layers)}  # model layer -> index in k, v
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.max_len = max_len
        self.length = 0
        self.capacity = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.reserve(min(initial_capacity, max_len))

    def reserve(self, needed: int) -> None:
        """Make room for `needed` positions, keeping [0, length)."""
        if needed <= self.capacity:
            return
        if needed > self.max_len:
            raise ValueError(f"sequence of {needed} tokens exceeds the context of {self.max_len}")
        quantum = _GROW_QUANTUM
        capacity = min(self.max_len, max(2 * self.capacity, -(-needed // quantum) * quantum))
        shape = (self.num_kv_heads, capacity, self.head_dim)
        k = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        v = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        for layer in range(len(self.k)):
            k[layer][:, : self.length] = self.k[layer][:, : self.length]
            v[layer][:, : self.length] = self.v[layer][:, : self.length]
        self.k, self.v, self.capacity = k, v, capacity

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
        """Give the K/V storage back (a slot of the engine's pool); the cache is not used afterwards."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))
