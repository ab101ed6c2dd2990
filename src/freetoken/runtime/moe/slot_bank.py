"""Expert slots on the compute device and the device copy of the residency table.

Slots: gate_up [N, 2I, H], down [N, H, I]. Fills copy one expert from the pinned pool on a transfer
stream (CUDA) or as a plain copy when the cpu device stands in for the accelerator.
"""

from __future__ import annotations

import numpy as np
import torch

from freetoken.runtime.moe.pool import HostExpertPool


class SlotBank:
    def __init__(self, pool: HostExpertPool, num_slots: int, device: torch.device) -> None:
        self.pool = pool
        self.device = device
        e, h, i = pool.num_experts, pool.hidden_size, pool.intermediate_size
        self.gate_up = torch.empty(num_slots, 2 * i, h, dtype=pool.dtype, device=device)  # [N, 2I, H]
        self.down = torch.empty(num_slots, h, i, dtype=pool.dtype, device=device)  # [N, H, I]
        self.table = torch.full((len(pool.layers), e), -1, dtype=torch.int32, device=device)  # [L, E]
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # Staging for table uploads. Reuse is safe: the compute stream waits on the fills event recorded
        # after each upload, and the next upload comes after the next routing read, which syncs it.
        self._table_host = torch.empty(
            (len(pool.layers), e), dtype=torch.int32, pin_memory=self.stream is not None
        )

    def fill(self, slot: int, layer: int, expert: int) -> None:
        """Copy (layer, expert) from the pool into `slot` (on the transfer stream when there is one)."""
        if self.stream is None:
            self.gate_up[slot].copy_(self.pool.gate_up[layer][expert])
            self.down[slot].copy_(self.pool.down[layer][expert])
            return
        with torch.cuda.stream(self.stream):
            self.gate_up[slot].copy_(self.pool.gate_up[layer][expert], non_blocking=True)
            self.down[slot].copy_(self.pool.down[layer][expert], non_blocking=True)

    def publish(self, slot_of: np.ndarray) -> None:
        """Mirror the host residency table [L, E] into the device table (on the transfer stream)."""
        self._table_host.copy_(torch.from_numpy(slot_of))
        if self.stream is None:
            self.table.copy_(self._table_host)
            return
        with torch.cuda.stream(self.stream):
            self.table.copy_(self._table_host, non_blocking=True)

    def fills_done(self) -> torch.cuda.Event | None:
        """An event after every fill issued so far; the compute stream waits on it before using slots."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event
