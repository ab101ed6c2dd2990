"""Gated DeltaNet linear attention (the recurrent layers of Qwen3.5/3.6 MoE and Qwen3-Next).

Per layer and sequence the state is small and fixed-size, whatever the length:
  conv       [C, W-1]     the last W-1 inputs of the causal depthwise convolution (C = 2·Hk·Dk + Hv·Dv)
  recurrent  [Hv, Dk, Dv] the delta-rule memory, fp32
Per token t and value head h (q, k L2-normalised, q scaled by Dk^-1/2, key heads shared by Hv/Hk value heads):
  S ← exp(g_t)·S                       decay, g_t = −exp(A_log)·softplus(a_t + dt_bias) <= 0
  S ← S + k_t ⊗ β_t·(v_t − Sᵀk_t)      the delta rule: write only what the memory does not already predict
  o_t = Sᵀq_t,  out = W_o · (RMSNorm(o_t) · silu(z_t))
Decode steps run the recurrence token by token (`delta_rule`); prefill runs its chunked matmul form
(`chunked_delta_rule`), which leaves the same state. On CUDA, flash-linear-attention's kernels replace
both when that package is installed (delta_kernels.py).
Parameter names follow the checkpoint's (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, conv1d, dt_bias,
A_log, norm, out_proj).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.runtime.models.delta_kernels import fla_delta_rule, use_fla
from freetoken.runtime.models.kernels.cpu_linear import Linear
from freetoken.runtime.models.layers import fuse_linear_rows

if TYPE_CHECKING:
    from freetoken.runtime.models.slot_decode import DecodeStep


@dataclass
class LinearState:
    """One sequence's state of one DeltaNet layer (see the module docstring for shapes)."""

    conv: torch.Tensor
    recurrent: torch.Tensor

    def clone(self) -> LinearState:
        return LinearState(self.conv.clone(), self.recurrent.clone())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.recurrent))


class GatedRMSNorm(nn.Module):
    """RMSNorm of the attention output, then multiplied by silu(gate) (norm first, gate after)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (self.weight * normed * F.silu(gate.float())).to(dtype)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_inputs(
    mixed: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    hk: int,
    dk: int,
) -> tuple[torch.Tensor, ...]:
    """The delta rule's inputs from the convolved mixed [T, 2·Hk·Dk + Hv·Dv] and the projections b, a
    [T, Hv] -> q, k [T, Hv, Dk] (l2-normed, q scaled by Dk^-1/2, key heads repeated over their value
    heads), v [T, Hv, Dv], g, beta [T, Hv]; all fp32."""
    t, hv = b.shape
    q, k, v = torch.split(mixed, [hk * dk, hk * dk, mixed.shape[1] - 2 * hk * dk], dim=-1)
    group = hv // hk
    q = _l2norm(q.reshape(t, hk, dk).float()).repeat_interleave(group, dim=1) * dk**-0.5
    k = _l2norm(k.reshape(t, hk, dk).float()).repeat_interleave(group, dim=1)
    v = v.reshape(t, hv, -1).float()
    beta = b.float().sigmoid()  # [T, Hv]
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)  # [T, Hv]
    return q, k, v, g, beta


def delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """q, k [T, Hv, Dk], v [T, Hv, Dv], g, beta [T, Hv], state [Hv, Dk, Dv] (fp32, updated in place)
    -> outputs [T, Hv, Dv] fp32."""
    return decayed_delta_rule(q, k, v, g.exp()[..., None], beta, state)


def decayed_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """The recurrence token by token with the decay factors given: decay [T, H, Dk] (Kimi Delta Attention:
    one per key channel) or [T, H, 1] (one per head); q, k [T, H, Dk], v [T, H, Dv], beta [T, H], state
    [H, Dk, Dv] (fp32, updated in place) -> outputs [T, H, Dv] fp32."""
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    s = state
    for t in range(q.shape[0]):
        s.mul_(decay[t][..., None])
        predicted = torch.einsum("hkv,hk->hv", s, k[t])
        s.add_(k[t][:, :, None] * (beta[t][:, None] * (v[t] - predicted))[:, None, :])
        out[t] = torch.einsum("hkv,hk->hv", s, q[t])
    return out


def chunked_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = 64,
) -> torch.Tensor:
    """The same as `delta_rule`, a chunk of positions at a time in matmuls (for prefill).

    Within a chunk starting from state S0, with γ_t the cumulative log decay and u_t the value each
    position writes: S_t = e^{γ_t}·S0 + Σ_{j<=t} e^{γ_t−γ_j}·k_j u_jᵀ, and the delta rule gives the unit
    lower-triangular system (I + A)·U = diag(β)·V − diag(β e^γ)·K·S0 with A_tj = β_t e^{γ_t−γ_j} k_t·k_j
    (j < t). Then O = diag(e^γ)·Q·S0 + (M ⊙ Q·Kᵀ)·U (M_tj = e^{γ_t−γ_j}, j <= t), and the state passed on
    is e^{γ_C}·S0 + (e^{γ_C−γ} ⊙ K)ᵀ·U. Every exponent is <= 0, so nothing overflows.
    """
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)  # [T, Hv, Dv]
    for a in range(0, q.shape[0], chunk):
        b = min(a + chunk, q.shape[0])
        qc, kc, vc = (x[a:b].transpose(0, 1) for x in (q, k, v))  # [Hv, C, D]
        gamma = g[a:b].transpose(0, 1).cumsum(-1)  # [Hv, C]
        bc = beta[a:b].transpose(0, 1)  # [Hv, C]
        diff = gamma[:, :, None] - gamma[:, None, :]  # [Hv, C, C]: γ_t − γ_j
        n = b - a
        lower = torch.tril(torch.ones(n, n, dtype=torch.bool, device=q.device))
        decay = torch.where(lower, diff, torch.full_like(diff, -torch.inf)).exp()  # M, inclusive
        strict = decay * ~torch.eye(n, dtype=torch.bool, device=q.device)
        system = bc[:, :, None] * strict * (kc @ kc.transpose(1, 2))  # A
        eye = torch.eye(n, dtype=torch.float32, device=q.device).expand_as(system)
        rhs = bc[:, :, None] * vc - (bc * gamma.exp())[:, :, None] * (kc @ state)
        u = torch.linalg.solve_triangular(eye + system, rhs, upper=False, unitriangular=True)  # [Hv, C, Dv]
        out[a:b] = (
            gamma.exp()[:, :, None] * (qc @ state) + (decay * (qc @ kc.transpose(1, 2))) @ u
        ).transpose(0, 1)
        tail = (gamma[:, -1:] - gamma).exp()[:, :, None]  # [Hv, C, 1]
        state.mul_(gamma[:, -1].exp()[:, None, None]).add_((tail * kc).transpose(1, 2) @ u)
    return out


class GatedDeltaNet(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int,
        eps: float,
        fused_projections: bool = False,
    ) -> None:
        """`fused_projections`: Qwen3-Next's `in_proj_qkvz` and `in_proj_ba`, whose rows are grouped by key
        head ([q, k, v, z] of each group, then [b, a] of each), instead of Qwen3.5's four projections."""
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(
                f"linear value heads {num_v_heads} are not a multiple of key heads {num_k_heads}"
            )
        self.hk, self.hv, self.dk, self.dv = num_k_heads, num_v_heads, head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = conv_kernel
        self.fused = fused_projections
        if fused_projections:
            self.in_proj_qkvz = Linear(hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = Linear(hidden_size, 2 * num_v_heads, bias=False)
        else:
            self.in_proj_qkv = Linear(hidden_size, self.conv_dim, bias=False)
            self.in_proj_z = Linear(hidden_size, self.value_dim, bias=False)
            self.in_proj_b = Linear(hidden_size, num_v_heads, bias=False)
            self.in_proj_a = Linear(hidden_size, num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self.norm = GatedRMSNorm(head_v_dim, eps)
        self.out_proj = Linear(self.value_dim, hidden_size, bias=False)
        self.layer = -1  # the model layer it is (its state's key in the KV pool): set by the layer
        self.in_weight: torch.Tensor | None = None  # prepare_decode: the four input projections as one

    def prepare_decode(self) -> None:
        """Qwen3.5's four input projections as one matrix (once): the decode's one GEMV. Qwen3-Next's two
        fused ones keep their grouped rows (`project` reorders them)."""
        if not self.fused and self.in_weight is None:
            projections = (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
            self.in_weight, _ = fuse_linear_rows(projections)

    def decode(self, h: torch.Tensor, step: DecodeStep) -> torch.Tensor:
        """h [B, H] normed, one new position per row -> [B, H]; each real row's conv window and recurrent
        state updated in its slot of the pool's state blocks (conv [S, C, W-1], recurrent [S, Hv, Dk, Dv])."""
        ops, slots = step.ops, step.rows.slots
        conv_state, recurrent = step.pool.states[self.layer]
        rows = h.shape[0]
        if self.in_weight is not None:
            y = ops.linear(h, self.in_weight)  # [B, C + Hv·Dv + 2 Hv]
            qkv, z, b, a = torch.split(y, [self.conv_dim, self.value_dim, self.hv, self.hv], dim=-1)
        else:
            qkv, z, b, a = self.project(h)
        mixed = ops.conv_step(qkv, conv_state, self.conv1d.weight, slots)  # [B, C]
        o = ops.delta_step(mixed, b, a, self.A_log, self.dt_bias, recurrent, slots, self.hk, self.dk)
        normed = self.norm(o, z.reshape(rows, self.hv, self.dv)).reshape(rows, self.value_dim)
        return self.out_proj(normed)

    def state_shapes(self, dtype: torch.dtype) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
        """(shape, dtype) of conv [C, W-1] (activations' dtype) and recurrent [Hv, Dk, Dv] (fp32)."""
        return ((self.conv_dim, self.kernel - 1), dtype), ((self.hv, self.dk, self.dv), torch.float32)

    def new_state(self, device: torch.device, dtype: torch.dtype) -> LinearState:
        conv, recurrent = (
            torch.zeros(shape, dtype=d, device=device) for shape, d in self.state_shapes(dtype)
        )
        return LinearState(conv, recurrent)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> qkv [T, 2·Hk·Dk + Hv·Dv] (all q heads, all k, all v), z [T, Hv·Dv], b, a [T, Hv]."""
        if not self.fused:
            return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)
        t, r = x.shape[0], self.hv // self.hk  # r value heads per key head
        qkvz = self.in_proj_qkvz(x).view(t, self.hk, 2 * self.dk + 2 * r * self.dv)
        q, k, v, z = torch.split(qkvz, [self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        b, a = torch.split(self.in_proj_ba(x).view(t, self.hk, 2 * r), [r, r], dim=-1)
        qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return qkv, z.reshape(t, -1), b.reshape(t, self.hv), a.reshape(t, self.hv)

    def forward(
        self, x: torch.Tensor, state: LinearState, captures: tuple[int, ...] = ()
    ) -> tuple[torch.Tensor, list[LinearState]]:
        """x [T, H] continuing the sequence whose state is `state` (updated in place) -> ([T, H], the
        states after the first c positions for each c of `captures`, ascending, each in (0, T))."""
        t = x.shape[0]
        qkv, z, b, a = self.project(x)
        mixed = qkv.transpose(0, 1)  # [C, T]
        window = torch.cat([state.conv, mixed], dim=1)  # [C, W-1+T]: the convolution sees the past inputs
        # the conv state after c positions is the W-1 inputs before position c: window[:, c : c + W-1]
        convs = [window[:, c : c + self.kernel - 1].clone() for c in captures]
        state.conv.copy_(window[:, -(self.kernel - 1) :])
        weight = self.conv1d.weight  # [C, 1, W]
        conv = F.silu(F.conv1d(window[None].to(weight.dtype), weight, groups=self.conv_dim)[0])  # [C, T]
        q, k, v, g, beta = delta_inputs(
            conv.transpose(0, 1), b, a, self.A_log, self.dt_bias, self.hk, self.dk
        )
        if use_fla(x):
            rule = partial(fla_delta_rule, dtype=x.dtype)
        else:
            rule = delta_rule if t == 1 else chunked_delta_rule
        # the recurrence runs in segments ending at the captures, its state copied at each
        pieces, snapshots = [], []
        for a, b in zip((0, *captures), (*captures, t), strict=True):
            pieces.append(rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], state.recurrent))
            if b < t:
                snapshots.append(LinearState(convs[len(snapshots)], state.recurrent.clone()))
        out = (pieces[0] if len(pieces) == 1 else torch.cat(pieces)).to(x.dtype)  # [T, Hv, Dv]
        z = z.reshape(t, self.hv, self.dv)
        return self.out_proj(self.norm(out, z).reshape(t, self.value_dim)), snapshots
