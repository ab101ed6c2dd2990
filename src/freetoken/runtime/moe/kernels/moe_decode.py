"""Fused MoE decode for a few tokens: two Triton GEMV launches that read each (token, choice)'s expert
in place from the bank by id, with no host sync and no weight copies (graph-capturable).

Reference: `experts.grouped_experts` (same inputs, same sum). On CUDA tensors the compiled kernels
run; with TRITON_INTERPRET=1 set before Triton is imported (the test suite does so on machines without
CUDA), Triton's interpreter runs the same kernel bodies on CPU tensors, so CI checks them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any

import torch

from freetoken.codecs import get_codec
from freetoken.env import moe_decode_blocks
from freetoken.runtime.moe.expert_fn import SILU, ExpertFn, PairBias
from freetoken.runtime.moe.kernels.codec_table import (
    BLOCK128_CODECS,
    LEGACY_CODECS,
    SUPERBLOCK_CODECS,
    codec_table,
)
from freetoken.runtime.moe.kernels.moe_decode_int8 import (
    down_int8,
    gate_up_int8,
    gate_up_splits,
    int8_side,
    pdl_launch,
    quantized_buffers,
)
from freetoken.runtime.triton_support import next_pow2

# codecs the kernels read as stored, by the numbers quant_dot_triton.py (and the CPU kernel) use
QUANT_CODECS = {"Q8_0": 1, "Q4_K": 3, "Q6_K": 4, "MXFP4": 12, **SUPERBLOCK_CODECS, **LEGACY_CODECS}
QUANT_CODECS |= BLOCK128_CODECS
CODEC_GRANULE = {0: 1, 1: 32, 3: 256, 4: 256, 12: 32}  # a codec kernel's BLOCK_K is a multiple of its block
CODEC_GRANULE |= dict.fromkeys(SUPERBLOCK_CODECS.values(), 256) | dict.fromkeys(LEGACY_CODECS.values(), 32)
CODEC_GRANULE |= dict.fromkeys(BLOCK128_CODECS.values(), 128)
SUM_BLOCK = 256  # outputs per program of the sum over choices after a split down kernel
MAX_DECODE_TOKENS = 16  # beyond this a grouped (per-expert) kernel reads each expert once, not per pair


@dataclass(frozen=True)
class DecodeBlocks:
    """Tile sizes: rows per program and the reduction chunk, per kernel."""

    gate_up_n: int = 4  # chosen by benchmarks/moe_decode_kernel.py --sweep (docs/benchmarks.md)
    gate_up_k: int = 256
    down_n: int = 8
    down_k: int = 256
    num_warps: int = 4
    num_stages: int = 1
    split_choices: int = 0  # 1: the down kernel runs a program per (token, rows, choice), then a sum
    down_warps: int = 0  # the down kernel's warps (0: num_warps)
    max_registers: int = 0  # a cap on registers a thread (more warps an SM; ptxas spills past it); 0: none
    # int8 Q4_K: a chunk's super-blocks as one tile (its loads at once) in both kernels (1), in gate_up only
    # (2); 0: one by one
    chunk_tile: int = 0
    pdl: int = 0  # 1: each kernel after the step's first launches as a programmatic dependent (sm_90)
    gate_up_splits: int = 1  # int8 gate_up: its rows cut in that many parts along H, a program each
    gate_up_rounds: int = 1  # int8 Q4_K gate_up of whole-row tiles: groups of rows a program streams through
    gate_up_joint: int = 0  # 1: an int8 gate_up program's gate and up rows as one tile (loads asked at once)

    def launch(self, down: bool = False) -> dict[str, int]:
        """The Triton launch options of the gate_up (or the down) kernel."""
        warps = (self.down_warps or self.num_warps) if down else self.num_warps
        cap = {"maxnreg": self.max_registers} if self.max_registers else {}
        return {"num_warps": warps, "num_stages": self.num_stages, **cap}


def _default_blocks(codec: bool, built_in: DecodeBlocks, int8: bool = False) -> DecodeBlocks:
    tiles = moe_decode_blocks(codec, int8)
    return built_in if tiles is None else DecodeBlocks(*tiles)


DEFAULT_BLOCKS = _default_blocks(False, DecodeBlocks())
# banks of codec blocks: a chunk of several blocks per step keeps more bytes in flight per program (a row of
# blocks is 3.5-7x shorter in bytes than in bf16), and the down kernel split over choices; the tiles are the
# fastest of benchmarks/moe_decode_kernel.py --codec C --sweep (its runs: docs/benchmarks.md), programmatic
# dependents (pdl) where they were measured to help (MXFP4: not measured, off).
# FREETOKEN_MOE_DECODE_CODEC_BLOCKS sets every codec's.
CODEC_BLOCKS = {
    "Q4_K": DecodeBlocks(gate_up_n=16, gate_up_k=256, down_n=8, down_k=512, split_choices=1, pdl=1),
    "MXFP4": DecodeBlocks(gate_up_n=8, gate_up_k=512, down_n=4, down_k=1024, split_choices=1),
}
DEFAULT_CODEC_BLOCKS = _default_blocks(
    True, DecodeBlocks(gate_up_n=8, gate_up_k=512, down_n=8, down_k=512, split_choices=1, pdl=1)
)


# the int8-activation sides (moe_decode_int8.py): whole rows a program, eight rows a warp (a thread holds
# whole chunks), the fastest of moe_decode_kernel.py --sweep; Q8_0's gate_up rows (twice Q4_K's bytes) one
# a program, its down four rows (the sweeps: docs/benchmarks.md). FREETOKEN_MOE_DECODE_INT8_BLOCKS sets
# every codec's.
INT8_BLOCKS = _default_blocks(
    True,
    DecodeBlocks(
        gate_up_n=8, gate_up_k=2048, down_n=8, down_k=1024, num_warps=1, split_choices=1, down_warps=1, pdl=1
    ),
    int8=True,
)
INT8_CODEC_BLOCKS = {"Q8_0": replace(INT8_BLOCKS, gate_up_n=1, down_n=4)}
# rows longer than INT8_BLOCKS' chunk (H > 2048): the 8-row Q4_K tile keeps a chunk's loads of both halves
# in flight and spills past it on sm_90; gate and up as one chunk tile of two rows spill nothing and compile
# in about a second where the 8-row tile takes minutes (registers, compile times and speeds:
# docs/benchmarks.md).
INT8_WIDE_BLOCKS = {"Q4_K": replace(INT8_BLOCKS, gate_up_n=2, chunk_tile=2, gate_up_joint=1)}


def int8_blocks(gate_up_codec: str, hidden: int = 0) -> DecodeBlocks:
    """The int8 sides' tiles for banks whose gate_up rows are in `gate_up_codec` and `hidden` weights long
    (the environment's, when set)."""
    if moe_decode_blocks(True, int8=True) is not None:
        return INT8_BLOCKS
    if hidden > INT8_BLOCKS.gate_up_k and gate_up_codec in INT8_WIDE_BLOCKS:
        return INT8_WIDE_BLOCKS[gate_up_codec]
    return INT8_CODEC_BLOCKS.get(gate_up_codec, INT8_BLOCKS)


def codec_blocks(gate_up_codec: str) -> DecodeBlocks:
    """The tiles for banks whose gate_up rows are in `gate_up_codec` (the environment's, when set)."""
    if moe_decode_blocks(True) is not None:
        return DEFAULT_CODEC_BLOCKS
    return CODEC_BLOCKS.get(gate_up_codec, DEFAULT_CODEC_BLOCKS)


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernels() -> tuple[Any, Any, Any, bool]:
    """(gate_up_act, down, sum_choices, interpreted)."""
    from triton.runtime.interpreter import InterpretedFunction

    from freetoken.runtime.moe.kernels import moe_decode_triton as body

    interpreted = isinstance(body.gate_up_act_kernel, InterpretedFunction)
    return body.gate_up_act_kernel, body.down_sum_kernel, body.sum_choices_kernel, interpreted


def fused_moe_decode(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up_bank: torch.Tensor,
    down_bank: torch.Tensor,
    blocks: DecodeBlocks | None = None,
    fn: ExpertFn = SILU,
    bias: PairBias | None = None,
    codecs: tuple[str, str] | None = None,
    int8_act: bool = False,
) -> torch.Tensor:
    """x [T, H], topk_ids [T, K] (-1: skip) and topk_weights [T, K] on x's device, gate_up_bank [S, 2I, H]
    and down_bank [S, H, I] (rows contiguous) -> [T, H] in x's dtype. `fn`: the experts' function; `bias`:
    each pair's gate/up bias (its tensors on x's device); `codecs`: banks of codec blocks as stored, uint8
    [S, 2I, row bytes] / [S, H, row bytes] (QUANT_CODECS); `int8_act`: banks of a codec the int8 kernels
    read (moe_decode_int8.py) meet the quantized vector."""
    t, h = x.shape
    k = topk_ids.shape[1]
    gate_up_act, down, sum_choices, interpreted = _kernels()
    i, gu_code, dn_code = check_banks(x, gate_up_bank, down_bank, codecs, interpreted)
    pairs = t * k
    ids = topk_ids.reshape(pairs).contiguous()
    weights = topk_weights.reshape(pairs).contiguous()
    x = x.contiguous()
    act = torch.empty(pairs, i, dtype=torch.float32, device=x.device)
    out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    table = codec_table(x.device)
    if bias is None:
        bias_bank, bias_ids = act, ids  # never read
    else:
        bias_bank = bias.gate_up.float().contiguous()
        bias_ids = bias.ids.reshape(pairs).contiguous()
    gu_int8, dn_int8 = (int8_side(codecs[0], h), int8_side(codecs[1], i)) if int8_act and codecs else (0, 0)
    b = blocks or (
        DEFAULT_BLOCKS
        if codecs is None
        else int8_blocks(codecs[0], h)
        if gu_int8 or dn_int8
        else codec_blocks(codecs[0])
    )
    pdl = bool(b.pdl) and not interpreted and grid_dependency(x.device)
    splits = gate_up_splits(b.gate_up_splits, h, gu_int8) if gu_int8 else 1
    # an int8 gate_up whose programs own whole blocks of 32 rows, or the launch that adds a split gate_up's
    # parts, quantizes the activations for int8 down
    whole = b.gate_up_n % 32 == 0 or (splits > 1 and i % 32 == 0)
    act_quantized = quantized_buffers(pairs, i, x.device) if gu_int8 and dn_int8 and whole else None
    if gu_int8:
        gate_up_int8(
            x, ids, gate_up_bank, act, bias_bank, bias_ids, bias is not None, fn, gu_int8, k, b.gate_up_n,
            b.gate_up_k, b.launch(), interpreted, act_quantized, b.chunk_tile > 0, pdl, splits,
            b.gate_up_rounds, bool(b.gate_up_joint),
        )  # fmt: skip
    else:
        gate_up_act[(pairs, -(-i // b.gate_up_n))](
            x, ids, gate_up_bank, act, bias_bank, bias_ids, table, gate_up_bank.stride(0),
            gate_up_bank.stride(1), fn.alpha, fn.limit, H=h, INTER=i, K=k, BLOCK_N=b.gate_up_n,
            BLOCK_K=_block_k(b.gate_up_k, gu_code), ACT=fn.code, HAS_BIAS=bias is not None, CODEC=gu_code,
            PDL=pdl, **b.launch(),
        )  # fmt: skip
    split = bool(b.split_choices) and k > 1
    target = torch.empty(pairs, h, dtype=torch.float32, device=x.device) if split else out
    if dn_int8:
        down_int8(
            act if act_quantized is None else act_quantized, ids, weights, down_bank, target, dn_int8, k,
            b.down_n, b.down_k, b.launch(down=True), interpreted, split, b.chunk_tile == 1, pdl,
        )  # fmt: skip
    else:
        down[(t, -(-h // b.down_n), k if split else 1)](
            act, ids, weights, down_bank, target, table, down_bank.stride(0), down_bank.stride(1),
            H=h, INTER=i, K=k, BLOCK_N=b.down_n, BLOCK_K=_block_k(b.down_k, dn_code), CODEC=dn_code,
            SPLIT=split, PDL=pdl, **pdl_launch(pdl), **b.launch(down=True),
        )  # fmt: skip
    if split:
        sum_choices[(t, -(-h // SUM_BLOCK))](
            target, out, H=h, K=k, K_POW2=next_pow2(k), BLOCK_N=SUM_BLOCK, PDL=pdl, **pdl_launch(pdl)
        )
    return out


@functools.cache
def grid_dependency(device: torch.device) -> bool:
    """Whether `device` runs programmatic dependent launch (sm_90 and later; the interpreter runs none)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def check_banks(
    x: torch.Tensor,
    gate_up_bank: torch.Tensor,
    down_bank: torch.Tensor,
    codecs: tuple[str, str] | None,
    interpreted: bool,
) -> tuple[int, int, int]:
    """The Triton expert kernels' inputs checked (banks [S, 2I, H] / [S, H, I] of values or of `codecs`'
    blocks, rows contiguous; CUDA tensors, or CPU ones under the interpreter) -> (I, the gate_up and down
    codecs' kernel numbers)."""
    h = x.shape[1]
    gu_code, dn_code = (0, 0) if codecs is None else (QUANT_CODECS[codecs[0]], QUANT_CODECS[codecs[1]])
    i = gate_up_bank.shape[1] // 2
    if gate_up_bank.stride(2) != 1 or down_bank.stride(2) != 1:
        raise ValueError("expert banks need contiguous rows")
    widths = (
        (h, i) if codecs is None else (get_codec(codecs[0]).row_bytes(h), get_codec(codecs[1]).row_bytes(i))
    )
    if gate_up_bank.shape[1:] != (2 * i, widths[0]) or down_bank.shape[1:] != (h, widths[1]):
        shapes = f"{tuple(gate_up_bank.shape)} / {tuple(down_bank.shape)}"
        raise ValueError(f"bank shapes {shapes} do not fit x of width {h}")
    if x.device.type == "cpu" and not interpreted:
        raise ValueError("the Triton MoE kernels take CUDA tensors (CPU ones only under TRITON_INTERPRET=1)")
    return i, gu_code, dn_code


def _block_k(block_k: int, code: int) -> int:
    """The reduction chunk rounded up to whole blocks of the codec (a power of two either way)."""
    return max(block_k, CODEC_GRANULE[code])
