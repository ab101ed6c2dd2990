"""Expert slots on the compute device: gate_up [N, 2I, H], down [N, H, I]; or, when the pool keeps every
layer's experts as stored (`layer_codecs`), the codec blocks themselves, filled byte for byte and read by
the kernels as they are.

Slots of codec blocks are flat byte rows, uint8 [N, gate_up bytes] and [N, down bytes], each as long as
the largest layer's expert needs, so layers in different codecs share them (Q4_K_M files keep some down
projections in Q6_K): `banks(layer)` views them as that layer's [N, 2I, row bytes(H)] and
[N, H, row bytes(I)], rows contiguous within a slot (row stride = the layer's row bytes), slot stride the
slot's length. A layer whose experts are shorter leaves the rest of each slot unread. With one pair for
every layer the views are the whole banks, contiguous.

Which expert each slot holds is residency.py's business. Fills issued from the host (warm start, probes,
steps that read the policy back, prefill streaming) copy from the pinned pool on a transfer stream
(CUDA) or as a plain copy when the cpu device stands in for the accelerator; a graph-captured step fills
by kernels/expert_fill.py instead.
"""

from __future__ import annotations

import torch

from freetoken.runtime.moe.pool import HostExpertPool

# Slots a cached backend's bank holds beyond its cache's: the last is the bandwidth probes' own. Device
# memory like the cache's slots, so a VRAM budget counts it (memory.held_bytes).
PROBE_SLOTS = 1


class SlotBank:
    def __init__(self, pool: HostExpertPool, num_slots: int, device: torch.device) -> None:
        self.pool = pool
        self.device = device
        stored = pool.slot_codecs()
        # layer -> (gate_up, down) codec names; empty when the slots hold `pool.dtype` values
        self.layer_codecs: dict[int, tuple[str, str]] = {
            layer: (gu.name, dn.name) for layer, (gu, dn) in (stored or {}).items()
        }
        h, i = pool.hidden_size, pool.intermediate_size
        self._row_bytes = {  # layer -> (gate_up row bytes, down row bytes)
            layer: (gu.row_bytes(h), dn.row_bytes(i)) for layer, (gu, dn) in (stored or {}).items()
        }
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.gate_up, self.down = self._allocate(num_slots)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def _allocate(self, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        pool, h, i = self.pool, self.pool.hidden_size, self.pool.intermediate_size
        self._views = {}
        if self.layer_codecs:
            gu_bytes = max(2 * i * gu for gu, _ in self._row_bytes.values())
            dn_bytes = max(h * dn for _, dn in self._row_bytes.values())
            gate_up = torch.empty(num_slots, gu_bytes, dtype=torch.uint8, device=self.device)
            return gate_up, torch.empty(num_slots, dn_bytes, dtype=torch.uint8, device=self.device)
        gate_up = torch.empty(num_slots, 2 * i, h, dtype=pool.dtype, device=self.device)  # [N, 2I, H]
        down = torch.empty(num_slots, h, i, dtype=pool.dtype, device=self.device)  # [N, H, I]
        return gate_up, down

    def codecs(self, layer: int) -> tuple[str, str] | None:
        """`layer`'s (gate_up, down) codec names as its slots hold them; None for `pool.dtype` values."""
        return self.layer_codecs.get(layer)

    def banks(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The slots as `layer`'s banks: [N, 2I, H] / [N, H, I] values, or its codec rows [N, 2I, row
        bytes(H)] / [N, H, row bytes(I)] (views of the flat slots; see the module)."""
        if not self.layer_codecs:
            return self.gate_up, self.down
        views = self._views.get(layer)
        if views is None:
            gu, dn = self._row_bytes[layer]
            n, h, i = self.gate_up.shape[0], self.pool.hidden_size, self.pool.intermediate_size
            views = (
                self.gate_up.as_strided((n, 2 * i, gu), (self.gate_up.stride(0), gu, 1)),
                self.down.as_strided((n, h, dn), (self.down.stride(0), dn, 1)),
            )
            self._views[layer] = views
        return views

    def reallocate(self, num_slots: int) -> None:
        """New banks of `num_slots` slots, empty: the old ones are freed first, so device memory never
        holds both (what should stay is filled again from the pool)."""
        del self.gate_up, self.down
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.gate_up, self.down = self._allocate(num_slots)

    def fill(self, slot: int, layer: int, expert: int) -> None:
        """Copy (layer, expert) from the pool into `slot` (on the transfer stream when there is one)."""
        gate_up, down = self.banks(layer)
        self._copy(
            (gate_up[slot], self.pool.gate_up[layer][expert]), (down[slot], self.pool.down[layer][expert])
        )

    def fill_run(self, slot: int, layer: int, expert: int, count: int) -> None:
        """Experts [expert, expert + count) of `layer` into slots [slot, slot + count): one copy per bank
        (into a layer's shorter rows of flat slots, torch copies through a contiguous device buffer)."""
        gate_up, down = self.banks(layer)
        self._copy(
            (gate_up[slot : slot + count], self.pool.gate_up[layer][expert : expert + count]),
            (down[slot : slot + count], self.pool.down[layer][expert : expert + count]),
        )

    def copy_slot(self, src: int, dst: int) -> None:
        """One slot's expert into another, device to device (on the transfer stream when there is one): the
        whole slot, whatever layer it holds."""
        self._copy((self.gate_up[dst], self.gate_up[src]), (self.down[dst], self.down[src]))

    def _copy(self, *pairs: tuple[torch.Tensor, torch.Tensor]) -> None:
        if self.stream is None:
            for dst, src in pairs:
                dst.copy_(src)
            return
        with torch.cuda.stream(self.stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)

    def transfer_waits(self, event: torch.cuda.Event | None) -> None:
        """Later copies on the transfer stream start after `event` (e.g. a compute stream's last read)."""
        if self.stream is not None and event is not None:
            self.stream.wait_event(event)

    def fills_done(self) -> torch.cuda.Event | None:
        """An event after every fill issued so far; the compute stream waits on it before using slots."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event
