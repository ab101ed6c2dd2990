"""The CPU expert kernel over banks kept as stored (Q8_0 blocks, bf16 rows as bytes) against fp32 experts over
the codec's dequantisation (gguf's): weight-only to fp32 summation order; with int8 activations (`int8_act`)
tightly against the same experts given activations quantized the kernel's way, and within what int8
activations cost (the issue's 3e-2) against plain fp32."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import gguf.quants as gq
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

import gguf_fixture
from freetoken.codecs import get_codec
from freetoken.runtime.moe.experts import grouped_experts
from freetoken.runtime.moe.kernels.cpu_experts import (
    bf16_act_reference,
    cpu_experts,
    kernel_available,
    kernel_takes,
    run_kernel,
    stored_reference,
)
from oracle import rel_err

pytestmark = pytest.mark.skipif(not kernel_available(), reason="needs the compiled CPU kernel")


def q8_activations(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x [..., n] -> its Q8 blocks dequantised: per `block` (32; 256 for the K-quants), scale max|x| / 127,
    values rounded half to even (quant_dot.h's quantize_q8, in the same fp32 steps)."""
    blocks = x.float().reshape(*x.shape[:-1], -1, block)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv) * (amax / 127.0)).reshape(x.shape)


def quantized_activation_reference(
    x: torch.Tensor,
    ids: torch.Tensor,
    w: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    quantize_down: bool = True,
    blocks: tuple[int, int] = (32, 32),
) -> torch.Tensor:
    """fp32 experts with x (and, for a quantized down bank, each pair's down input) quantized as the
    kernel quantizes them, in activation blocks of `blocks` (gate/up's, down's)."""
    inter = down.shape[2]
    out = torch.zeros(x.shape[0], down.shape[1])
    xq = q8_activations(x, blocks[0])
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e < 0:
                continue
            gu = gate_up[e] @ xq[t]
            a = w[t, k] * torch.nn.functional.silu(gu[:inter]) * gu[inter:]
            out[t] += down[e] @ (q8_activations(a, blocks[1]) if quantize_down else a)
    return out


def q8_banks(e: int, h: int, i: int, seed: int, scale: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    gate_up = (rng.standard_normal((e, 2 * i, h)) * scale).astype(np.float32)
    down = (rng.standard_normal((e, h, i)) * scale).astype(np.float32)
    return gq.quantize(gate_up, Q.Q8_0), gq.quantize(down, Q.Q8_0)


def dequantized(raw: np.ndarray, n: int) -> torch.Tensor:
    return torch.from_numpy(get_codec("Q8_0").dequantize(raw, n))


@pytest.mark.parametrize(("tokens", "h", "i"), [(1, 256, 96), (3, 96, 64), (20, 160, 32)])
def test_q8_0_matches_both_references(tokens: int, h: int, i: int) -> None:
    """Shapes with an odd number of blocks per row (the kernel's two-block step leaves a tail), one and
    many tokens (20 > the 16 pairs a unit takes at a time)."""
    e, k = 8, 3
    gu_raw, dn_raw = q8_banks(e, h, i, seed=tokens)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, h, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(tokens)])
    ids[0, -1] = -1  # a pair another branch computes
    w = torch.rand(tokens, k, generator=gen)
    gate_up, down = torch.from_numpy(gu_raw), torch.from_numpy(dn_raw)
    assert kernel_takes(gate_up, down, ("Q8_0", "Q8_0"))
    gu_f, dn_f = dequantized(gu_raw, h), dequantized(dn_raw, i)
    exact = grouped_experts(x, ids, w, gu_f, dn_f)
    assert rel_err(cpu_experts(x, ids, w, gate_up, down, threads=2, codecs=("Q8_0", "Q8_0")), exact) < 1e-5
    ours = cpu_experts(x, ids, w, gate_up, down, threads=2, codecs=("Q8_0", "Q8_0"), int8_act=True)
    assert rel_err(ours, quantized_activation_reference(x, ids, w, gu_f, dn_f)) < 1e-3
    assert rel_err(ours, exact) < 3e-2
    # the plain path (no kernel) is the fp32 reference of the dequantised banks
    plain = cpu_experts(x, ids, w, gate_up, down, use_kernel=False, codecs=("Q8_0", "Q8_0"))
    assert rel_err(plain, grouped_experts(x, ids, w, gu_f, dn_f)) < 1e-6


def test_adversarial_q8_0_blocks() -> None:
    """Zero scales, the largest finite fp16 scale's neighbourhood kept finite by small values, subnormal
    scales, and -128 quants (|w| = 128 as unsigned in the int8 dot) against the fp32 reference."""
    e, h, i = 4, 128, 64
    gu_raw, dn_raw = q8_banks(e, h, i, seed=7)
    for raw, n in ((gu_raw, h), (dn_raw, i)):
        blocks = raw.reshape(*raw.shape[:-1], n // 32, 34)
        blocks[0, :, 0, :2] = np.frombuffer(np.float16(0.0).tobytes(), np.uint8)  # zero scale
        blocks[1, :, 1, :2] = np.frombuffer(np.float16(6e-8).tobytes(), np.uint8)  # subnormal scale
        blocks[2, :, :, 2:] = np.uint8(0x80)  # every quant -128
        blocks[3, :, 1, :2] = np.frombuffer(np.float16(2.0).tobytes(), np.uint8)  # a large scale
    x = torch.randn(2, h, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([[0, 1], [2, 3]])
    w = torch.tensor([[0.5, 0.5], [0.25, 0.75]])
    gate_up, down = torch.from_numpy(gu_raw), torch.from_numpy(dn_raw)
    gu_f, dn_f = dequantized(gu_raw, h), dequantized(dn_raw, i)
    exact = grouped_experts(x, ids, w, gu_f, dn_f)
    assert rel_err(cpu_experts(x, ids, w, gate_up, down, threads=2, codecs=("Q8_0", "Q8_0")), exact) < 1e-5
    ours = cpu_experts(x, ids, w, gate_up, down, threads=2, codecs=("Q8_0", "Q8_0"), int8_act=True)
    assert torch.isfinite(ours).all()
    assert rel_err(ours, quantized_activation_reference(x, ids, w, gu_f, dn_f)) < 1e-3
    assert rel_err(ours, exact) < 3e-2


def test_mixed_codecs_and_bf16_rows_as_bytes() -> None:
    """Q8_0 gate/up beside a bf16 down kept as bytes (a layer a file stores so): the down rows are exact."""
    e, h, i = 6, 128, 64
    gu_raw, _ = q8_banks(e, h, i, seed=3)
    down_bf16 = (torch.randn(e, h, i, generator=torch.Generator().manual_seed(3)) * 0.05).bfloat16()
    down = down_bf16.view(torch.uint8).reshape(e, h, 2 * i).contiguous()
    x = torch.randn(2, h, generator=torch.Generator().manual_seed(4))
    ids, w = torch.tensor([[0, 5], [5, 2]]), torch.tensor([[0.3, 0.7], [0.6, 0.4]])
    gate_up, gu_f = torch.from_numpy(gu_raw), dequantized(gu_raw, h)
    plain = stored_reference(x, ids, w, gate_up, down, ("Q8_0", "bf16"))
    assert rel_err(cpu_experts(x, ids, w, gate_up, down, threads=2, codecs=("Q8_0", "bf16")), plain) < 1e-5
    ours = cpu_experts(x, ids, w, gate_up, down, threads=2, codecs=("Q8_0", "bf16"), int8_act=True)
    tight = quantized_activation_reference(x, ids, w, gu_f, down_bf16.float(), quantize_down=False)
    assert rel_err(ours, tight) < 1e-4
    assert rel_err(ours, plain) < 3e-2


# the bf16-activation paths against their reference: the same products, summed in another order, which can
# move an activation between the projections across a bf16 rounding boundary (one ulp, 2^-8 of it; a
# wrong scale, sign or min is off by orders more)
BF16_FLIP = 1e-4


def random_blocks(codec_name: str, *shape: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(gguf_fixture.random_blocks(codec_name, shape, seed))


CODEC_PAIRS = {
    "Q4_K": ("Q4_K", "Q4_K"),
    "Q6_K": ("Q6_K", "Q6_K"),
    "Q4_K_M-like": ("Q4_K", "Q6_K"),
    "Q5_K": ("Q5_K", "Q5_K"),
    "IQ4_XS": ("IQ4_XS", "IQ4_XS"),
    "MXFP4": ("MXFP4", "MXFP4"),
    "mixed": ("IQ4_XS", "Q5_K"),
}
ACT8_BLOCK = {"Q4_K": 256, "Q5_K": 256, "Q6_K": 256, "IQ4_XS": 256, "MXFP4": 32}


@pytest.mark.parametrize("codecs", CODEC_PAIRS.values(), ids=CODEC_PAIRS.keys())
@pytest.mark.parametrize("tokens", [1, 12])
def test_k_quants_match_the_dequantised_reference(codecs: tuple[str, str], tokens: int) -> None:
    """Weight-only dots of the K-quants and the codebook codecs (every sub-block scale pattern, both
    nibble halves, the high bits of Q5_K/Q6_K) over rows of two and three super-blocks, against gguf's
    dequantisation in fp32; with int8 activations, against the same quantization of the activations."""
    e, h, i, k = 6, 512, 768, 3
    gate_up = random_blocks(codecs[0], e, 2 * i, h, seed=1)
    down = random_blocks(codecs[1], e, h, i, seed=2)
    assert kernel_takes(gate_up, down, codecs)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, h, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(tokens)])
    w = torch.rand(tokens, k, generator=gen)
    ours = cpu_experts(x, ids, w, gate_up, down, threads=2, codecs=codecs)
    plain = stored_reference(x, ids, w, gate_up, down, codecs)
    assert rel_err(ours, plain) < 1e-5
    # against int8 activation blocks: tight to the same experts given activations quantized the kernel's
    # way, and within what that costs of the exact result
    act8 = cpu_experts(x, ids, w, gate_up, down, threads=2, codecs=codecs, int8_act=True)
    gu_f, dn_f = (
        torch.from_numpy(get_codec(c).dequantize(b.numpy(), n))
        for c, b, n in zip(codecs, (gate_up, down), (h, i), strict=True)
    )
    blocks = (ACT8_BLOCK[codecs[0]], ACT8_BLOCK[codecs[1]])
    assert rel_err(act8, quantized_activation_reference(x, ids, w, gu_f, dn_f, blocks=blocks)) < 1e-3
    # random bytes give Q4_K sub-blocks far-from-zero means (random mins), which multiply the activations'
    # rounding at one scale per 256 (llama.cpp's Q8_K): up to ~13% here, where quantized weights of a real
    # model stay near 1e-2
    assert rel_err(act8, plain) < 0.2


def test_mxfp4_rows_of_odd_block_counts() -> None:
    """MXFP4 rows of 5 and 7 blocks: the int8 dot's four-block step leaves a tail of one and three."""
    e, h, i, k, tokens = 4, 160, 224, 2, 3
    gate_up, down = random_blocks("MXFP4", e, 2 * i, h, seed=5), random_blocks("MXFP4", e, h, i, seed=6)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(tokens, h, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(tokens)])
    w = torch.rand(tokens, k, generator=gen)
    gu_f, dn_f = (
        torch.from_numpy(get_codec("MXFP4").dequantize(b.numpy(), n)) for b, n in ((gate_up, h), (down, i))
    )
    act8 = cpu_experts(x, ids, w, gate_up, down, threads=2, codecs=("MXFP4", "MXFP4"), int8_act=True)
    assert rel_err(act8, quantized_activation_reference(x, ids, w, gu_f, dn_f, blocks=(32, 32))) < 1e-3


@pytest.mark.parametrize("codec", ["Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "MXFP4"])
@pytest.mark.parametrize("tokens", [1, 2])
def test_k_quants_against_bf16_activations(codec: str, tokens: int) -> None:
    """Activations that are bf16 values (a bf16 model's) take the bf16 pair-dot path where the CPU has it,
    the activation between the projections rounded to bf16 as the model's experts round it
    (bf16_act_reference): the same products, so the same result to fp32 summation order; a row with one
    value off the bf16 grid goes the fp32 way (a token each)."""
    e, h, i, k = 5, 768, 512, 2
    gate_up = random_blocks(codec, e, 2 * i, h, seed=3)
    down = random_blocks(codec, e, h, i, seed=4)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(tokens, h, generator=gen).bfloat16().float()
    x[-1, 5] += 1e-3 if tokens > 1 else 0.0
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(tokens)])
    w = torch.rand(tokens, k, generator=gen)
    ours = cpu_experts(x, ids, w, gate_up, down, threads=2, codecs=(codec, codec))
    assert rel_err(ours, bf16_act_reference(x, ids, w, gate_up, down, codecs=(codec, codec))) < BF16_FLIP


@pytest.mark.parametrize("codec", ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "MXFP4"])
def test_a_bf16_prompt_widens_rows_to_bf16(codec: str) -> None:
    """Many tokens of a bf16 model through one expert: each row is dequantised once and, where the CPU has
    bf16 pair-dot instructions, rounded to bf16 first, as torch dequantises into a bf16 model's dtype, and
    the activation between the projections is rounded too: tight to bf16_act_reference over bf16-rounded
    weights, and within bf16 rounding of the fp32 sum. (Without those instructions rows and activations
    stay fp32, which meets both bounds too.)"""
    e, h, i, k, tokens = 3, 256, 512, 2, 12
    gate_up = random_blocks(codec, e, 2 * i, h, seed=5)
    down = random_blocks(codec, e, h, i, seed=6)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(tokens, h, generator=gen).bfloat16().float()
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(tokens)])
    w = torch.rand(tokens, k, generator=gen)
    ours = cpu_experts(x, ids, w, gate_up, down, threads=2, codecs=(codec, codec))
    gu_f, dn_f = (
        torch.from_numpy(get_codec(codec).dequantize(b.numpy(), n)) for b, n in ((gate_up, h), (down, i))
    )
    plain = grouped_experts(x, ids, w, gu_f, dn_f)
    rounded = bf16_act_reference(x, ids, w, gu_f.bfloat16(), dn_f.bfloat16())
    assert min(rel_err(ours, rounded), rel_err(ours, plain)) < BF16_FLIP
    assert rel_err(ours, plain) < 1e-2


def test_banks_the_kernel_does_not_take_go_the_plain_way() -> None:
    """A codec the kernel has no dot for (f16 rows as bytes here) is computed by the reference path, not
    misread."""
    e, h, i = 2, 256, 256
    gate_up = (torch.randn(e, 2 * i, h) * 0.05).half().view(torch.uint8)
    down = (torch.randn(e, h, i) * 0.05).half().view(torch.uint8)
    assert not kernel_takes(gate_up, down, ("f16", "f16"))
    x, ids, w = torch.randn(1, h), torch.tensor([[1, 0]]), torch.tensor([[0.5, 0.5]])
    ours = cpu_experts(x, ids, w, gate_up, down, threads=2, codecs=("f16", "f16"))
    gu_f, dn_f = gate_up.view(torch.float16).float(), down.view(torch.float16).float()
    assert rel_err(ours, grouped_experts(x, ids, w, gu_f, dn_f)) < 1e-6


def fp8_rows(gen: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    from freetoken.codecs import fp8

    codes, scale = fp8.quantize_tiles(gen.standard_normal((rows, cols)).astype(np.float32) * 0.05)
    codes[0, :126] = np.arange(126)  # every positive non-NaN code, subnormals included
    return fp8.block_rows(codes, scale)


def nvfp4_rows(gen: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    from freetoken.codecs import nvfp4

    packed, scales, multiplier = nvfp4.quantize(gen.standard_normal((rows, cols)).astype(np.float32) * 0.05)
    packed[0, :128] = np.arange(128)  # every value code in both nibbles
    return nvfp4.block_rows(packed, scales, multiplier)


@pytest.mark.parametrize("tokens", [1, 12])
@pytest.mark.parametrize("codec", ["FP8", "NVFP4"])
def test_safetensors_codec_rows_match_the_dequantised_reference(codec: str, tokens: int) -> None:
    """FP8 rows (fp32 tile scale + 128 e4m3 values) and NVFP4 rows (multiplier, e4m3 block scales, e2m1
    values) against the codec's reference."""
    e, h, i, k = 4, 256, 384, 2
    gen = np.random.default_rng(tokens)
    make = fp8_rows if codec == "FP8" else nvfp4_rows
    gate_up = torch.from_numpy(np.stack([make(gen, 2 * i, h) for _ in range(e)]))
    down = torch.from_numpy(np.stack([make(gen, h, i) for _ in range(e)]))
    assert kernel_takes(gate_up, down, (codec, codec))
    x = torch.randn(tokens, h)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(tokens)])
    w = torch.rand(tokens, k)
    ours = cpu_experts(x, ids, w, gate_up, down, threads=2, codecs=(codec, codec))
    assert rel_err(ours, stored_reference(x, ids, w, gate_up, down, (codec, codec))) < 1e-5


def test_adversarial_codebook_scales() -> None:
    """MXFP4 e8m0 scales 0, 1 (subnormal halves), 2, 127 and 160; IQ4_XS super-blocks with a zero and a
    subnormal fp16 scale: the kernel (both ways) against the reference, whatever the scale."""
    e, h, i = 3, 256, 256
    mx_gu, mx_dn = random_blocks("MXFP4", e, 2 * i, h, seed=5), random_blocks("MXFP4", e, h, i, seed=6)
    for bank in (mx_gu, mx_dn):
        blocks = bank.view(-1, 17)
        blocks[:, 0] = torch.tensor([0, 1, 2, 127, 160], dtype=torch.uint8).repeat(blocks.shape[0] // 5 + 1)[
            : blocks.shape[0]
        ]
    iq_gu, iq_dn = random_blocks("IQ4_XS", e, 2 * i, h, seed=7), random_blocks("IQ4_XS", e, h, i, seed=8)
    for bank in (iq_gu, iq_dn):
        blocks = bank.view(-1, 136)
        blocks[0::3, :2] = torch.from_numpy(np.frombuffer(np.float16(0.0).tobytes(), np.uint8).copy())
        blocks[1::3, :2] = torch.from_numpy(np.frombuffer(np.float16(6e-8).tobytes(), np.uint8).copy())
    gen = torch.Generator().manual_seed(9)  # a draw of its own: int8's error depends on it
    x, ids, w = (
        torch.randn(2, h, generator=gen) * 1e-3,
        torch.tensor([[0, 1], [2, 0]]),
        torch.rand(2, 2, generator=gen),
    )
    for codec, (gu, dn) in (("MXFP4", (mx_gu, mx_dn)), ("IQ4_XS", (iq_gu, iq_dn))):
        plain = stored_reference(x, ids, w, gu, dn, (codec, codec))
        assert torch.isfinite(plain).all()
        ours = cpu_experts(x, ids, w, gu, dn, threads=2, codecs=(codec, codec))
        assert rel_err(ours, plain) < 1e-5, codec
        act8 = cpu_experts(x, ids, w, gu, dn, threads=2, codecs=(codec, codec), int8_act=True)
        assert rel_err(act8, plain) < 3e-2, codec


@pytest.mark.parametrize("define", ["KQ_PREFETCH=0", "PAIRED_ROWS=0", "SUM_AFTER_BARRIER=1"])
def test_the_k_quant_variants_compute_the_same(tmp_path: Path, define: str) -> None:
    """The K-quant dots' software prefetch (-DKQ_PREFETCH) and two rows read at once (-DPAIRED_ROWS), both on
    in the shipped build, change no result: Q4_K gate_up, Q6_K, Q5_K and Q4_K down against int8
    activations, bit for bit with a build without them; nor does the sum over pairs after a barrier
    (-DSUM_AFTER_BARRIER) instead of per row chunk."""
    from freetoken.runtime.moe.kernels.loader import FLAGS, SOURCES, declare, find_compiler, load_library

    out = tmp_path / "variant.so"
    cmd = [
        find_compiler(),
        *FLAGS,
        f"-D{define}",
        *map(str, SOURCES),
        "-o",
        str(out),
        "-lm",
        "-lpthread",
    ]
    subprocess.run(cmd, check=True, capture_output=True)
    variant = ctypes.CDLL(str(out))
    declare(variant)
    e, h, i = 4, 512, 768
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, h, generator=gen)
    ids, w = torch.tensor([[0, 3], [2, 1]]), torch.rand(2, 2, generator=gen)
    for down_codec in ("Q6_K", "Q5_K", "Q4_K"):
        gate_up = random_blocks("Q4_K", e, 2 * i, h, seed=8)
        down = random_blocks(down_codec, e, h, i, seed=9)
        results = []
        for lib in (load_library(), variant):
            y = torch.empty(2, h)
            run_kernel(lib, x, ids, w, gate_up, down, y, 2, codecs=("Q4_K", down_codec), int8_act=True)
            results.append(y)
        assert torch.equal(results[0], results[1]), down_codec
        assert results[0].abs().max() > 0
