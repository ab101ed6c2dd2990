"""Checks of the expert residency against the slot bank's contents (shared by the cached-backend tests)."""

from __future__ import annotations

import torch

from freetoken.runtime.engine import Engine
from freetoken.runtime.moe.residency import EMPTY


def assert_residency_true(engine: Engine) -> None:
    ex = engine.executor
    residency = ex.residency
    table, owner = residency.table(), residency.owner.cpu().numpy()
    e = residency.num_experts
    for row, layer in enumerate(residency.moe_layers):
        for expert, slot in enumerate(table[row].tolist()):
            if slot != EMPTY:
                gate_up, down = ex.bank.banks(layer)
                assert torch.equal(gate_up[slot].cpu(), engine.pool.gate_up[layer][expert])
                assert torch.equal(down[slot].cpu(), engine.pool.down[layer][expert])
                assert owner[slot] == row * e + expert
    for slot, key in enumerate(owner.tolist()):  # no expert owns two slots
        assert key == EMPTY or table[key // e, key % e] == slot
