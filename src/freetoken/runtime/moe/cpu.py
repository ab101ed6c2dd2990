"""`cpu`: experts computed on the host, straight from the pool; activations cross to the host and back."""

from __future__ import annotations

import torch

from freetoken.runtime.moe.executor import ExpertExecutor
from freetoken.runtime.moe.experts import grouped_experts


class CpuExecutor(ExpertExecutor):
    name = "cpu"

    def forward(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        host = torch.device("cpu")
        out = grouped_experts(
            x.to(host, self.pool.dtype),
            topk_ids.to(host),
            topk_weights.to(host, self.pool.dtype),
            self.pool.gate_up[layer],
            self.pool.down[layer],
        )
        return out.to(self.device, x.dtype)
