"""Expert codecs, one registry: how a weight row is stored (blocks of elements, bytes per block) and its
plain reference dequantiser. The layer below `formats/` and `runtime/` (both will use it; it imports
neither): a pool or a file only needs a codec's bytes per row to place experts, whatever the format.

For GGUF types the truth is `gguf.quants.dequantize` (llama.cpp's own reference, in numpy), which each
GGUF codec's `dequantize` calls; bf16/f16/f32 are exact widenings. FP8 (block-scaled e4m3, from
safetensors checkpoints) and NVFP4 have no GGUF type: `fp8.py` and `nvfp4.py` hold their layouts and
references.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from freetoken.errors import FreeTokenError


@dataclass(frozen=True)
class Codec:
    name: str  # what `--json` and error messages say ("bf16", "Q4_K", ...)
    block_elements: int  # elements of a row per block
    block_bytes: int  # bytes per block
    ggml_type: int | None = None  # the GGUF tensor type, when the codec is one
    scale_offsets: tuple[int, ...] = ()  # byte offsets of a block's fp16 (super-block) scales
    e8m0_offsets: tuple[int, ...] = ()  # byte offsets of a block's e8m0 scales (2^(e − 128), MXFP4's)

    def row_bytes(self, elements: int) -> int:
        """Bytes of one stored row of `elements` weights (a whole number of blocks)."""
        if elements <= 0 or elements % self.block_elements:
            raise FreeTokenError(
                f"a row of {elements} weights is not a whole number of {self.name} blocks "
                f"({self.block_elements} weights each)"
            )
        return elements // self.block_elements * self.block_bytes

    def tensor_bytes(self, rows: int, elements: int) -> int:
        """Bytes of a [rows, elements] weight matrix (an expert's projection) as stored."""
        return rows * self.row_bytes(elements)

    def dequantize(self, raw: np.ndarray, elements: int, name: str = "tensor") -> np.ndarray:
        """raw: uint8 [..., row_bytes(elements)] as stored -> float32 [..., elements]. `name` is the
        tensor's, for the error when the bytes are not whole rows."""
        width = self.row_bytes(elements)
        data = np.ascontiguousarray(raw, dtype=np.uint8)
        if data.ndim == 0 or data.shape[-1] != width:
            raise FreeTokenError(
                f"{name}: rows of {data.shape[-1] if data.ndim else 0} bytes, expected {width} "
                f"for {elements} {self.name} weights (a truncated block array?)"
            )
        if self.name == "bf16":
            return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        if self.name == "f16":
            return data.view(np.float16).astype(np.float32)
        if self.name == "f32":
            return data.view(np.float32).copy()
        if self.name == "FP8":
            from freetoken.codecs.fp8 import dequantize_rows

            return dequantize_rows(data)
        if self.name == "NVFP4":
            from freetoken.codecs import nvfp4

            return nvfp4.dequantize_rows(data)
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize

        assert self.ggml_type is not None
        return dequantize(data, GGMLQuantizationType(self.ggml_type)).astype(np.float32, copy=False)

    def random_blocks(
        self, out: np.ndarray, rng: np.random.Generator, scale: float, signed: bool = False
    ) -> np.ndarray:
        """Fill `out` (uint8 [..., whole blocks]) with random blocks: every bit pattern of the quants and
        packed sub-block scales, every fp16 scale set to `scale` (small and finite), or with `signed` a
        block's fp16 scales (d, and dmin where there is one) negated together at random, so the block's
        weights are negated: uniform quants under unsigned sub-block scales and mins have the scale's sign
        as mean (Q4_K's d·sc·7.5 − dmin·m), which signed blocks cancel. Returns `out`."""
        if not self.scale_offsets and not self.e8m0_offsets:
            raise FreeTokenError(f"no random blocks for {self.name}: its scale offsets are not recorded")
        blocks = out.reshape(-1, self.block_bytes)
        blocks[:] = rng.integers(0, 256, blocks.shape, dtype=np.uint8)
        for at in self.scale_offsets:
            blocks[:, at : at + 2] = np.frombuffer(np.float16(scale).tobytes(), np.uint8)
        for at in self.e8m0_offsets:  # the power of two nearest `scale`
            blocks[:, at] = np.uint8(128 + round(float(np.log2(scale))))
        if signed:
            negate = rng.integers(0, 2, len(blocks), dtype=np.uint8) << 7  # the fp16 sign bits
            for at in self.scale_offsets:  # little-endian: the high byte's top bit
                blocks[:, at + 1] ^= negate
        return out

    def quantize(self, values: np.ndarray, name: str = "tensor") -> np.ndarray:
        """float [..., n] -> uint8 [..., row_bytes(n)] blocks by the reference quantizer (gguf's, where it
        has one for this codec: Q8_0, bf16, f16; fp8.py's for FP8); `name` is the tensor's, for the errors."""
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import quantize

        data = np.ascontiguousarray(values, dtype=np.float32)
        self.row_bytes(data.shape[-1])  # a whole number of blocks, or a one-line error
        if self.name == "FP8":
            from freetoken.codecs.fp8 import quantize_rows

            return quantize_rows(data)
        assert self.ggml_type is not None
        try:
            out = quantize(data, GGMLQuantizationType(self.ggml_type))
        except NotImplementedError:
            raise FreeTokenError(f"{name}: no reference quantizer for {self.name}") from None
        return np.ascontiguousarray(out).view(np.uint8).reshape(*data.shape[:-1], -1)


def _ggml(
    name: str,
    type_id: int,
    block_elements: int,
    block_bytes: int,
    scale_offsets: tuple[int, ...] = (),
    e8m0_offsets: tuple[int, ...] = (),
) -> Codec:
    return Codec(name, block_elements, block_bytes, type_id, scale_offsets, e8m0_offsets)


# name -> codec, in the order the issue that brings them lists them (GGML type ids and block sizes as
# gguf.constants has them; a test checks they agree)
CODECS: dict[str, Codec] = {
    codec.name: codec
    for codec in (
        _ggml("bf16", 30, 1, 2),
        _ggml("f16", 1, 1, 2),
        _ggml("f32", 0, 1, 4),
        _ggml("Q8_0", 8, 32, 34, (0,)),
        _ggml("Q4_K", 12, 256, 144, (0, 2)),
        _ggml("Q6_K", 14, 256, 210, (208,)),
        _ggml("Q5_K", 13, 256, 176, (0, 2)),
        _ggml("IQ4_XS", 23, 256, 136, (0,)),
        _ggml("MXFP4", 39, 32, 17, e8m0_offsets=(0,)),
        _ggml("IQ3_S", 21, 256, 110, (0,)),
        _ggml("IQ3_XXS", 18, 256, 98, (0,)),
        _ggml("Q4_0", 2, 32, 18, (0,)),
        _ggml("Q5_0", 6, 32, 22, (0,)),
        _ggml("Q2_K", 10, 256, 84, (80, 82)),
        _ggml("Q3_K", 11, 256, 110, (108,)),
        _ggml("IQ2_XXS", 16, 256, 66, (0,)),
        _ggml("IQ2_XS", 17, 256, 74, (0,)),
        _ggml("IQ4_NL", 20, 32, 18, (0,)),
        _ggml("Q4_1", 3, 32, 20, (0, 2)),
        _ggml("Q5_1", 7, 32, 24, (0, 2)),
        Codec("FP8", 128, 132),  # block-scaled e4m3 rows: fp32 scale + 128 values (codecs/fp8.py)
        Codec("NVFP4", 128, 76),  # multiplier, 8 e4m3 block scales, 64 bytes of e2m1 (codecs/nvfp4.py)
    )
}


def get_codec(name: str) -> Codec:
    codec = CODECS.get(name) or next((c for c in CODECS.values() if c.name.lower() == name.lower()), None)
    if codec is None:
        raise FreeTokenError(f"unknown expert codec {name!r}; supported: {', '.join(CODECS)}")
    return codec


def codec_for_ggml(type_id: int, tensor: str = "tensor") -> Codec:
    """The codec of a GGUF tensor type; an unsupported one names the tensor, the type and the supported."""
    for codec in CODECS.values():
        if codec.ggml_type == type_id:
            return codec
    try:
        from gguf.constants import GGMLQuantizationType

        type_name = GGMLQuantizationType(type_id).name
    except ValueError:
        type_name = f"type {type_id}"
    raise FreeTokenError(
        f"{tensor}: GGUF tensor type {type_name} is not supported; supported: {', '.join(CODECS)}"
    )
