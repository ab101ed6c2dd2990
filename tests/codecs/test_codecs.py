"""The expert codec registry against gguf's own tables and reference dequantiser (the truth for GGUF
types); bf16/f16/f32 widen exactly; bad rows and unknown types are one-line errors naming them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from freetoken.codecs import CODECS, Codec, codec_for_ggml, get_codec
from freetoken.errors import FreeTokenError

QUANTIZED = [c for c in CODECS.values() if c.block_elements > 1 and c.ggml_type is not None]
# FP8 and NVFP4 have no GGUF type: test_safetensors_codecs.py checks them
SAFETENSORS_ONLY = [name for name, c in CODECS.items() if c.ggml_type is None]


@pytest.mark.parametrize("name", [name for name in CODECS if name not in SAFETENSORS_ONLY])
def test_block_sizes_and_type_ids_are_ggufs(name: str) -> None:
    codec = CODECS[name]
    qtype = GGMLQuantizationType(codec.ggml_type)
    assert qtype.name.lower() == codec.name.lower()
    assert GGML_QUANT_SIZES[qtype] == (codec.block_elements, codec.block_bytes)
    assert codec.tensor_bytes(3, 512) == 3 * 512 // codec.block_elements * codec.block_bytes


@pytest.mark.parametrize("codec", QUANTIZED, ids=lambda c: c.name)
def test_dequantize_is_ggufs_reference_on_raw_blocks(codec: Codec) -> None:
    rng = np.random.default_rng(codec.ggml_type)
    elements = 2 * 256
    raw = rng.integers(0, 256, size=(3, codec.row_bytes(elements)), dtype=np.uint8)
    with np.errstate(all="ignore"):  # random scales overflow to inf in both: the same inf
        got = codec.dequantize(raw, elements)
        want = dequantize(raw, GGMLQuantizationType(codec.ggml_type))
    assert got.shape == (3, elements) and got.dtype == np.float32
    assert np.array_equal(got, want.astype(np.float32), equal_nan=True)


def test_q8_0_round_trip_stays_within_its_step() -> None:
    rng = np.random.default_rng(0)
    weights = rng.standard_normal((4, 256)).astype(np.float32)
    raw = quantize(weights, GGMLQuantizationType.Q8_0)
    back = get_codec("q8_0").dequantize(raw, 256)
    step = np.abs(weights).reshape(4, -1, 32).max(axis=-1, keepdims=True) / 127  # one int8 step a block
    assert np.all(np.abs(back - weights).reshape(4, -1, 32) <= step * 0.51 + 1e-6)


@pytest.mark.parametrize("name", ["bf16", "f16", "f32"])
def test_float_codecs_widen_exactly(name: str) -> None:
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[name]
    values = torch.randn(2, 64).to(dtype)
    raw = values.view(torch.uint8).numpy()
    assert np.array_equal(get_codec(name).dequantize(raw, 64), values.float().numpy())


def test_bad_rows_and_unknown_types_are_one_line_errors() -> None:
    q4 = get_codec("Q4_K")
    with pytest.raises(
        FreeTokenError, match=r"^blk\.0\.ffn_up_exps\.weight: rows of 100 bytes, expected 144"
    ):
        q4.dequantize(np.zeros((2, 100), dtype=np.uint8), 256, "blk.0.ffn_up_exps.weight")
    with pytest.raises(FreeTokenError, match="a row of 100 weights is not a whole number of Q4_K blocks"):
        q4.row_bytes(100)
    with pytest.raises(FreeTokenError, match=r"^unknown expert codec 'q3'; supported: bf16, f16, f32, Q8_0"):
        get_codec("q3")
    with pytest.raises(FreeTokenError, match=r"^w: GGUF tensor type IQ1_S is not supported; supported: bf16"):
        codec_for_ggml(int(GGMLQuantizationType.IQ1_S), "w")
    assert codec_for_ggml(14).name == "Q6_K"


@pytest.mark.parametrize("name", [c.name for c in QUANTIZED if c.name != "MXFP4"])
def test_random_blocks_keep_their_scales_small_and_finite(name: str) -> None:
    """Every block's recorded fp16 scales hold the asked value (gguf's dequantisation stays finite and
    bounded by it); a codec without recorded offsets refuses in one line."""
    codec = get_codec(name)
    out = np.empty((3, codec.row_bytes(512)), dtype=np.uint8)
    codec.random_blocks(out, np.random.default_rng(0), 1e-3)
    blocks = out.reshape(-1, codec.block_bytes)
    for at in codec.scale_offsets:
        assert (blocks[:, at : at + 2].copy().view(np.float16) == np.float16(1e-3)).all()
    values = codec.dequantize(out, 512)
    # at most scale x the largest sub-block scale x the largest quant (127 x 64 covers every one of these)
    assert np.isfinite(values).all() and 0 < np.abs(values).max() < 1e-3 * 127 * 64
    with pytest.raises(FreeTokenError, match="no random blocks for NVFP4"):
        get_codec("NVFP4").random_blocks(out, np.random.default_rng(0), 1e-3)


def test_random_mxfp4_blocks_take_the_nearest_power_of_two() -> None:
    codec = get_codec("MXFP4")
    out = np.empty((2, codec.row_bytes(64)), dtype=np.uint8)
    codec.random_blocks(out, np.random.default_rng(0), 2**-4)
    assert (out.reshape(-1, 17)[:, 0] == 124).all()  # 2^(124 - 128)
    values = codec.dequantize(out, 64)
    assert np.abs(values).max() <= 12 * 2**-4 and np.abs(values).max() > 0
