"""Grouped MoE for many tokens on the GPU: the (token, choice) pairs sorted by expert into blocks, two
Triton launches with tensor-core dots (moe_prefill_triton.py), the sum over each token's choices in torch.
No host sync: the sort and the block table are device tensors of a size known from the shapes alone.

Reference: `experts.grouped_experts` (one expert at a time, routing read back) and `experts.stored_experts`
for banks of codec blocks (the experts dequantised first). On CUDA tensors the compiled kernels run; with
TRITON_INTERPRET=1 Triton's interpreter runs the same bodies on CPU tensors (CI).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from freetoken.runtime.moe.expert_fn import SILU, ExpertFn, PairBias
from freetoken.runtime.moe.kernels.codec_table import (
    BLOCK128_CODECS,
    LEGACY_CODECS,
    SUPERBLOCK_CODECS,
    codec_table,
)
from freetoken.runtime.moe.kernels.moe_decode import check_banks


@dataclass(frozen=True)
class PrefillBlocks:
    """Tile sizes: pairs per block (BLOCK_M; 0: from the pairs per expert), output columns and the
    reduction chunk per program (a codec's own for banks of blocks: CODEC_BLOCK_K)."""

    block_m: int = 0
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2


DEFAULT_BLOCKS = PrefillBlocks()
# banks of codec blocks: a K-quant tile is one super-block of a row (256 weights, dequantised in registers
# beside the dot), so fewer columns a program; Q8_0 / MXFP4 take whole 32-weight blocks
CODEC_BLOCKS = PrefillBlocks(block_n=32, num_stages=1)
CODEC_BLOCK_K = {1: 64, 3: 256, 4: 256, 12: 64} | dict.fromkeys(SUPERBLOCK_CODECS.values(), 256)
CODEC_BLOCK_K |= dict.fromkeys(LEGACY_CODECS.values(), 64) | dict.fromkeys(BLOCK128_CODECS.values(), 128)


def block_rows(pairs: int, experts: int) -> int:
    """Pairs per block: about the pairs an expert gets (16 at least, the tensor cores' smallest M; 64 at
    most), so a short prompt's blocks are not mostly padding."""
    per_expert = pairs / max(experts, 1)
    return 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64


class PairBlocks(NamedTuple):
    """The pairs grouped by expert: `sorted_pairs` [M] int32 (padding = P), `block_expert` [M // BLOCK_M]
    int32 (E for blocks past the last expert's), P pairs in all."""

    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor
    pairs: int


def sort_pairs(topk_ids: torch.Tensor, experts: int, block_m: int) -> PairBlocks:
    """topk_ids [T, K] (-1: no pair) -> each expert's pairs in ascending pair order, padded to whole blocks.
    M = P + E·(BLOCK_M − 1) rounded up to a block is the most any routing needs, so nothing is read back."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    p = flat.numel()
    key = torch.where(flat >= 0, flat, experts)  # no pair: an expert past the last, never placed
    order = torch.argsort(key, stable=True)  # [P]
    counts = torch.bincount(key, minlength=experts + 1)[:experts]  # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded  # [E]
    first = torch.cumsum(counts, 0) - counts  # [E]: rank 0's place in `order`
    sorted_key = key[order]
    live = sorted_key < experts
    e = sorted_key.clamp(max=experts - 1)
    place = starts[e] + torch.arange(p, device=flat.device) - first[e]
    m = -(-(p + experts * (block_m - 1)) // block_m) * block_m
    sorted_pairs = torch.full((m + 1,), p, dtype=torch.int32, device=flat.device)
    sorted_pairs.scatter_(0, torch.where(live, place, m), order.to(torch.int32))  # dead pairs land in [m]
    block_start = torch.arange(0, m, block_m, device=flat.device)
    ends = torch.cumsum(padded, 0)
    block_expert = torch.searchsorted(ends, block_start, right=True).to(torch.int32)  # E past the last
    return PairBlocks(sorted_pairs[:m], block_expert, p)


@functools.cache
def _kernels() -> tuple[Any, Any, bool]:
    from triton.runtime.interpreter import InterpretedFunction

    from freetoken.runtime.moe.kernels import moe_prefill_triton as body

    return body.gate_up_act_kernel, body.down_kernel, isinstance(body.down_kernel, InterpretedFunction)


def grouped_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up_bank: torch.Tensor,
    down_bank: torch.Tensor,
    fn: ExpertFn = SILU,
    bias: PairBias | None = None,
    codecs: tuple[str, str] | None = None,
    blocks: PrefillBlocks | None = None,
) -> torch.Tensor:
    """The same sum as `grouped_experts` (or `stored_experts` with `codecs`): x [T, H], topk_ids [T, K]
    (-1: skip) and topk_weights [T, K] on x's device, banks [S, 2I, H] / [S, H, I] (uint8 rows of codec
    blocks with `codecs`) -> [T, H] in x's dtype."""
    t, h = x.shape
    k = topk_ids.shape[1]
    gate_up_act, down, interpreted = _kernels()
    i, gu_code, dn_code = check_banks(x, gate_up_bank, down_bank, codecs, interpreted)
    b = blocks or (DEFAULT_BLOCKS if codecs is None else CODEC_BLOCKS)
    slots = gate_up_bank.shape[0]
    block_m = b.block_m or block_rows(topk_ids.numel(), slots)
    pb = sort_pairs(topk_ids, slots, block_m)
    x = x.contiguous()
    fp32 = x.dtype == torch.float32
    act = torch.empty(pb.pairs, i, dtype=x.dtype, device=x.device)
    if bias is None:
        bias_bank, bias_ids = act, pb.sorted_pairs  # never read
    else:
        bias_bank = bias.gate_up.float().contiguous()
        bias_ids = bias.ids.reshape(-1).contiguous()
    n_blocks = pb.block_expert.numel()
    table = codec_table(x.device)
    gate_up_act[(n_blocks, -(-i // b.block_n))](
        x, pb.sorted_pairs, pb.block_expert, gate_up_bank, act, bias_bank, bias_ids, table,
        gate_up_bank.stride(0), gate_up_bank.stride(1), fn.alpha, fn.limit, pb.pairs, slots,
        H=h, INTER=i, K=k, BLOCK_M=block_m, BLOCK_N=b.block_n, BLOCK_K=CODEC_BLOCK_K.get(gu_code, b.block_k),
        ACT=fn.code, HAS_BIAS=bias is not None, CODEC=gu_code, FP32=fp32,
        num_warps=b.num_warps, num_stages=b.num_stages,
    )  # fmt: skip
    part = torch.zeros(pb.pairs, h, dtype=x.dtype, device=x.device)  # pairs with no expert stay zero
    down[(n_blocks, -(-h // b.block_n))](
        act, pb.sorted_pairs, pb.block_expert, topk_weights.reshape(-1).contiguous(), down_bank, part, table,
        down_bank.stride(0), down_bank.stride(1), pb.pairs, slots,
        H=h, INTER=i, BLOCK_M=block_m, BLOCK_N=b.block_n, BLOCK_K=CODEC_BLOCK_K.get(dn_code, b.block_k),
        CODEC=dn_code, FP32=fp32, num_warps=b.num_warps, num_stages=b.num_stages,
    )  # fmt: skip
    return part.view(t, k, h).sum(dim=1, dtype=torch.float32).to(x.dtype)
