"""What a routed expert computes between its two projections, and the biases some families add.

  silu          a = silu(g) · u                        (Qwen, Mixtral, OLMoE, GLM, MiniMax)
  clamped       a = g' · σ(α · g') · (u' + 1)          (gpt-oss)
  clamped_silu  a = silu(g') · u'                      (DeepSeek-V4's routed and shared experts)

with g, u the gate and up projections of x (plus the expert's gate/up bias where it has one) and, in the
clamped kinds, g' = min(g, L), u' = clamp(u, −L, L): the gate bounded above only, the up projection on both
sides, before the function. Every expert path takes an ExpertFn: the torch reference here, the Triton
decode kernel, the CPU C kernel (ft_expert_fn, the same kinds by number). The down projection's bias is
linear in the routing weights, so executors add it once for all of a token's pairs (`down_bias_sum`),
whichever branch computed them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from freetoken.runtime.config import ModelConfig

ACTIVATION_KINDS = ("silu", "clamped", "clamped_silu")  # index = the kernels' number for it


@dataclass(frozen=True)
class ExpertFn:
    kind: str = "silu"
    alpha: float = 1.702  # clamped: the sigmoid's gain
    limit: float = 7.0  # clamped kinds: the bound on the gate (above) and on the up projection (both sides)

    def __post_init__(self) -> None:
        if self.kind not in ACTIVATION_KINDS:
            raise ValueError(f"unknown expert activation {self.kind!r}; known: {', '.join(ACTIVATION_KINDS)}")

    @property
    def code(self) -> int:
        return ACTIVATION_KINDS.index(self.kind)

    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate, up [..., I] -> the activations [..., I] (in their dtype)."""
        if self.kind == "silu":
            return F.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        if self.kind == "clamped_silu":
            return F.silu(gate) * up
        return gate * torch.sigmoid(gate * self.alpha) * (up + 1)


SILU = ExpertFn()


def expert_fn_of(cfg: ModelConfig) -> ExpertFn:
    return ExpertFn(cfg.expert_act, cfg.swiglu_alpha, cfg.swiglu_limit)


class PairBias(NamedTuple):
    """The gate/up bias of each (token, choice) pair's expert: row ids[t, k] of `gate_up` [E, 2I] (gate
    half first). `ids` [T, K] are expert ids even where the weights are read by slot; -1: no pair."""

    gate_up: torch.Tensor
    ids: torch.Tensor

    def rows(self, pairs: torch.Tensor) -> torch.Tensor:
        """The bias rows of flat pair indices `pairs` [P] -> [P, 2I]."""
        flat = self.ids.reshape(-1)
        ids = flat[pairs.to(flat.device)].clamp(min=0)
        return self.gate_up[ids.to(self.gate_up.device)]


def down_bias_sum(down_bias: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ_k weights[t, k] · down_bias[ids[t, k]] -> [T, H] fp32; down_bias [E, H], ids [T, K] (-1: none),
    all on one device (no host sync)."""
    live = ids >= 0
    w = torch.where(live, weights.float(), torch.zeros((), dtype=torch.float32, device=weights.device))
    rows = down_bias[ids.clamp(min=0)]  # [T, K, H]
    return torch.einsum("tk,tkh->th", w, rows.float())
