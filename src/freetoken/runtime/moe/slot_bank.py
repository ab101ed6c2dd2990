"""Expert slots on the compute device: gate_up [N, 2I, H], down [N, H, I]; or, when the pool keeps every
layer in one codec pair as stored, uint8 [N, 2I, row bytes(H)] and [N, H, row bytes(I)] of its blocks
(`codecs`), filled byte for byte and read by the kernels as they are.

Which expert each slot holds is residency.py's business. Fills issued from the host (warm start, probes,
steps that read the policy back, prefill streaming) copy from the pinned pool on a transfer stream
(CUDA) or as a plain copy when the cpu device stands in for the accelerator; a graph-captured step fills
by kernels/expert_fill.py instead.
"""

from __future__ import annotations

import torch

from freetoken.runtime.moe.pool import HostExpertPool


class SlotBank:
    def __init__(self, pool: HostExpertPool, num_slots: int, device: torch.device) -> None:
        self.pool = pool
        self.device = device
        stored = pool.slot_codecs()
        self.codecs: tuple[str, str] | None = None if stored is None else (stored[0].name, stored[1].name)
        self.gate_up, self.down = self._allocate(num_slots)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def _allocate(self, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        pool, h, i = self.pool, self.pool.hidden_size, self.pool.intermediate_size
        if self.codecs is not None:
            layer = pool.layers[0]
            gu_shape, dn_shape = pool.gate_up[layer].shape[1:], pool.down[layer].shape[1:]
            gate_up = torch.empty(num_slots, *gu_shape, dtype=torch.uint8, device=self.device)
            return gate_up, torch.empty(num_slots, *dn_shape, dtype=torch.uint8, device=self.device)
        gate_up = torch.empty(num_slots, 2 * i, h, dtype=pool.dtype, device=self.device)  # [N, 2I, H]
        down = torch.empty(num_slots, h, i, dtype=pool.dtype, device=self.device)  # [N, H, I]
        return gate_up, down

    def reallocate(self, num_slots: int) -> None:
        """New banks of `num_slots` slots, empty: the old ones are freed first, so device memory never
        holds both (what should stay is filled again from the pool)."""
        del self.gate_up, self.down
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.gate_up, self.down = self._allocate(num_slots)

    def fill(self, slot: int, layer: int, expert: int) -> None:
        """Copy (layer, expert) from the pool into `slot` (on the transfer stream when there is one)."""
        self._copy(
            (self.gate_up[slot], self.pool.gate_up[layer][expert]),
            (self.down[slot], self.pool.down[layer][expert]),
        )

    def fill_run(self, slot: int, layer: int, expert: int, count: int) -> None:
        """Experts [expert, expert + count) of `layer` into slots [slot, slot + count): one copy per bank."""
        self._copy(
            (self.gate_up[slot : slot + count], self.pool.gate_up[layer][expert : expert + count]),
            (self.down[slot : slot + count], self.pool.down[layer][expert : expert + count]),
        )

    def copy_slot(self, src: int, dst: int) -> None:
        """One slot's expert into another, device to device (on the transfer stream when there is one)."""
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
