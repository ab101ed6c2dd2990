"""`fused`: every expert resident on the compute device, computed there."""

from __future__ import annotations

import torch

from freetoken.runtime.moe.executor import ExpertExecutor
from freetoken.runtime.moe.experts import gathered_experts, grouped_experts
from freetoken.runtime.moe.pool import HostExpertPool

# Below this many (token, expert) pairs on an accelerator, gather weights instead of grouping tokens:
# grouping reads the routing back to the host, a sync per layer.
GATHER_MAX_PAIRS = 64


class FusedExecutor(ExpertExecutor):
    name = "fused"

    def __init__(self, pool: HostExpertPool, device: torch.device) -> None:
        super().__init__(pool, device)
        # On a cpu device the pool's banks are used in place; otherwise one device copy per layer.
        self.gate_up = {layer: t.to(device) for layer, t in pool.gate_up.items()}  # [E, 2I, H]
        self.down = {layer: t.to(device) for layer, t in pool.down.items()}  # [E, H, I]

    def forward(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        banks = self.gate_up[layer], self.down[layer]
        if x.device.type != "cpu" and topk_ids.numel() <= GATHER_MAX_PAIRS:
            return gathered_experts(x, topk_ids, topk_weights, *banks)
        return grouped_experts(x, topk_ids, topk_weights, *banks)
