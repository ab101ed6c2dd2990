"""Fused MoE decode for a few tokens: two Triton GEMV launches that read each (token, choice)'s expert
in place from the bank by id, with no host sync and no weight copies (graph-capturable).

Reference: `experts.grouped_experts` (same inputs, same sum). On CUDA tensors the compiled kernels
run; with TRITON_INTERPRET=1 set before Triton is imported (the test suite does so on machines without
CUDA), Triton's interpreter runs the same kernel bodies on CPU tensors, so CI checks them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from freetoken.codecs import get_codec
from freetoken.env import moe_decode_blocks
from freetoken.runtime.moe.expert_fn import SILU, ExpertFn, PairBias

# codecs the kernels read as stored, by the numbers quant_tile_triton.py (and the CPU kernel) use
QUANT_CODECS = {"Q8_0": 1, "Q4_K": 3, "MXFP4": 12}
MAX_DECODE_TOKENS = 16  # beyond this a grouped (per-expert) kernel reads each expert once, not per pair


@dataclass(frozen=True)
class DecodeBlocks:
    """Tile sizes: rows per program and the reduction chunk, per kernel."""

    gate_up_n: int = 4  # the fastest of benchmarks/moe_decode_kernel.py --sweep on an H200 at batch 1
    gate_up_k: int = 256
    down_n: int = 8
    down_k: int = 256
    num_warps: int = 4
    num_stages: int = 1


def _default_blocks() -> DecodeBlocks:
    tiles = moe_decode_blocks()
    return DecodeBlocks() if tiles is None else DecodeBlocks(*tiles)


DEFAULT_BLOCKS = _default_blocks()


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernels() -> tuple[Any, Any, bool]:
    """(gate_up_act, down, interpreted)."""
    from triton.runtime.interpreter import InterpretedFunction

    from freetoken.runtime.moe.kernels import moe_decode_triton as body

    interpreted = isinstance(body.gate_up_act_kernel, InterpretedFunction)
    return body.gate_up_act_kernel, body.down_sum_kernel, interpreted


def fused_moe_decode(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up_bank: torch.Tensor,
    down_bank: torch.Tensor,
    blocks: DecodeBlocks = DEFAULT_BLOCKS,
    fn: ExpertFn = SILU,
    bias: PairBias | None = None,
    codecs: tuple[str, str] | None = None,
) -> torch.Tensor:
    """x [T, H], topk_ids [T, K] (-1: skip) and topk_weights [T, K] on x's device, gate_up_bank [S, 2I, H]
    and down_bank [S, H, I] (rows contiguous) -> [T, H] in x's dtype. `fn`: the experts' function; `bias`:
    each pair's gate/up bias (its tensors on x's device); `codecs`: banks of codec blocks as stored, uint8
    [S, 2I, row bytes] / [S, H, row bytes] (QUANT_CODECS)."""
    t, h = x.shape
    k = topk_ids.shape[1]
    gu_code, dn_code = (0, 0) if codecs is None else (QUANT_CODECS[codecs[0]], QUANT_CODECS[codecs[1]])
    i = down_bank.shape[2] if codecs is None else gate_up_bank.shape[1] // 2
    if gate_up_bank.stride(2) != 1 or down_bank.stride(2) != 1:
        raise ValueError("expert banks need contiguous rows")
    widths = (
        (h, i) if codecs is None else (get_codec(codecs[0]).row_bytes(h), get_codec(codecs[1]).row_bytes(i))
    )
    if gate_up_bank.shape[1:] != (2 * i, widths[0]) or down_bank.shape[1:] != (h, widths[1]):
        shapes = f"{tuple(gate_up_bank.shape)} / {tuple(down_bank.shape)}"
        raise ValueError(f"bank shapes {shapes} do not fit x of width {h}")
    gate_up_act, down, interpreted = _kernels()
    if x.device.type == "cpu" and not interpreted:
        raise ValueError("the Triton MoE kernels take CUDA tensors (CPU ones only under TRITON_INTERPRET=1)")
    pairs = t * k
    ids = topk_ids.reshape(pairs).contiguous()
    weights = topk_weights.reshape(pairs).contiguous()
    x = x.contiguous()
    act = torch.empty(pairs, i, dtype=torch.float32, device=x.device)
    out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    b = blocks
    if bias is None:
        bias_bank, bias_ids = act, ids  # never read
    else:
        bias_bank = bias.gate_up.float().contiguous()
        bias_ids = bias.ids.reshape(pairs).contiguous()
    gate_up_act[(pairs, -(-i // b.gate_up_n))](
        x, ids, gate_up_bank, act, bias_bank, bias_ids, gate_up_bank.stride(0), gate_up_bank.stride(1),
        fn.alpha, fn.limit, H=h, INTER=i, K=k, BLOCK_N=b.gate_up_n, BLOCK_K=b.gate_up_k, ACT=fn.code,
        HAS_BIAS=bias is not None, CODEC=gu_code, num_warps=b.num_warps, num_stages=b.num_stages,
    )  # fmt: skip
    down[(t, -(-h // b.down_n))](
        act, ids, weights, down_bank, out, down_bank.stride(0), down_bank.stride(1),
        H=h, INTER=i, K=k, BLOCK_N=b.down_n, BLOCK_K=b.down_k, CODEC=dn_code,
        num_warps=b.num_warps, num_stages=b.num_stages,
    )  # fmt: skip
    return out
