"""Plain-torch expert math: the reference every expert kernel is tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu_expert(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One SwiGLU expert. x [T, H], gate_up [2I, H], down [H, I] -> [T, H]."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)  # [T, I] each
    return F.linear(F.silu(gate) * up, down)


def group_by_expert(topk_ids: torch.Tensor) -> tuple[list[int], list[torch.Tensor], list[torch.Tensor]]:
    """Deduplicate experts across tokens.

    topk_ids [T, K] -> (experts, token_rows, slot_cols): for each distinct expert e (ascending), the rows
    t and columns k with topk_ids[t, k] == e.
    """
    flat = topk_ids.flatten()
    order = torch.argsort(flat, stable=True)
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    k = topk_ids.shape[1]
    rows, cols = [], []
    for chunk in torch.split(order, counts.tolist()):
        rows.append(chunk // k)
        cols.append(chunk % k)
    return experts.tolist(), rows, cols


def grouped_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up_bank: torch.Tensor,
    down_bank: torch.Tensor,
) -> torch.Tensor:
    """Weighted sum of each token's routed experts.

    x [T, H], topk_ids [T, K], topk_weights [T, K], gate_up_bank [E, 2I, H], down_bank [E, H, I] -> [T, H].
    Banks and x must be on one device; every expert runs once for all tokens that chose it.
    """
    out = torch.zeros_like(x)
    experts, rows, cols = group_by_expert(topk_ids)
    for expert, row, col in zip(experts, rows, cols, strict=True):
        y = swiglu_expert(x[row], gate_up_bank[expert], down_bank[expert])  # [t, H]
        out.index_add_(0, row, (y * topk_weights[row, col, None]).to(out.dtype))
    return out


def gathered_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up_bank: torch.Tensor,
    down_bank: torch.Tensor,
) -> torch.Tensor:
    """The same sum as `grouped_experts`, without reading routing back to the host.

    Every (token, choice) pair gathers its expert's weights, so nothing waits on the device: the path for
    a few tokens on an accelerator, where one host sync costs more than the gathers.
    x [T, H], topk_ids/topk_weights [T, K] -> [T, H].
    """
    t, k = topk_ids.shape
    flat = topk_ids.flatten()  # [T*K]
    xr = x.repeat_interleave(k, dim=0)[:, :, None]  # [T*K, H, 1]
    gate, up = torch.bmm(gate_up_bank[flat], xr)[:, :, 0].chunk(2, dim=-1)  # [T*K, I] each
    y = torch.bmm(down_bank[flat], (F.silu(gate) * up)[:, :, None])[:, :, 0]  # [T*K, H]
    y = y * topk_weights.flatten()[:, None]
    return y.view(t, k, -1).sum(dim=1).to(x.dtype)
