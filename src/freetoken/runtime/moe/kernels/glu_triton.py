"""The experts' function between the two projections, for the Triton expert kernels (moe_decode_triton.py,
moe_prefill_triton.py); kinds by number as expert_fn.ACTIVATION_KINDS, whose torch `glu` is the reference."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def glu(gate, up, alpha, limit, ACT: tl.constexpr):
    """0 silu(g)·u; 1 gpt-oss's g'·σ(α·g')·(u' + 1); 2 silu(g')·u' — with g' = min(g, L), u' = clamp(u, −L, L)
    (fp32 tiles of any shape)."""
    if ACT == 0:
        return gate / (1.0 + tl.exp(-gate)) * up
    else:
        gate_c = tl.minimum(gate, limit)
        up_c = tl.minimum(tl.maximum(up, -limit), limit)
        if ACT == 1:
            return gate_c / (1.0 + tl.exp(-alpha * gate_c)) * (up_c + 1.0)
        else:
            return gate_c / (1.0 + tl.exp(-gate_c)) * up_c
