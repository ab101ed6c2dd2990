"""A gated DeltaNet or Kimi Delta Attention layer's decode step on the CPU as two native calls
(moe/kernels/delta_step_cpu.c): the causal convolution's step and the gates with the delta rule's step
(Kimi's: its decay per key channel), each on every row's slot of the state blocks — where their
references (delta_step.py: the eager layer's own math, row by row through torch) make a Python loop
over the rows and some twenty torch ops a row. Each agrees with its reference to
summation order in fp32 and within bf16 rounding on a bf16 model; where the library is missing or an
input does not fit, the reference runs."""

from __future__ import annotations

import torch

from freetoken.runtime.models.kernels.delta_step import (
    causal_conv_step_reference,
    delta_rule_step_reference,
    kda_rule_step_reference,
)
from freetoken.runtime.moe.kernels.loader import load_library, pointer

ELEMENTS = (torch.bfloat16, torch.float32)
MAX_DK = 512  # delta_step_cpu.c holds a head's q, k and a value row's sums on its stack


def cpu_conv_step(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """causal_conv_step_reference's contract, in one native call where it applies."""
    lib = load_library()
    plain = x.dtype in ELEMENTS and weight.dtype in ELEMENTS and x.stride(-1) == 1 and state.is_contiguous()
    if lib is None or x.device.type != "cpu" or not plain or state.dtype != x.dtype:
        return causal_conv_step_reference(x, state, weight, slots)
    b, c = x.shape
    w = weight.contiguous()
    if w.shape != (c, 1, state.shape[2] + 1) or slots.dtype != torch.int32 or slots.shape != (b,):
        return causal_conv_step_reference(x, state, weight, slots)  # it names what does not fit
    out = torch.zeros_like(x, memory_format=torch.contiguous_format)
    slots = slots.contiguous()
    code = lib.ft_conv_step(
        x.data_ptr(), x.stride(0), x.element_size(), state.data_ptr(), w.data_ptr(), w.element_size(), c,
        w.shape[-1], slots.data_ptr(), b, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if code != 0:
        raise ValueError(f"native conv step refused its inputs (code {code})")
    return out


def cpu_delta_step(
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
    """delta_rule_step_reference's contract, in one native call where it applies."""
    if not _rule_takes(mixed, b, a, state, slots, hk, dk):
        return delta_rule_step_reference(mixed, b, a, a_log, dt_bias, state, slots, hk, dk)
    a_log32, dt32 = (t.detach().float().contiguous() for t in (a_log, dt_bias))
    return _rule(mixed, b, a, a_log32, dt32, None, state, slots, hk, dk)


def cpu_kda_step(
    mixed: torch.Tensor, b: torch.Tensor, decay: torch.Tensor, state: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """kda_rule_step_reference's contract, in one native call where it applies."""
    heads, dim = b.shape[1], state.shape[-1]
    fits = decay.dtype == torch.float32 and decay.is_contiguous() and decay.shape == (b.shape[0], heads, dim)
    if not fits or not _rule_takes(mixed, b, b, state, slots, heads, dim):
        return kda_rule_step_reference(mixed, b, decay, state, slots)
    return _rule(mixed, b, b, None, None, decay, state, slots, heads, dim)


def _rule_takes(
    mixed: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    hk: int,
    dk: int,
) -> bool:
    rows, hv = b.shape
    return (
        load_library() is not None
        and mixed.device.type == "cpu"
        and mixed.dtype in ELEMENTS
        and b.dtype == a.dtype
        and b.dtype in ELEMENTS
        and mixed.stride(-1) == b.stride(-1) == a.stride(-1) == 1
        and state.dtype == torch.float32
        and state.is_contiguous()
        and state.dim() == 4
        and state.shape[1:3] == (hv, dk)
        and dk <= MAX_DK
        and state.shape[-1] <= MAX_DK
        and hv % hk == 0
        and mixed.shape == (rows, 2 * hk * dk + hv * state.shape[-1])
        and slots.dtype == torch.int32
        and slots.shape == (rows,)
    )


def _rule(
    mixed: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    a_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    log_decay: torch.Tensor | None,
    state: torch.Tensor,
    slots: torch.Tensor,
    hk: int,
    dk: int,
) -> torch.Tensor:
    """The native rule's call (inputs checked by _rule_takes) -> o [B, Hv, Dv] in mixed's dtype."""
    lib = load_library()
    assert lib is not None
    rows, hv = b.shape
    dv = state.shape[-1]
    out = torch.zeros(rows, hv, dv, dtype=mixed.dtype)
    slots = slots.contiguous()
    code = lib.ft_delta_step(
        mixed.data_ptr(), mixed.stride(0), mixed.element_size(), b.data_ptr(), b.stride(0), a.data_ptr(),
        a.stride(0), b.element_size(), pointer(a_log), pointer(dt_bias), state.data_ptr(), slots.data_ptr(),
        rows, hk, hv, dk, dv, pointer(log_decay), out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if code != 0:
        raise ValueError(f"native delta step refused its inputs (code {code})")
    return out
