"""Prefill expert streaming: two full-layer buffers taken from the decode slot pool, double-buffered.

For one forward pass: 2·E slots are taken from the global LRU (its oldest; what they held is evicted).
While MoE layer l computes from one buffer, the transfer stream copies every expert of the next MoE
layer into the other — no wait for routing, the whole layer goes — then they swap. Events order it:
  ready[b]     recorded on the transfer stream after buffer b's copies; the compute stream waits on it
  released[b]  recorded on the compute stream after the last read of buffer b; the next copies into b
               wait on it
At the end the buffers go back to the cache as ordinary slots holding the last two layers streamed (an
expert already resident elsewhere is not entered twice), so what prefill left behind is a decode hit.
With `hit_d2d`, experts resident elsewhere are copied device to device and only the rest cross PCIe;
without `overlap`, each layer's copy is issued when it is needed (copy, then compute: for comparison).
No residency step runs during a streamed pass, so the table read at the start stays true until `finish`.
A cache of fewer than two layers' slots (`cpu` with no slot, a small budget) streams through a scratch
bank of two layers beside it instead (`scratch_bank`: allocated once, where the device has the room):
the cache is left as it was and nothing is admitted at the end.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from freetoken.runtime.moe.pool import HostExpertPool
from freetoken.runtime.moe.residency import EMPTY, ExpertResidency
from freetoken.runtime.moe.slot_bank import SlotBank

log = logging.getLogger(__name__)

SCRATCH_MARGIN = 512 << 20  # device bytes left free beside a scratch bank (the pass's activations)


def scratch_bank(pool: HostExpertPool, device: torch.device) -> SlotBank | None:
    """Two layers' slots outside the cache, or None where the device lacks the room for them."""
    need = 2 * pool.num_experts * pool.expert_nbytes
    if device.type == "cuda" and torch.cuda.mem_get_info(device)[0] < need + SCRATCH_MARGIN:
        log.debug("prefill does not stream: %.0f MiB for two layers' buffers are not free", need / 2**20)
        return None
    try:
        bank = SlotBank(pool, 2 * pool.num_experts, device)
    except torch.OutOfMemoryError:
        log.debug("prefill does not stream: no room for two layers' buffers (%.0f MiB)", need / 2**20)
        return None
    log.info("prefill streams through two layers' buffers beside the expert cache (%.0f MiB)", need / 2**20)
    return bank


class LayerStreamer:
    def __init__(
        self,
        residency: ExpertResidency,
        bank: SlotBank,
        hit_d2d: bool,
        overlap: bool,
        scratch: SlotBank | None = None,
    ) -> None:
        """Buffers from `bank`'s least recent slots, or, given `scratch` (two layers' slots), from it."""
        self.residency, self.bank = residency, scratch or bank
        self.hit_d2d, self.overlap = hit_d2d and scratch is None, overlap
        self.in_scratch = scratch is not None  # the buffers are the scratch bank, not the cache's slots
        self.layers = residency.moe_layers
        e = residency.num_experts
        if scratch is None:
            taken = np.sort(residency.victims(2 * e))
            residency.evict(taken)  # no table row points into the buffers any more
            self.table = residency.table()  # [L, E] on the host, for the pass
        else:
            taken = np.arange(2 * e)
            self.table = np.full((len(self.layers), e), EMPTY)  # the cache's slots are not read
        self.slots = [taken[:e], taken[e:]]  # buffer -> [E] slot of each expert
        self.slots_device = [torch.from_numpy(s.astype(np.int64)).to(bank.device) for s in self.slots]
        self.holds: list[int | None] = [None, None]  # buffer -> the layer copied into it
        self.ready: list[torch.cuda.Event | None] = [None, None]
        self.released: list[torch.cuda.Event | None] = [None, None]
        self.copies: dict[int, tuple[int, int]] = {}  # layer -> experts copied (over PCIe, on the device)
        self._next = 0  # the buffer the next stage() fills

    def stage(self, layer: int) -> None:
        """Issue the copies of every expert of `layer` into the free buffer (on the transfer stream)."""
        b = self._next
        self._next = 1 - b
        self.bank.transfer_waits(self.released[b])
        row, slots = self.residency.row_of[layer], self.slots[b]
        resident = self.table[row] if self.hit_d2d else np.full(len(slots), EMPTY)
        remote = np.flatnonzero(resident == EMPTY)
        for start, count in _runs(remote, slots):
            self.bank.fill_run(int(slots[start]), layer, int(start), count)
        for expert in np.flatnonzero(resident != EMPTY).tolist():
            self.bank.copy_slot(int(resident[expert]), int(slots[expert]))
        pcie, d2d = self.copies.get(layer, (0, 0))
        self.copies[layer] = (pcie + len(remote), d2d + len(slots) - len(remote))
        self.holds[b] = layer
        self.ready[b] = self.bank.fills_done()

    def acquire(self, layer: int, stream: torch.cuda.Stream | None) -> torch.Tensor:
        """[E] device slot of each expert of `layer`, ready for `stream` to read; stages the next layer."""
        if layer not in self.holds:
            self.stage(layer)
        b = self.holds.index(layer)
        if stream is not None and self.ready[b] is not None:
            stream.wait_event(self.ready[b])
        if self.overlap:
            nxt = self.layers.index(layer) + 1
            if nxt < len(self.layers) and self.layers[nxt] not in self.holds:
                self.stage(self.layers[nxt])
        return self.slots_device[b]

    def release(self, layer: int, stream: torch.cuda.Stream | None) -> None:
        """`stream` has issued its last read of `layer`'s buffer."""
        b = self.holds.index(layer)
        if stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
            self.released[b] = event

    def finish(self, stream: torch.cuda.Stream | None) -> None:
        """Give the buffers back to the cache as slots holding the layers they hold, newest last. Every
        later copy on the transfer stream waits for `stream`'s reads of the buffers issued so far."""
        if stream is not None:
            done = torch.cuda.Event()
            done.record(stream)
            self.bank.transfer_waits(done)
        if self.in_scratch:
            return  # the next pass's copies into the scratch bank wait for these reads
        order = sorted(
            range(2), key=lambda b: self.layers.index(h) if (h := self.holds[b]) is not None else -1
        )
        for b in order:
            layer = self.holds[b]
            if layer is None:
                continue
            absent = np.flatnonzero(self.table[self.residency.row_of[layer]] == EMPTY)
            self.residency.admit(layer, absent, self.slots[b][absent])


def _runs(experts: np.ndarray, slots: np.ndarray) -> list[tuple[int, int]]:
    """(first expert, count) runs where consecutive experts go to consecutive slots: one copy each."""
    runs: list[tuple[int, int]] = []
    for expert in experts.tolist():
        if runs and runs[-1][0] + runs[-1][1] == expert and slots[expert] == slots[expert - 1] + 1:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((expert, 1))
    return runs
