"""The fused MoE decode step's int8-activation sides (kernels: moe_decode_int8_triton.py): Q4_K, Q8_0,
MXFP4, Q4_0 and IQ4_NL banks met by dp4a against the vector quantized per block of 32 (x before gate_up,
the activation before down), as llama.cpp's GPU decode does; about 1 % from the float path on random
weights (the int8 activations' error), so it is chosen (FREETOKEN_MOE_DECODE_KERNEL=int8), not the default.

`int8_decode_reference` is the plain torch statement of the same arithmetic (x and the activation
replaced by their quantize-dequantize), which the kernels are tested against.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from freetoken.runtime.moe.expert_fn import ExpertFn, PairBias

# codecs whose rows the int8 kernels read, by the kernels' numbers, and the reduction chunk's granule
INT8_CODECS = {"Q4_K": 3, "Q8_0": 1, "MXFP4": 12, "Q4_0": 17, "IQ4_NL": 25}
# Q8_0 is read in block pairs (68 bytes, 4-byte aligned); MXFP4, Q4_0 and IQ4_NL block by block
INT8_GRANULE = {3: 256, 1: 64, 12: 32, 17: 32, 25: 32}
QUANTIZE_BLOCKS = 16  # blocks of 32 per program of the quantize kernel
Quantized = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # words [R, W / 4], scales, sums [R, W / 32]


def int8_side(codec: str | None, width: int) -> int:
    """The int8 kernels' codec number for a bank of `codec` rows of `width` weights, or 0 where they do
    not read it (other codecs; Q8_0 rows of an odd number of blocks, whose pairs would be misaligned)."""
    code = INT8_CODECS.get(codec or "", 0)
    return code if code and width % INT8_GRANULE[code] == 0 else 0


@functools.cache
def _kernels() -> Any:
    from freetoken.runtime.moe.kernels import moe_decode_int8_triton, quant_dot_int8_triton

    return moe_decode_int8_triton, quant_dot_int8_triton.quantize_blocks_kernel


def quantize_blocks(v: torch.Tensor, pdl: bool = False, dependent: bool = False) -> Quantized:
    """v [R, W] (W a multiple of 32) -> (quants as int32 words [R, W / 4], scales [R, W / 32], sums
    [R, W / 32]): quantize_blocks_kernel. `pdl`: the kernel after it launches as its programmatic
    dependent; `dependent`: it launches as one of the kernel before it (pdl_launch)."""
    r, w = v.shape
    q, d, s = quantized_buffers(r, w, v.device)
    _kernels()[1][(r, -(-(w // 32) // QUANTIZE_BLOCKS))](
        v, q, d, s, W=w, NB=QUANTIZE_BLOCKS, PDL=pdl, **pdl_launch(pdl and dependent)
    )
    return q, d, s


def pdl_launch(dependent: bool) -> dict[str, bool]:
    """The launch option of a kernel that may start before the kernel before it ends (programmatic
    dependent launch, sm_90): it reads that kernel's output only after gdc_wait."""
    return {"launch_pdl": True} if dependent else {}


def gate_up_int8(
    x: torch.Tensor, ids: torch.Tensor, bank: torch.Tensor, act: torch.Tensor, bias_bank: torch.Tensor,
    bias_ids: torch.Tensor, has_bias: bool, fn: ExpertFn, code: int, k: int, rows: int, block_k: int,
    launch: dict[str, int], interpreted: bool, act_quantized: Quantized | None = None, tile: bool = False,
    pdl: bool = False, splits: int = 1, rounds: int = 1, joint: bool = False,
) -> None:  # fmt: skip
    """act [T·K, I] fp32 <- glu(W_gu · x̃ + b) for every pair (x quantized here), `rows` rows a program
    (`launch`: Triton's launch options, DecodeBlocks.launch; `tile`: DecodeBlocks.chunk_tile; `pdl`:
    the quantize launch first, every kernel after it a programmatic dependent of the one before);
    with `act_quantized` (`rows` a multiple of 32, or `splits` > 1 and I a multiple of 32) the
    activations go there quantized instead. `splits` (gate_up_splits(), DecodeBlocks.gate_up_splits):
    each row cut in that many parts along H, a program each, their partial sums added, the bias and
    the activation applied by a second launch (glu_parts_kernel). `rounds` (DecodeBlocks.gate_up_rounds):
    Q4_K rows as whole-row tiles, that many groups of `rows` a program, the next group's weights asked for
    before the current one's dots (used where streamed_rounds() allows it, else 1). `joint`
    (DecodeBlocks.gate_up_joint): a program's gate and up rows met as one tile of twice the rows, so its
    loads of both are asked for before either's dots (not with `rounds`)."""
    h, i, pairs = x.shape[1], act.shape[1], ids.numel()
    body = _kernels()[0]
    xq, xd, xs = quantize_blocks(x, pdl)
    outs = (act, act, act) if act_quantized is None else act_quantized
    parts = torch.empty(splits, pairs, 2 * i, dtype=torch.float32, device=x.device) if splits > 1 else None
    step = chunk(block_k, code)  # the reduction chunk, a power of two
    if splits > 1:  # one within a part (a chunk past a part's end is masked: it reads none of the next)
        step = min(step, 1 << ((h // splits).bit_length() - 1))
    rounds = streamed_rounds(rounds, code, tile, splits, block_k, h)
    groups = -(-i // rows)
    body.gate_up_int8_kernel[(pairs, -(-groups // rounds), splits)](
        xq, xd, xs, ids, bank, *((parts,) * 3 if parts is not None else outs), bias_bank, bias_ids,
        bank.stride(0), bank.stride(1), fn.alpha, fn.limit, H=h, INTER=i, K=k, BLOCK_N=rows, BLOCK_K=step,
        ACT=fn.code, HAS_BIAS=has_bias, CODEC=code, EMULATE=interpreted,
        QUANT_ACT=act_quantized is not None and parts is None, TILE=tile, PDL=pdl, SPLITS=splits,
        ROUNDS=rounds, JOINT=joint, **pdl_launch(pdl), **launch,
    )  # fmt: skip
    if parts is not None:
        body.glu_parts_kernel[(pairs, -(-i // (32 * QUANTIZE_BLOCKS)))](
            parts, *outs, bias_bank, bias_ids, fn.alpha, fn.limit, INTER=i, SPLITS=splits, NB=QUANTIZE_BLOCKS,
            ACT=fn.code, HAS_BIAS=has_bias, QUANT=act_quantized is not None, PDL=pdl, **pdl_launch(pdl),
        )  # fmt: skip


def streamed_rounds(rounds: int, code: int, tile: bool, splits: int, block_k: int, h: int) -> int:
    """The groups of rows an int8 gate_up program streams through: `rounds` for Q4_K rows read as one tile
    each (a chunk tile of the whole row, unsplit), else 1."""
    return rounds if rounds > 1 and code == 3 and tile and splits == 1 and chunk(block_k, code) >= h else 1


def gate_up_splits(splits: int, h: int, code: int) -> int:
    """The parts an int8 gate_up row is cut in: `splits` where each part is whole granules of the codec
    (INT8_GRANULE), else 1."""
    return splits if splits > 1 and h % (splits * INT8_GRANULE[code]) == 0 else 1


def down_int8(
    act: torch.Tensor | Quantized, ids: torch.Tensor, weights: torch.Tensor, bank: torch.Tensor,
    out: torch.Tensor, code: int, k: int, rows: int, block_k: int, launch: dict[str, int], interpreted: bool,
    split: bool, tile: bool = False, pdl: bool = False,
) -> None:  # fmt: skip
    """With `split`, out [T·K, H] fp32 <- w[p] · W_d · ã[p] for every pair; else out [T, H] <- the sum over
    each token's pairs. `act`: fp32 [T·K, I] (quantized here) or already quantized (quantize_blocks').
    `pdl`: its kernels launch as programmatic dependents of the one before (the gate_up kernel first)."""
    aq, ad, as_ = quantize_blocks(act, pdl, dependent=True) if isinstance(act, torch.Tensor) else act
    pairs, i = aq.shape[0], aq.shape[1] * 4
    h = out.shape[1]
    _kernels()[0].down_int8_kernel[(pairs // k, -(-h // rows), k if split else 1)](
        aq, ad, as_, ids, weights, bank, out, bank.stride(0), bank.stride(1),
        H=h, INTER=i, K=k, BLOCK_N=rows, BLOCK_K=chunk(block_k, code), CODEC=code, EMULATE=interpreted,
        SPLIT=split, TILE=tile, PDL=pdl, **pdl_launch(pdl), **launch,
    )  # fmt: skip


def quantized_buffers(pairs: int, width: int, device: torch.device) -> Quantized:
    """Empty (words [P, W / 4] int32, scales and sums [P, W / 32] fp32) for quantized activations."""
    scales = torch.empty(pairs, width // 32, dtype=torch.float32, device=device)
    return torch.empty(pairs, width // 4, dtype=torch.int32, device=device), scales, torch.empty_like(scales)


def chunk(block_k: int, code: int) -> int:
    """The int8 kernels' reduction chunk: whole granules of the codec (a power of two either way)."""
    return max(block_k, INT8_GRANULE[code])


def quantize_dequantize_blocks(v: torch.Tensor) -> torch.Tensor:
    """[R, W] -> fp32 [R, W]: each block of 32 as d · rint(v / d), d = max|v| / 127 (ties to even), the
    values the int8 kernels multiply."""
    blocks = v.float().reshape(v.shape[0], -1, 32)
    amax = blocks.abs().amax(dim=2, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv) * (amax / 127.0)).reshape(v.shape)


def int8_decode_reference(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    sides: tuple[bool, bool],
    fn: ExpertFn,
    bias: PairBias | None = None,
) -> torch.Tensor:
    """The int8 decode step in fp32 torch: gate_up [E, 2I, H] and down [E, H, I] the banks' dequantised
    values; x quantized before gate_up where sides[0], each pair's activation before down where sides[1]
    -> [T, H] fp32."""
    t, k = topk_ids.shape
    xq = quantize_dequantize_blocks(x.float()) if sides[0] else x.float()
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    for p, e in enumerate(topk_ids.flatten().tolist()):
        if e < 0:
            continue
        h = gate_up[e].float() @ xq[p // k]
        if bias is not None:
            h = h + bias.rows(torch.tensor([p], device=x.device))[0].float()
        act = fn.glu(*h.chunk(2))[None]
        act = quantize_dequantize_blocks(act)[0] if sides[1] else act[0]
        out[p // k] += topk_weights.flatten()[p].float() * (down[e].float() @ act)
    return out
