"""DeepSeek-V4's MoE layer: a router that chooses by score (score + correction bias, top-k) or, on the
hash-routed layers, by a fixed token id -> experts table; either way the chosen experts' scores,
renormalised and times `routed_scaling_factor`, weight them. Scores are sqrt(softplus(logit)) (or sigmoid,
softmax, as `scoring_func` says). The routed experts run in the engine's expert executor, whatever the
backend: a hash-routed layer hands it (topk_ids, topk_weights) like any other. Routed and shared experts
compute the same clamped SwiGLU, silu(min(g, L)) · clamp(u, −L, L) with L = swiglu_limit (the config's
experts' function, moe/expert_fn.py's clamped_silu): the executor's kernels for the routed ones, the shared
expert here.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.runtime.models.deepseek_v4_config import DeepseekV4ModelConfig
from freetoken.runtime.models.kernels.cpu_linear import Linear
from freetoken.runtime.models.slot_decode import DecodeStep
from freetoken.runtime.moe.executor import ExpertExecutor
from freetoken.runtime.moe.expert_fn import ExpertFn, expert_fn_of
from freetoken.runtime.moe.kernels.router_topk import (
    RENORM_EPS,
    RouterRule,
    choose_experts,
    choose_experts_reference,
    expert_scores,
    use_router_kernel,
)


class Router(nn.Module):
    """transformers' names: weight [E, H], and e_score_correction_bias [E] (score-routed layers) or
    tid2eid [V, K] (hash-routed layers: token id -> its K experts)."""

    def __init__(self, cfg: DeepseekV4ModelConfig, hashed: bool) -> None:
        super().__init__()
        self.hashed, self.top_k = hashed, cfg.num_experts_per_tok
        self.scoring, self.scaling = cfg.router_scoring, cfg.routed_scaling_factor
        self.rule = RouterRule(self.top_k, self.scoring, True, biased=True, scaling=self.scaling)
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size), requires_grad=False)
        if hashed:
            table = torch.zeros(cfg.vocab_size, self.top_k, dtype=torch.int64)
            self.tid2eid = nn.Parameter(table, requires_grad=False)
        else:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts), requires_grad=False)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H], token_ids [T] -> topk_ids [T, K] int64, topk_weights [T, K] in x's dtype."""
        logits = F.linear(x.float(), self.weight.float())  # [T, E]
        if not self.hashed:
            choose = choose_experts if use_router_kernel(x) else choose_experts_reference
            return choose(logits, self.rule, self.e_score_correction_bias, x.dtype)
        ids = self.tid2eid[token_ids].long()
        weights = expert_scores(logits, self.scoring).gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + RENORM_EPS)
        return ids, (weights * self.scaling).to(x.dtype)


class SharedExpert(nn.Module):
    """down(fn(gate(x), up(x))): a dense expert computing the routed experts' function `fn`."""

    def __init__(self, hidden: int, intermediate: int, fn: ExpertFn) -> None:
        super().__init__()
        self.fn = fn
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        return self.down_proj(self.fn.glu(self.gate_proj(x), self.up_proj(x)))


class HashMoeBlock(nn.Module):
    """The router (`gate`), the routed experts in the executor, and the shared expert."""

    def __init__(self, cfg: DeepseekV4ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.gate = Router(cfg, hashed=layer in cfg.hash_layers)
        self.shared_experts = SharedExpert(cfg.hidden_size, cfg.moe_intermediate_size, expert_fn_of(cfg))
        self.executor: ExpertExecutor | None = None
        self.recorder: Any = None  # a RoutingRecorder while --record-routing is on

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H] of tokens token_ids [T] -> [T, H]."""
        assert self.executor is not None, "attach an expert executor before the forward pass"
        ids, weights = self.gate(x, token_ids)
        if self.recorder is not None:
            self.recorder.add(self.layer, ids)
        return self.executor.forward(self.layer, x, ids, weights) + self.shared_experts(x)

    def decode(self, x: torch.Tensor, step: DecodeStep) -> torch.Tensor:
        """x [B, H], one new token per row (padding rows route to no expert) -> [B, H]."""
        assert self.executor is not None, "attach an expert executor before the forward pass"
        ids, weights = self.gate(x, step.rows.tokens)
        ids = torch.where(step.real[:, None], ids, -1)
        if self.recorder is not None:
            self.recorder.add(self.layer, ids)
        return self.executor.forward(self.layer, x, ids, weights) + self.shared_experts(x)
