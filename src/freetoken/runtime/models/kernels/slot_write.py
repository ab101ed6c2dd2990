"""Write one new cache row per decode row at its (slot, position), with no host sync (graph-capturable):
latent attention's [c ; k_pe] rows, which need no rotary in the write (they are roped before it).

`slot_write(rows [B, W], cache [S, H, CAP, W'], slots, positions)`: cache[slots[b], 0, positions[b], :W]
= rows[b] for each row with slots[b] >= 0 and positions[b] in [0, CAP) (a padding row writes nothing);
one Triton launch on CUDA, `slot_write_reference` (plain torch, it syncs) elsewhere. Same dtype.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from freetoken.runtime.triton_support import kernel_runs_on, next_pow2


@functools.cache
def _body() -> tuple[ModuleType, bool]:
    from triton.runtime.interpreter import InterpretedFunction

    from freetoken.runtime.models.kernels import slot_write_triton as body

    return body, isinstance(body.slot_write_kernel, InterpretedFunction)


def slot_write_available(device: torch.device | str) -> bool:
    return kernel_runs_on(_body, device)


def _check(rows: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> None:
    b, w = rows.shape
    if cache.dim() != 4 or cache.shape[-1] < w or cache.stride(-1) != 1 or rows.stride(-1) != 1:
        raise ValueError(f"rows {tuple(rows.shape)} do not fit the cache {tuple(cache.shape)}")
    if rows.dtype != cache.dtype:
        raise ValueError(f"rows ({rows.dtype}) and the cache ({cache.dtype}) need one dtype")
    if any(t.dtype != torch.int32 or t.shape != (b,) for t in (slots, positions)):
        raise ValueError("slots and positions must be int32 vectors of one entry per row")


def slot_write(rows: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> None:
    _check(rows, cache, slots, positions)
    b, w = rows.shape
    if b == 0:
        return
    body, _ = _body()
    body.slot_write_kernel[(b,)](
        rows, cache, slots, positions, rows.stride(0), cache.stride(0), cache.stride(2), cache.shape[2],
        W=w, BLOCK=next_pow2(w), num_warps=4,
    )  # fmt: skip


def slot_write_reference(
    rows: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor
) -> None:
    _check(rows, cache, slots, positions)
    live = (slots >= 0) & (positions >= 0) & (positions < cache.shape[2])
    at_slot, at_pos = slots[live].long(), positions[live].long()
    cache[at_slot, 0, at_pos, : rows.shape[1]] = rows[live]
