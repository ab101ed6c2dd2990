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

from freetoken.runtime.models.delta_net import decayed_delta_rule, delta_inputs
from freetoken.runtime.models.kda import kda_inputs
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
    return _launch(mixed, b, a, a_log, dt_bias, state, slots, hk, dk, a.stride(0), channel_decay=False)


def _launch(
    mixed: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    hk: int,
    dk: int,
    stride_a: int,
    channel_decay: bool,
) -> torch.Tensor:
    """The rule's kernel over rows x value heads x value blocks -> o [B, Hv, Dv] in mixed's dtype (`a`:
    the decay's logits per head, or with `channel_decay` the log decay [B, Hv, Dk] itself)."""
    check_device(mixed)
    rows, hv = b.shape
    dv = state.shape[-1]
    out = torch.empty(rows, hv, dv, dtype=mixed.dtype, device=mixed.device)
    if rows == 0:
        return out
    block_v = min(VALUE_BLOCK, next_pow2(dv))
    body, _ = _body()
    body.delta_rule_step_kernel[(rows, hv, _cdiv(dv, block_v))](
        mixed, b, a, a_log, dt_bias, state, slots, out, mixed.stride(0), b.stride(0), stride_a, dk**-0.5,
        HK=hk, HV=hv, DK=dk, DV=dv, BLOCK_K=next_pow2(dk), BLOCK_V=block_v, CHANNEL_DECAY=channel_decay,
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
    heads, dim = b.shape[1], state.shape[-1]
    return _launch(mixed, b, decay, decay, decay, state, slots, heads, dim, 0, channel_decay=True)


def kda_rule_step_reference(
    mixed: torch.Tensor, b: torch.Tensor, decay: torch.Tensor, state: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """KimiDeltaAttention.forward's recurrence for one new position, row by row."""
    _check_kda(mixed, b, decay, state)
    q, k, v, beta = kda_inputs(mixed, b, b.shape[1])
    return _rows_through(q, k, v, decay.exp(), beta, state, slots, mixed.dtype)


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
    return _rows_through(q, k, v, g.exp()[..., None], beta, state, slots, mixed.dtype)


def _rows_through(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Each live row's one step of the recurrence on its slot of `state` -> o [B, H, Dv] in `dtype` (a
    padding row's zeros)."""
    out = torch.zeros(v.shape, dtype=dtype, device=v.device)
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            one = slice(row, row + 1)
            out[row] = decayed_delta_rule(q[one], k[one], v[one], decay[one], beta[one], state[slot])[0].to(
                dtype
            )
    return out


def _cdiv(n: int, block: int) -> int:
    return -(-n // block)
