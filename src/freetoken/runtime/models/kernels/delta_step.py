"""A gated DeltaNet layer's decode step over the static state slots, with no host sync (graph-capturable):

- `causal_conv_step`: the depthwise causal convolution of each row's new input against the last W − 1
  inputs its slot keeps, then silu; the slot's window shifted by one;
- `delta_rule_step`: the gates and the delta rule's one step on each row's slot of the recurrent state
  (delta_net.py gives the math), out [B, Hv, Dv] in the activations' dtype;
- `kda_rule_step`: the same for Kimi Delta Attention (kda.py), whose decay is given per key channel.

Each is one Triton launch on CUDA (delta_step_triton.py); elsewhere its reference beside it runs — the
eager layer's own math row by row (it reads the slots on the host). Padding rows (slot < 0) read and
write no state; their outputs are garbage and ignored.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
import torch.nn.functional as F

from freetoken.runtime.models.delta_net import delta_inputs, delta_rule
from freetoken.runtime.models.kda import kda_inputs, kda_rule
from freetoken.runtime.models.kernels.decode_attention import check_device
from freetoken.runtime.triton_support import kernel_runs_on, next_pow2

CONV_BLOCK = 128  # channels a program
VALUE_BLOCK = 32  # value dims a program: a [Dk, 32] fp32 tile of the state


@functools.cache
def _body() -> tuple[ModuleType, bool]:
    from triton.runtime.interpreter import InterpretedFunction

    from freetoken.runtime.models.kernels import delta_step_triton as body

    return body, isinstance(body.delta_rule_step_kernel, InterpretedFunction)


def delta_step_available(device: torch.device | str) -> bool:
    return kernel_runs_on(_body, device)


def _check_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, slots: torch.Tensor) -> None:
    b, c = x.shape
    if state.dim() != 3 or state.shape[1] != c or not state.is_contiguous() or x.stride(-1) != 1:
        raise ValueError(f"conv state {tuple(state.shape)} does not fit inputs {tuple(x.shape)}")
    if weight.shape != (c, 1, state.shape[2] + 1) or state.dtype != x.dtype:
        raise ValueError(f"conv weight {tuple(weight.shape)} / state {state.dtype} do not fit x {x.dtype}")
    if slots.dtype != torch.int32 or slots.shape != (b,):
        raise ValueError("slots must be an int32 vector of one entry per row")


def causal_conv_step(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """x [B, C] (columns contiguous), state [S, C, W-1] (x's dtype, contiguous; each live row's slot
    updated in place), weight [C, 1, W] (the Conv1d's), slots [B] int32 -> silu(conv) [B, C] in x's dtype."""
    _check_conv(x, state, weight, slots)
    check_device(x)
    b, c = x.shape
    out = torch.empty(b, c, dtype=x.dtype, device=x.device)
    if b == 0:
        return out
    w = state.shape[2] + 1
    body, _ = _body()
    body.causal_conv_step_kernel[(b, _cdiv(c, CONV_BLOCK))](
        x, state, weight.contiguous(), slots, out, x.stride(0),
        C=c, W=w, BLOCK_C=CONV_BLOCK, BLOCK_W=next_pow2(w), num_warps=4,
    )  # fmt: skip
    return out


def causal_conv_step_reference(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """GatedDeltaNet.forward's convolution for one new position, row by row."""
    _check_conv(x, state, weight, slots)
    out = torch.zeros_like(x)
    for row, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        window = torch.cat([state[slot], x[row, :, None]], dim=1)  # [C, W]
        conv = F.conv1d(window[None].to(weight.dtype), weight, groups=x.shape[1])[0, :, 0]
        out[row] = F.silu(conv)
        state[slot].copy_(window[:, 1:])
    return out


def _check_delta(
    mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, state: torch.Tensor, hk: int, dk: int
) -> None:
    rows, hv = b.shape
    dv = state.shape[-1] if state.dim() == 4 else 0
    if state.dim() != 4 or state.shape[1:3] != (hv, dk) or state.dtype != torch.float32:
        raise ValueError(f"state {tuple(state.shape)} {state.dtype} is not [S, {hv}, {dk}, Dv] fp32")
    if not state.is_contiguous() or hv % hk:
        raise ValueError(f"state must be contiguous and {hv} value heads a multiple of {hk} key heads")
    if mixed.shape != (rows, 2 * hk * dk + hv * dv) or a.shape != b.shape or mixed.stride(-1) != 1:
        raise ValueError(f"mixed {tuple(mixed.shape)} / a {tuple(a.shape)} do not fit the state")


def delta_rule_step(
    mixed: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    hk: int,
    dk: int,
) -> torch.Tensor:
    """mixed [B, 2·Hk·Dk + Hv·Dv] (the convolved q, k, v), b, a [B, Hv] (row strides free), a_log, dt_bias
    [Hv], state [S, Hv, Dk, Dv] fp32 (each live row's slot updated in place), slots [B] int32 ->
    o [B, Hv, Dv] in mixed's dtype."""
    _check_delta(mixed, b, a, state, hk, dk)
    check_device(mixed)
    rows, hv = b.shape
    dv = state.shape[-1]
    out = torch.empty(rows, hv, dv, dtype=mixed.dtype, device=mixed.device)
    if rows == 0:
        return out
    block_v = min(VALUE_BLOCK, next_pow2(dv))
    body, _ = _body()
    body.delta_rule_step_kernel[(rows, hv, _cdiv(dv, block_v))](
        mixed, b, a, a_log, dt_bias, state, slots, out, mixed.stride(0), b.stride(0), a.stride(0), dk**-0.5,
        HK=hk, HV=hv, DK=dk, DV=dv, BLOCK_K=next_pow2(dk), BLOCK_V=block_v, CHANNEL_DECAY=False,
        num_warps=4,
    )  # fmt: skip
    return out


def _check_kda(mixed: torch.Tensor, b: torch.Tensor, decay: torch.Tensor, state: torch.Tensor) -> None:
    rows, heads = b.shape
    dim = state.shape[-1] if state.dim() == 4 else 0
    if state.dim() != 4 or state.shape[1:] != (heads, dim, dim) or state.dtype != torch.float32:
        raise ValueError(f"state {tuple(state.shape)} {state.dtype} is not [S, {heads}, D, D] fp32")
    if not state.is_contiguous() or mixed.shape != (rows, 3 * heads * dim) or mixed.stride(-1) != 1:
        raise ValueError(f"mixed {tuple(mixed.shape)} does not fit the state {tuple(state.shape)}")
    if decay.shape != (rows, heads, dim) or decay.dtype != torch.float32 or not decay.is_contiguous():
        raise ValueError(f"the log decay must be [{rows}, {heads}, {dim}] fp32, not {tuple(decay.shape)}")


def kda_rule_step(
    mixed: torch.Tensor, b: torch.Tensor, decay: torch.Tensor, state: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """Kimi Delta Attention's step: mixed [B, 3·H·D] (the convolved q, k, v), b [B, H] (β's logits, row
    stride free), decay [B, H, D] fp32 (the log decay per key channel), state [S, H, D, D] fp32 (each live
    row's slot updated in place), slots [B] int32 -> o [B, H, D] in mixed's dtype."""
    _check_kda(mixed, b, decay, state)
    check_device(mixed)
    rows, heads = b.shape
    dim = state.shape[-1]
    out = torch.empty(rows, heads, dim, dtype=mixed.dtype, device=mixed.device)
    if rows == 0:
        return out
    block_v = min(VALUE_BLOCK, next_pow2(dim))
    body, _ = _body()
    body.delta_rule_step_kernel[(rows, heads, _cdiv(dim, block_v))](
        mixed, b, decay, decay, decay, state, slots, out, mixed.stride(0), b.stride(0), 0, dim**-0.5,
        HK=heads, HV=heads, DK=dim, DV=dim, BLOCK_K=next_pow2(dim), BLOCK_V=block_v, CHANNEL_DECAY=True,
        num_warps=4,
    )  # fmt: skip
    return out


def kda_rule_step_reference(
    mixed: torch.Tensor, b: torch.Tensor, decay: torch.Tensor, state: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """KimiDeltaAttention.forward's recurrence for one new position, row by row."""
    _check_kda(mixed, b, decay, state)
    rows, heads = b.shape
    q, k, v, beta = kda_inputs(mixed, b, heads)
    out = torch.zeros(rows, heads, state.shape[-1], dtype=mixed.dtype, device=mixed.device)
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            one = slice(row, row + 1)
            out[row] = kda_rule(q[one], k[one], v[one], decay[one].exp(), beta[one], state[slot])[0].to(
                mixed.dtype
            )
    return out


def delta_rule_step_reference(
    mixed: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    hk: int,
    dk: int,
) -> torch.Tensor:
    """GatedDeltaNet.forward's gates and recurrence for one new position, row by row."""
    _check_delta(mixed, b, a, state, hk, dk)
    q, k, v, g, beta = delta_inputs(mixed, b, a, a_log, dt_bias, hk, dk)
    out = torch.zeros(v.shape, dtype=mixed.dtype, device=mixed.device)  # [B, Hv, Dv]
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            one = slice(row, row + 1)
            out[row] = delta_rule(q[one], k[one], v[one], g[one], beta[one], state[slot])[0].to(mixed.dtype)
    return out


def _cdiv(n: int, block: int) -> int:
    return -(-n // block)
