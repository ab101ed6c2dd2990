"""The delta rule on GPU through flash-linear-attention's Triton kernels, when that package is installed.

`FREETOKEN_LINEAR_ATTENTION`: `auto` (the kernels for CUDA tensors when `fla` imports, torch otherwise)
or `torch` (always the torch rules of delta_net.py). The kernels take the same inputs as those rules:
q already l2-normed and scaled, k l2-normed, g the log decay, beta after its sigmoid; the state is
[Hv, Dk, Dv] fp32 as in LinearState. Inputs go in the model's dtype, as transformers passes them.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch

from freetoken.env import linear_attention_choice


@cache
def fla_rules() -> tuple[Callable, Callable] | None:
    """(chunked, recurrent) from flash-linear-attention, or None when absent or turned off."""
    if linear_attention_choice() == "torch":
        return None
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception:  # not installed, or it fails to import against this torch/triton
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def fla_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The delta rule of delta_net.py through the kernels: q, k [T, Hv, Dk], v [T, Hv, Dv], g, beta [T, Hv],
    state [Hv, Dk, Dv] fp32 (updated in place) -> [T, Hv, Dv] in `dtype`."""
    rules = fla_rules()
    assert rules is not None
    chunked, recurrent = rules
    rule = recurrent if q.shape[0] == 1 else chunked
    out, final = rule(
        q[None].to(dtype),
        k[None].to(dtype),
        v[None].to(dtype),
        g=g[None].float(),
        beta=beta[None].to(dtype),
        scale=1.0,  # q is scaled already
        initial_state=state[None],
        output_final_state=True,
    )
    state.copy_(final[0])
    return out[0]


def use_fla(x: torch.Tensor) -> bool:
    return x.is_cuda and fla_rules() is not None
