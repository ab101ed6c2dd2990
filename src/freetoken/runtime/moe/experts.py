"""Plain-torch expert math: the reference every expert kernel is tested against.

Routing arrays may hold -1 for (token, choice) pairs that another branch computes: those are skipped.
Banks are indexed by whatever the ids name: expert ids into the pool, slot ids into the slot bank.
Every path takes the experts' function (`fn`, expert_fn.py) and, for families with expert biases, each
pair's gate/up bias (`bias`); the down projection's bias is the executors' (expert_fn.down_bias_sum).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from freetoken.codecs.torch_dequant import dequantize_rows
from freetoken.env import moe_decode_kernel_choice, moe_prefill_kernel_choice
from freetoken.runtime.moe.expert_fn import SILU, ExpertFn, PairBias
from freetoken.runtime.moe.kernels.moe_decode import MAX_DECODE_TOKENS, fused_moe_decode, triton_available
from freetoken.runtime.moe.kernels.moe_prefill import grouped_moe


def swiglu_expert(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    fn: ExpertFn = SILU,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """One gated expert. x [T, H], gate_up [2I, H], down [H, I], bias [T, 2I] or [2I] -> [T, H]."""
    h = F.linear(x, gate_up)  # [T, 2I]
    if bias is not None:
        h = h + bias.to(h.dtype)
    gate, up = h.chunk(2, dim=-1)  # [T, I] each
    return F.linear(fn.glu(gate, up), down)


def group_by_expert(topk_ids: torch.Tensor) -> tuple[list[int], list[torch.Tensor], list[torch.Tensor]]:
    """Deduplicate experts across tokens.

    topk_ids [T, K] -> (experts, token_rows, slot_cols): for each distinct id e >= 0 (ascending), the rows
    t and columns k with topk_ids[t, k] == e. Pairs holding -1 are left out.
    """
    flat = topk_ids.flatten()
    order = torch.argsort(flat, stable=True)
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    k = topk_ids.shape[1]
    out_experts, rows, cols = [], [], []
    for expert, chunk in zip(experts.tolist(), torch.split(order, counts.tolist()), strict=True):
        if expert < 0:
            continue
        out_experts.append(expert)
        rows.append(chunk // k)
        cols.append(chunk % k)
    return out_experts, rows, cols


def grouped_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up_bank: torch.Tensor,
    down_bank: torch.Tensor,
    fn: ExpertFn = SILU,
    bias: PairBias | None = None,
) -> torch.Tensor:
    """Weighted sum of each token's routed experts.

    x [T, H], topk_ids [T, K] (any device; -1 = skip), topk_weights [T, K] on x's device,
    gate_up_bank [E, 2I, H] and down_bank [E, H, I] on x's device -> [T, H].
    Every expert runs once for all tokens that chose it.
    """
    out = torch.zeros_like(x)
    experts, rows, cols = group_by_expert(topk_ids)
    for expert, row, col in zip(experts, rows, cols, strict=True):
        row, col = row.to(x.device), col.to(x.device)
        pair_bias = None if bias is None else bias.rows(row * topk_ids.shape[1] + col)  # [t, 2I]
        y = swiglu_expert(x[row], gate_up_bank[expert], down_bank[expert], fn, pair_bias)  # [t, H]
        out.index_add_(0, row, (y * topk_weights[row, col, None]).to(out.dtype))
    return out


def gathered_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up_bank: torch.Tensor,
    down_bank: torch.Tensor,
    fn: ExpertFn = SILU,
    bias: PairBias | None = None,
) -> torch.Tensor:
    """The same sum as `grouped_experts`, without reading routing back to the host.

    Every (token, choice) pair gathers its expert's weights, so nothing waits on the device: the path for
    a few tokens on an accelerator, where one host sync costs more than the gathers. Pairs holding -1
    contribute zero. x [T, H], topk_ids/topk_weights [T, K] on x's device -> [T, H].
    """
    t, k = topk_ids.shape
    flat = topk_ids.flatten()  # [T*K]
    weights = torch.where(flat >= 0, topk_weights.flatten(), torch.zeros_like(topk_weights.flatten()))
    flat = flat.clamp(min=0)
    xr = x.repeat_interleave(k, dim=0)[:, :, None]  # [T*K, H, 1]
    h = torch.bmm(gate_up_bank[flat], xr)[:, :, 0]  # [T*K, 2I]
    if bias is not None:
        h = h + bias.rows(torch.arange(t * k, device=h.device)).to(h.dtype)
    gate, up = h.chunk(2, dim=-1)  # [T*K, I] each
    y = torch.bmm(down_bank[flat], fn.glu(gate, up)[:, :, None])[:, :, 0]  # [T*K, H]
    y = y * weights[:, None]
    return y.view(t, k, -1).sum(dim=1).to(x.dtype)


def stored_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up_bank: torch.Tensor,
    down_bank: torch.Tensor,
    codecs: tuple[str, str],
    fn: ExpertFn = SILU,
    bias: PairBias | None = None,
    dequantize: Callable[[torch.Tensor, str, int], torch.Tensor] = dequantize_rows,
) -> torch.Tensor:
    """`grouped_experts` over banks of codec blocks (uint8 [S, 2I, row bytes] / [S, H, row bytes]): the
    experts the ids use are dequantised (`dequantize`: rows, codec name, weights per row -> float rows;
    by default in torch on the banks' device) into x's dtype, then computed as plain banks. Reads the ids
    back (a sync)."""
    h, i = x.shape[1], gate_up_bank.shape[1] // 2
    ids = topk_ids.to(gate_up_bank.device)
    used = torch.unique(ids[ids >= 0])  # [U]
    gate_up = dequantize(gate_up_bank[used], codecs[0], h).to(x.dtype)  # [U, 2I, H]
    down = dequantize(down_bank[used], codecs[1], i).to(x.dtype)  # [U, H, I]
    compact = torch.full((gate_up_bank.shape[0],), -1, dtype=torch.int64, device=ids.device)
    compact[used] = torch.arange(len(used), device=ids.device)
    local = torch.where(ids >= 0, compact[ids.clamp(min=0)], -1)
    return grouped_experts(x, local.to(topk_ids.device), topk_weights, gate_up, down, fn, bias)


# Below this many (token, expert) pairs on an accelerator, gather weights instead of grouping tokens:
# grouping reads the routing back to the host, a sync per layer.
GATHER_MAX_PAIRS = 64


def routed_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up_bank: torch.Tensor,
    down_bank: torch.Tensor,
    fn: ExpertFn = SILU,
    bias: PairBias | None = None,
    codecs: tuple[str, str] | None = None,
) -> torch.Tensor:
    """A few tokens on CUDA: the fused Triton decode kernel (weights read in place by id); more on CUDA:
    the grouped Triton kernels (pairs sorted by expert on the device, tensor-core tiles); a few pairs on
    another accelerator: the gathered path; otherwise the grouped torch one (routing read back).
    `codecs`: the banks hold those codecs' blocks as stored (the Triton kernels read them in place; the
    torch path dequantises the experts it uses)."""
    on_device = x.device.type != "cpu" and topk_ids.device == x.device
    if on_device and x.device.type == "cuda" and x.shape[0] <= MAX_DECODE_TOKENS and decode_kernel_on():
        return fused_moe_decode(
            x, topk_ids, topk_weights, gate_up_bank, down_bank, fn=fn, bias=bias, codecs=codecs,
            int8_act=int8_decode_on(),
        )  # fmt: skip
    if x.device.type == "cuda" and x.shape[0] > MAX_DECODE_TOKENS and prefill_kernel_on():
        on_x = None if bias is None else bias._replace(ids=bias.ids.to(x.device))
        return grouped_moe(x, topk_ids.to(x.device), topk_weights, gate_up_bank, down_bank, fn, on_x, codecs)
    if codecs is not None:
        return stored_experts(x, topk_ids, topk_weights, gate_up_bank, down_bank, codecs, fn, bias)
    if on_device and topk_ids.numel() <= GATHER_MAX_PAIRS:
        return gathered_experts(x, topk_ids, topk_weights, gate_up_bank, down_bank, fn, bias)
    return grouped_experts(x, topk_ids, topk_weights, gate_up_bank, down_bank, fn, bias)


@functools.cache
def decode_kernel_on() -> bool:
    return moe_decode_kernel_choice() != "torch" and triton_available()


@functools.cache
def int8_decode_on() -> bool:
    return moe_decode_kernel_choice() == "int8"


@functools.cache
def prefill_kernel_on() -> bool:
    return moe_prefill_kernel_choice() != "torch" and triton_available()
