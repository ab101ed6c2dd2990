"""`fused`: every expert resident on the compute device, computed there."""

from __future__ import annotations

import torch

from freetoken.runtime.moe.executor import ExecutorContext, ExpertExecutor
from freetoken.runtime.moe.experts import routed_experts


class FusedExecutor(ExpertExecutor):
    name = "fused"

    def __init__(self, ctx: ExecutorContext) -> None:
        super().__init__(ctx)
        # On a cpu device the pool's banks are used in place; otherwise one device copy per layer.
        self.gate_up = {layer: t.to(ctx.device) for layer, t in ctx.pool.gate_up.items()}  # [E, 2I, H]
        self.down = {layer: t.to(ctx.device) for layer, t in ctx.pool.down.items()}  # [E, H, I]
        # layers kept as stored codec blocks (uint8 banks), by their (gate_up, down) codec names
        self.codecs = {layer: ctx.pool.codec_names(layer) for layer in ctx.pool.stored}

    def compute(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        bias = self.pair_bias(layer, topk_ids)
        gate_up, down, codecs = self.gate_up[layer], self.down[layer], self.codecs.get(layer)
        return routed_experts(x, topk_ids, topk_weights, gate_up, down, self.fn, bias, codecs)
