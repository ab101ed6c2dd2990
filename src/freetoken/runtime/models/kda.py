"""Kimi Delta Attention (Kimi-Linear's recurrent layers): gated DeltaNet (delta_net.py) whose decay is per
key channel rather than per head.

Per layer and sequence the state is fixed-size: conv [3·H·D, W-1] (the causal depthwise convolution's
last inputs) and recurrent [H, D, D] fp32. Per token t and head h (q, k L2-normalised as x/√(Σx² + ε), q
scaled by D^-1/2):
  S ← diag(exp(g_t)) S                  g_t [D] = −exp(A_log_h) · softplus(W_fb W_fa x + dt_bias) <= 0
  S ← S + k_t ⊗ β_t (v_t − Sᵀk_t)        β_t = σ(W_b x)
  o_t = Sᵀq_t,  out = W_o · (RMSNorm(o_t) · σ(W_gb W_ga x))
The recurrence runs token by token (prefill too: plain and exact, not fast); decode runs one step of it
over the row's state slot (kernels/delta_step.py). Parameter names follow the
published checkpoints' (q_proj, k_proj, v_proj, q_conv1d, k_conv1d, v_conv1d, f_a_proj, f_b_proj, dt_bias,
A_log, b_proj, g_a_proj, g_b_proj, o_norm, o_proj).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.runtime.models.delta_net import LinearState, decayed_delta_rule
from freetoken.runtime.models.kernels.cpu_linear import Linear
from freetoken.runtime.models.layers import fuse_linear_rows

if TYPE_CHECKING:
    from freetoken.runtime.models.slot_decode import DecodeStep


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


class SigmoidGatedRMSNorm(nn.Module):
    """RMSNorm over a head's dims in fp32, times sigmoid(gate)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = self.weight.float() * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * torch.sigmoid(gate.float())).to(x.dtype)


class KimiDeltaAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, dim: int, conv_kernel: int, eps: float) -> None:
        super().__init__()
        self.heads, self.dim, self.kernel = heads, dim, conv_kernel
        width = heads * dim
        self.conv_dim = 3 * width
        self.q_proj = Linear(hidden, width, bias=False)
        self.k_proj = Linear(hidden, width, bias=False)
        self.v_proj = Linear(hidden, width, bias=False)
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (
            nn.Conv1d(width, width, conv_kernel, groups=width, bias=False) for _ in range(3)
        )
        self.f_a_proj = Linear(hidden, dim, bias=False)
        self.f_b_proj = Linear(dim, width, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(width))
        self.A_log = nn.Parameter(torch.zeros(1, 1, heads, 1))
        self.b_proj = Linear(hidden, heads, bias=False)
        self.g_a_proj = Linear(hidden, dim, bias=False)
        self.g_b_proj = Linear(dim, width, bias=False)
        self.o_norm = SigmoidGatedRMSNorm(dim, eps)
        self.o_proj = Linear(width, hidden, bias=False)
        self.layer = -1  # the model layer it is (its state's key in the KV pool): set by the layer
        self.in_weight: torch.Tensor | None = None  # prepare_decode: the input projections as one matrix
        self.conv_weights: torch.Tensor | None = None  # prepare_decode: the three convolutions as one

    def state_shapes(self, dtype: torch.dtype) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
        """(shape, dtype) of conv [3·H·D, W-1] (activations' dtype) and recurrent [H, D, D] (fp32)."""
        return ((self.conv_dim, self.kernel - 1), dtype), ((self.heads, self.dim, self.dim), torch.float32)

    def new_state(self, device: torch.device, dtype: torch.dtype) -> LinearState:
        conv, recurrent = (
            torch.zeros(shape, dtype=d, device=device) for shape, d in self.state_shapes(dtype)
        )
        return LinearState(conv, recurrent)

    def log_decay(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> g [T, heads, D] (<= 0): −exp(A_log) · softplus(W_fb W_fa x + dt_bias)."""
        return self._decay(self.f_b_proj(self.f_a_proj(x)), x.shape[0])

    def _decay(self, fb: torch.Tensor, t: int) -> torch.Tensor:
        """W_fb W_fa x [T, H·D] -> the log decay [T, heads, D] fp32."""
        g = (fb.float() + self.dt_bias.float()).view(t, self.heads, self.dim)
        return -self.A_log.float().exp()[0] * torch.where(g > 20.0, g, torch.log1p(torch.exp(g)))

    def forward(
        self, x: torch.Tensor, state: LinearState, captures: tuple[int, ...] = ()
    ) -> tuple[torch.Tensor, list[LinearState]]:
        """x [T, H] continuing the sequence whose state is `state` (updated in place) -> ([T, H], the states
        after the first c positions for each c of `captures`, ascending, each in (0, T))."""
        t, h, d = x.shape[0], self.heads, self.dim
        mixed = torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=-1).transpose(0, 1)  # [C, T]
        window = torch.cat((state.conv, mixed), dim=1)  # [C, W-1+T]
        convs = [window[:, c : c + self.kernel - 1].clone() for c in captures]
        state.conv.copy_(window[:, -(self.kernel - 1) :])
        weight = self.conv_weight()  # [C, 1, W]
        conv = F.silu(F.conv1d(window[None].to(weight.dtype), weight, groups=self.conv_dim)[0])  # [C, T]
        q, k, v, beta = kda_inputs(conv.transpose(0, 1), self.b_proj(x), h)
        g = self.log_decay(x).exp()  # [T, H, D]
        pieces, snapshots = [], []
        for a, b in zip((0, *captures), (*captures, t), strict=True):  # segments ending at the captures
            pieces.append(decayed_delta_rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], state.recurrent))
            if b < t:
                snapshots.append(LinearState(convs[len(snapshots)], state.recurrent.clone()))
        out = torch.cat(pieces) if len(pieces) > 1 else pieces[0]  # [T, H, D] fp32
        gate = self.g_b_proj(self.g_a_proj(x)).view(t, h, d)
        return self.o_proj(self.o_norm(out.to(x.dtype), gate).reshape(t, h * d)), snapshots

    def conv_weight(self) -> torch.Tensor:
        """The three depthwise convolutions as one [3·H·D, 1, W] (made once by prepare_decode)."""
        if self.conv_weights is not None:
            return self.conv_weights
        return torch.cat((self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight))

    def prepare_decode(self) -> None:
        """The input projections as one matrix and the three convolutions as one (once)."""
        if self.in_weight is None:
            projections = (self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.b_proj, self.g_a_proj)
            self.in_weight, _ = fuse_linear_rows(projections)
            self.conv_weights = self.conv_weight()

    def decode(self, x: torch.Tensor, step: DecodeStep) -> torch.Tensor:
        """x [B, H] normed, one new position per row -> [B, H]; each real row's conv window and recurrent
        state updated in its slot of the pool's state blocks (conv [S, 3HD, W-1], recurrent [S, H, D, D])."""
        ops, slots = step.ops, step.rows.slots
        conv_state, recurrent = step.pool.states[self.layer]
        rows, h, d = x.shape[0], self.heads, self.dim
        y = ops.linear(x, self.in_weight)  # [B, 3·H·D + D + H + D]: one GEMV
        qkv, fa, b, ga = torch.split(y, [self.conv_dim, d, h, d], dim=-1)
        mixed = ops.conv_step(qkv, conv_state, self.conv_weights, slots)  # [B, 3·H·D]
        decay = self._decay(self.f_b_proj(fa), rows)  # [B, H, D]
        o = ops.kda_step(mixed, b, decay.contiguous(), recurrent, slots)  # [B, H, D]
        gate = self.g_b_proj(ga).view(rows, h, d)
        return self.o_proj(self.o_norm(o, gate).reshape(rows, h * d))


def kda_inputs(mixed: torch.Tensor, b: torch.Tensor, heads: int) -> tuple[torch.Tensor, ...]:
    """The recurrence's inputs from the convolved mixed [T, 3·H·D] and β's logits b [T, H] -> q, k, v
    [T, H, D] fp32 (q, k l2-normed, q scaled by D^-1/2), beta [T, H] fp32."""
    t = mixed.shape[0]
    q, k, v = (part.reshape(t, heads, -1).float() for part in mixed.split(mixed.shape[1] // 3, dim=-1))
    d = q.shape[-1]
    return _l2norm(q) * d**-0.5, _l2norm(k), v, torch.sigmoid(b.float())
