"""Static K/V storage: one contiguous block per sequence slot, allocated up front.

Per attention layer: k, v [slots, KVH, capacity, D]. A sequence takes a slot when it is made and gives
it back when it leaves; decode never allocates, so the tensors' data pointers stay fixed (a captured
CUDA graph reads and writes them in place; a row's slot and length are device values written before
replay). Contiguous, not paged: every slot holds a whole context, so `slots × capacity` positions are
reserved. Should more sequences than slots be asked for (a scheduler reserves its batch size up front,
so only tools and tests do this), the pool grows by one slot at that safe point: the storage is
re-allocated, live caches re-bind their views, and `generation` changes so graphs are captured again.
A hybrid model's recurrent layers get their states the same way: a fixed block per slot per layer.
"""

from __future__ import annotations

import logging
import weakref
from typing import Protocol

import torch

from freetoken.errors import FreeTokenError

log = logging.getLogger("freetoken.kv")


StateShape = tuple[tuple[int, ...], torch.dtype]


class SlotHolder(Protocol):
    def bind(self) -> None: ...


class KVSlotPool:
    def __init__(
        self,
        slots: int,
        layers: tuple[int, ...],
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device,
        state_shapes: dict[int, tuple[StateShape, ...]] | None = None,
        v_dim: int | None = None,
    ) -> None:
        """`state_shapes`: per recurrent layer, the (shape, dtype) of each tensor of its state (a hybrid
        model's DeltaNet layers); each gets a fixed per-slot block too. `v_dim`: value dims when they
        differ from `head_dim` (0: no values, as latent attention caches)."""
        if slots < 1 or capacity < 1:
            raise FreeTokenError(
                f"a KV pool needs at least one slot and one position, got {slots}×{capacity}"
            )
        self.slots, self.capacity = slots, capacity
        self.layers = tuple(layers)  # model layers that keep K/V, in the order of k and v
        self.index = {layer: i for i, layer in enumerate(self.layers)}
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.v_dim = head_dim if v_dim is None else v_dim
        self.dtype, self.device = dtype, device
        self.generation = 0  # changes whenever the storage moves
        self.state_shapes = dict(state_shapes or {})
        self.k, self.v = self._allocate(slots), self._allocate(slots, self.v_dim)
        self.states = self._allocate_states(slots)  # layer -> [slots, *shape] per state tensor
        self._free = list(range(slots - 1, -1, -1))  # pop() hands out the lowest slot first
        self._holders: weakref.WeakSet[SlotHolder] = weakref.WeakSet()

    def _allocate(self, slots: int, dim: int | None = None) -> list[torch.Tensor]:
        shape = (slots, self.num_kv_heads, self.capacity, self.head_dim if dim is None else dim)
        return [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]

    def _allocate_states(self, slots: int) -> dict[int, list[torch.Tensor]]:
        return {
            layer: [torch.zeros((slots, *shape), dtype=dtype, device=self.device) for shape, dtype in shapes]
            for layer, shapes in self.state_shapes.items()
        }

    def acquire(self, holder: SlotHolder) -> int:
        """A free slot for `holder` (whose `bind()` re-reads its views should the storage move)."""
        if not self._free:
            self.grow(self.slots + 1)
        self._holders.add(holder)
        return self._free.pop()

    def grow(self, slots: int) -> None:
        """Hold `slots` sequences: new storage, live slots copied, their holders re-bound."""
        if slots <= self.slots:
            return
        log.info("KV cache grows to %d sequence slots of %d positions", slots, self.capacity)
        k, v, states = self._allocate(slots), self._allocate(slots, self.v_dim), self._allocate_states(slots)
        old_states = [t for layer in self.states for t in self.states[layer]]
        new_states = [t for layer in states for t in states[layer]]
        for new, old in zip((*k, *v, *new_states), (*self.k, *self.v, *old_states), strict=True):
            new[: self.slots] = old
        self.k, self.v, self.states = k, v, states
        self._free = list(range(slots - 1, self.slots - 1, -1)) + self._free
        self.slots = slots
        self.generation += 1
        for holder in list(self._holders):
            holder.bind()

    def release(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.slots:
            raise ValueError(f"KV slot {slot} is not in use")
        self._free.append(slot)

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        states = [t for tensors in self.states.values() for t in tensors]
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v, *states))

    @staticmethod
    def bytes_per_token(
        layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, v_dim: int | None = None
    ) -> int:
        dims = head_dim + (head_dim if v_dim is None else v_dim)
        return layers * num_kv_heads * dims * torch.empty(0, dtype=dtype).element_size()
