"""Banks of codec blocks through the fused MoE decode kernel against the plain sum over the reference
dequantisation: one check, run by Triton's interpreter on CPU tensors (tests/runtime/moe) and compiled on
CUDA (tests/gpu), where a layout the interpreter cannot show (a reshape free to reorder mixed rows) fails."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from freetoken.codecs import get_codec
from freetoken.runtime.moe.expert_fn import ExpertFn, PairBias
from freetoken.runtime.moe.experts import grouped_experts
from freetoken.runtime.moe.kernels.moe_decode import (
    INT8_BLOCKS,
    INT8_WIDE_BLOCKS,
    DecodeBlocks,
    fused_moe_decode,
)
from freetoken.runtime.moe.kernels.moe_decode_int8 import (
    int8_decode_reference,
    int8_side,
    quantize_dequantize_blocks,
)

# Rows per program of 32-64 where a case is about chunks along K: Triton's interpreter runs each program
# apart, so a few wide programs cost a quarter of the time of many narrow ones.
CODEC_CASES = [  # (gate_up codec, down codec), H, I, tiles, the experts' function
    (("Q8_0", "Q8_0"), 96, 64, DecodeBlocks(16, 64, 16, 64), "clamped"),
    (("Q4_K", "Q4_K"), 256, 256, DecodeBlocks(16, 64, 16, 64), "clamped_silu"),
    (("MXFP4", "MXFP4"), 64, 96, DecodeBlocks(16, 64, 16, 64), "clamped"),
    (("Q4_K", "Q8_0"), 256, 96, DecodeBlocks(16, 64, 16, 64), "clamped_silu"),
    (("Q4_K", "MXFP4"), 768, 160, DecodeBlocks(32, 512, 32, 128), "clamped"),
    (("Q8_0", "Q4_K"), 96, 512, DecodeBlocks(32, 64, 32, 1024, split_choices=1), "clamped_silu"),
    (("Q6_K", "Q6_K"), 768, 256, DecodeBlocks(32, 512, 32, 256), "clamped"),
    (("Q4_K", "Q6_K"), 256, 512, DecodeBlocks(32, 256, 32, 1024, split_choices=1), "clamped_silu"),
    # the types quant_lowbit_triton reads: super-blocks (a chunk of two past a row of 1.5), blocks of 32
    (("Q5_K", "IQ4_XS"), 768, 256, DecodeBlocks(16, 512, 16, 256), "clamped"),
    (("Q2_K", "Q3_K"), 256, 256, DecodeBlocks(16, 256, 16, 256), "clamped_silu"),
    (("IQ2_XXS", "IQ2_XS"), 256, 256, DecodeBlocks(16, 256, 16, 256), "clamped"),
    (("IQ3_XXS", "IQ3_S"), 256, 256, DecodeBlocks(16, 256, 16, 256), "clamped_silu"),
    (("Q4_0", "Q5_0"), 96, 160, DecodeBlocks(16, 64, 16, 128), "clamped"),
    (("IQ4_NL", "Q2_K"), 160, 256, DecodeBlocks(16, 64, 16, 256), "clamped_silu"),
    (("Q4_1", "Q5_1"), 96, 160, DecodeBlocks(16, 64, 16, 128), "clamped"),
    # the safetensors codecs: blocks of 128 (a chunk of two past a row of 1.5 chunks: 384 = 1.5 × 256)
    (("FP8", "NVFP4"), 384, 256, DecodeBlocks(16, 256, 16, 128), "clamped_silu"),
]
SCALES = {"Q8_0": 5e-3, "Q4_K": 1e-3, "Q6_K": 2e-5, "MXFP4": 2**-4}  # block scales giving values about 1
SCALES |= {"Q5_K": 5e-4, "IQ4_XS": 1e-4, "Q2_K": 1e-2, "Q3_K": 1e-3, "IQ2_XXS": 2e-3, "IQ2_XS": 2e-3}
SCALES |= {"IQ3_XXS": 1e-3, "IQ3_S": 1e-3, "Q4_0": 5e-2, "Q5_0": 3e-2, "IQ4_NL": 3e-3, "Q4_1": 5e-2}
SCALES |= {"Q5_1": 3e-2}


def codec_rows(codec: str, experts: int, rows: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [experts, rows, row bytes] of `codec`: random blocks at SCALES' scale, or for the safetensors
    codecs (FP8, NVFP4, whose blocks carry fp32 scales) random weights about 1 by their quantizers."""
    c = get_codec(codec)
    if codec not in ("FP8", "NVFP4"):
        return c.random_blocks(np.empty((experts, rows, c.row_bytes(n)), np.uint8), rng, SCALES[codec])
    from freetoken.codecs import fp8, nvfp4

    out = []
    for _ in range(experts):
        w = rng.standard_normal((rows, n)).astype(np.float32)
        if codec == "FP8":
            out.append(fp8.block_rows(*fp8.quantize_tiles(w)))
        else:
            out.append(nvfp4.block_rows(*nvfp4.quantize(w)))
    return np.stack(out)


def check_codec_banks(
    codecs: tuple[str, str], h: int, i: int, tiles: DecodeBlocks, kind: str, device: str
) -> None:
    """Slots holding blocks as stored: the kernel dequantises in registers, with a clamped function (its
    limit passed) and biases on, and gives the plain sum over gguf's dequantisation of the same blocks;
    chunks of several blocks whose last ones lie past the row (768 = 1.5 chunks of 512; 160 = 1.25 of 128)
    read nothing there."""
    rng = np.random.default_rng(1)
    gu, dn = (get_codec(name) for name in codecs)
    gu_blocks, dn_blocks = codec_rows(gu.name, 5, 2 * i, h, rng), codec_rows(dn.name, 5, h, i, rng)
    gate_up = torch.from_numpy(gu.dequantize(gu_blocks, h)).to(device)
    down = torch.from_numpy(dn.dequantize(dn_blocks, i)).to(device)
    x, w = torch.randn(3, h).to(device), torch.rand(3, 2).to(device)
    ids = torch.tensor([[0, 4], [2, -1], [3, 1]], device=device)
    fn, bias = ExpertFn(kind, limit=2.0), PairBias((torch.randn(5, 2 * i) * 0.1).to(device), ids)
    want = grouped_experts(x, ids, w, gate_up, down, fn, bias)
    assert not torch.allclose(grouped_experts(x, ids, w, gate_up, down, replace(fn, limit=1e9), bias), want)
    blocks = torch.from_numpy(gu_blocks).to(device), torch.from_numpy(dn_blocks).to(device)
    got = fused_moe_decode(x, ids, w, *blocks, tiles, fn=fn, bias=bias, codecs=codecs)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))


INT8_CASES = [  # (gate_up codec, down codec), H, I, tiles: both sides int8, one side, chunks past the row;
    # down split over choices or not; gate_up programs of whole blocks of 32 rows quantize the activations
    (("Q4_K", "Q4_K"), 512, 256, DecodeBlocks(64, 256, 64, 256)),
    (("Q4_K", "Q4_K"), 512, 256, DecodeBlocks(64, 512, 64, 1024, split_choices=1)),
    # a chunk's super-blocks as one tile: 768 = 3 of a chunk of 4, the fourth read nothing
    (("Q4_K", "Q4_K"), 768, 512, DecodeBlocks(32, 1024, 32, 1024, split_choices=1, chunk_tile=1)),
    (("Q4_K", "Q4_K"), 512, 768, DecodeBlocks(32, 512, 64, 512, num_warps=2, chunk_tile=1)),
    # a gate_up program streams through groups of whole-row tiles: 8 groups of 32 rows (quantizing the
    # activations) in 3 programs, the last one's third group past the end; 16 groups of 16 in 8
    (("Q4_K", "Q4_K"), 512, 256, DecodeBlocks(32, 512, 64, 256, chunk_tile=1, gate_up_rounds=3)),
    (("Q4_K", "Q4_K"), 512, 256, DecodeBlocks(16, 512, 64, 256, chunk_tile=2, gate_up_rounds=2)),
    (("Q8_0", "Q8_0"), 128, 192, DecodeBlocks(128, 64, 8, 256)),  # the second program's rows past I
    (
        ("Q8_0", "Q8_0"),
        192,
        128,
        DecodeBlocks(8, 128, 16, 64, split_choices=1, max_registers=128),
    ),  # 1.5 chunks
    (("Q8_0", "Q4_K"), 96, 256, DecodeBlocks(16, 64, 8, 256)),  # x's 3 blocks: gate_up stays float
    (("Q4_K", "Q6_K"), 256, 512, DecodeBlocks(64, 512, 64, 256)),  # Q6_K down stays float; 0.5 chunk
    (("Q4_K", "Q8_0"), 768, 96, DecodeBlocks(32, 512, 32, 64)),  # down of 3 blocks stays float
    # gate_up rows cut along H, the parts added by a second launch that quantizes for down: a part of 3
    # super-blocks read in chunks of 2 (the second's half past the part's end), one of 1, Q8_0 parts of one
    # pair of blocks, one tile a chunk; down float (the second launch writes fp32 activations)
    (("Q4_K", "Q4_K"), 1536, 256, DecodeBlocks(64, 2048, 64, 256, split_choices=1, gate_up_splits=2)),
    (("Q4_K", "Q4_K"), 768, 256, DecodeBlocks(32, 256, 64, 256, gate_up_splits=3)),
    (("Q8_0", "Q8_0"), 192, 128, DecodeBlocks(32, 128, 64, 64, split_choices=1, gate_up_splits=3)),
    (("Q4_K", "Q4_K"), 1024, 256, DecodeBlocks(32, 1024, 64, 256, chunk_tile=1, gate_up_splits=2)),
    (("Q4_K", "Q6_K"), 512, 256, DecodeBlocks(32, 512, 64, 256, gate_up_splits=2)),
    # a program's gate and up rows as one tile: Q8_0 rows past I in the second program (quantizing the
    # activations); Q4_K chunk by chunk and as one tile; with the rows cut along H
    (("Q8_0", "Q8_0"), 128, 192, DecodeBlocks(128, 64, 8, 256, gate_up_joint=1)),
    (("Q4_K", "Q4_K"), 512, 256, DecodeBlocks(32, 256, 64, 256, gate_up_joint=1)),
    (("Q4_K", "Q4_K"), 768, 256, DecodeBlocks(32, 1024, 64, 256, chunk_tile=1, gate_up_joint=1)),
    (("Q8_0", "Q8_0"), 192, 128, DecodeBlocks(32, 128, 64, 64, gate_up_splits=3, gate_up_joint=1)),
    # the shipped tiles of rows past a chunk (H > 2048), in chunks of 2 super-blocks (of 8 on a GPU) and more
    # rows a program (the interpreter takes minutes at their size): 3 super-blocks, the second chunk's last
    # past H
    (("Q4_K", "Q4_K"), 768, 256, replace(INT8_WIDE_BLOCKS["Q4_K"], gate_up_n=32, gate_up_k=512, down_n=64)),
    # the nibble-table codecs (MXFP4, Q4_0, IQ4_NL): gate_up programs of 32 rows quantizing the activations,
    # down's 96 = 1.5 chunks; x's 96 = 1.5 chunks, the activations quantized by their own launch; gate and
    # up as one tile; beside Q4_K either way
    (("MXFP4", "MXFP4"), 128, 96, DecodeBlocks(32, 64, 16, 64)),
    (("Q4_0", "IQ4_NL"), 96, 64, DecodeBlocks(16, 64, 16, 32, split_choices=1)),
    (("IQ4_NL", "Q4_0"), 64, 96, DecodeBlocks(32, 32, 32, 64, gate_up_joint=1)),
    (("Q4_K", "MXFP4"), 256, 96, DecodeBlocks(32, 256, 32, 64)),
    (("MXFP4", "Q4_K"), 96, 256, DecodeBlocks(32, 64, 32, 256, split_choices=1)),
    # gpt-oss's width, 2880 = 90 blocks: in the shipped chunk of 2048 (64 blocks, then 26 with 38 past the
    # row); cut in two parts of 1440, each in chunks of 1024 (the second reads 416, none of the next part)
    (("MXFP4", "MXFP4"), 2880, 32, replace(INT8_BLOCKS, gate_up_n=32, down_n=512, down_k=32)),
    (("MXFP4", "MXFP4"), 2880, 32, DecodeBlocks(32, 2048, 512, 32, gate_up_splits=2)),
]


def one_quant_step(
    x: torch.Tensor,
    ids: torch.Tensor,
    w: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    sides: tuple[bool, bool],
    fn: ExpertFn,
    bias: PairBias,
) -> torch.Tensor:
    """[T, 1]: how far one activation quant per pair, one step off, moves a token's output: the kernel's
    gate_up sums run in another order than the reference's, so a value on a rounding boundary of
    act / d may land on either side (w · d_max · max |down|, summed over the token's pairs)."""
    k = ids.shape[1]
    xq = quantize_dequantize_blocks(x.float()) if sides[0] else x.float()
    out = torch.zeros(x.shape[0], 1, device=x.device)
    for p, e in enumerate(ids.flatten().tolist()):
        if e >= 0:
            h = gate_up[e].float() @ xq[p // k] + bias.rows(torch.tensor([p], device=x.device))[0].float()
            step = float(fn.glu(*h.chunk(2)).abs().max()) / 127
            out[p // k] += float(w.flatten()[p]) * step * float(down[e].abs().max())
    return out


# the int8 sides' blocks of 32 with one scale each take a scale of their own (SCALES' times 1/2, 1 or 2), so a
# block met with another block's scale fails the check
OWN_SCALES = ("MXFP4", "Q4_0", "IQ4_NL")


def int8_rows(codec: str, experts: int, rows: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [experts, rows, row bytes] of random `codec` blocks at SCALES' scale (OWN_SCALES: per block)."""
    c = get_codec(codec)
    out = c.random_blocks(np.empty((experts, rows, c.row_bytes(n)), np.uint8), rng, SCALES[codec])
    if codec in OWN_SCALES:
        blocks = out.reshape(-1, c.block_bytes)
        shift = rng.integers(-1, 2, blocks.shape[0])
        if c.e8m0_offsets:  # e8m0: the exponent's byte
            blocks[:, 0] = (blocks[:, 0].astype(np.int64) + shift).astype(np.uint8)
        else:  # fp16 at bytes 0-1
            d = (SCALES[codec] * 2.0**shift).astype(np.float16)
            blocks[:, :2] = d.view(np.uint8).reshape(-1, 2)
    return out


def check_int8_banks(codecs: tuple[str, str], h: int, i: int, tiles: DecodeBlocks, device: str) -> None:
    """The int8-activation sides against int8_decode_reference (x and each activation quantize-dequantized
    per block of 32, then fp32 sums over gguf's dequantisation of the same blocks), with biases, a skipped
    pair, a block of x all zeros and a row whose scales are zero; and within 3e-2 of the float path."""
    rng = np.random.default_rng(2)
    gu, dn = (get_codec(name) for name in codecs)
    gu_blocks, dn_blocks = int8_rows(gu.name, 5, 2 * i, h, rng), int8_rows(dn.name, 5, h, i, rng)
    gu_blocks[1, 3, :] = 0  # every scale and quant of a row zero
    gate_up = torch.from_numpy(gu.dequantize(gu_blocks, h)).to(device)
    down = torch.from_numpy(dn.dequantize(dn_blocks, i)).to(device)
    # drawn from a generator of their own: a heavy-tailed activation block can take int8's error past 3e-2
    # of the float path (5 % on one draw in six at 512 / 256), so the draw must not depend on the tests before
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, h, generator=g).to(device), torch.rand(3, 2, generator=g).to(device)
    x[1, 32:64] = 0.0
    ids = torch.tensor([[0, 4], [2, -1], [3, 1]], device=device)
    fn, bias = ExpertFn("silu"), PairBias((torch.randn(5, 2 * i, generator=g) * 0.1).to(device), ids)
    sides = (int8_side(codecs[0], h) > 0, int8_side(codecs[1], i) > 0)
    assert any(sides)
    want = int8_decode_reference(x, ids, w, gate_up, down, sides, fn, bias)
    blocks = torch.from_numpy(gu_blocks).to(device), torch.from_numpy(dn_blocks).to(device)
    got = fused_moe_decode(x, ids, w, *blocks, tiles, fn=fn, bias=bias, codecs=codecs, int8_act=True)
    flips = one_quant_step(x, ids, w, gate_up, down, sides, fn, bias) if sides[1] else 0.0
    bound = 1e-4 * want.abs() + 1e-4 * float(want.abs().max()) + flips
    assert bool(((got - want).abs() <= bound).all()), float(((got - want).abs() - bound).max())
    exact = grouped_experts(x, ids, w, gate_up, down, fn, bias)
    err = float((got - exact).norm() / exact.norm())
    assert 0 < err < 3e-2, err
