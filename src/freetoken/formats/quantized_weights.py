"""Quantized weights in safetensors checkpoints: which tensors together make one logical weight, and how
to read it dequantised or as a codec's rows (codecs/fp8.py, codecs/nvfp4.py).

  FP8 block-scaled (Qwen3-FP8, DeepSeek-V3): `X.weight` F8_E4M3 [R, C] + `X.weight_scale_inv`
      [⌈R/128⌉, ⌈C/128⌉]
  NVFP4, ModelOpt: `X.weight` U8 [R, C/2] + `X.weight_scale` F8_E4M3 [R, C/16] + `X.weight_scale_2` (global
      multiplier) [+ `X.input_scale`]
  NVFP4, compressed-tensors: `X.weight_packed` U8 + `X.weight_scale` + `X.weight_global_scale` (a divisor)
      [+ `X.input_global_scale`]; the logical weight is `X.weight`
  MXFP4, gpt-oss: `X_blocks` U8 [E, R, C/32, 16] + `X_scales` U8 [E, R, C/32] (codecs/mxfp4.py); the
      logical weight `X` is [E, C, R], as transformers holds it dequantised (and a bf16 checkpoint stores it)
  DeepSeek-V4 as published: FP4 experts `X.weight` U8/I8 [R, C/2] (weights 2j and 2j + 1 in byte j's low and
      high nibble, MXFP4's codes) + `X.scale` e8m0 [R, C/32], read as MXFP4 rows; FP8 weights `X.weight`
      F8_E4M3 [R, C] + `X.scale` e8m0 [⌈R/128⌉, ⌈C/128⌉] (2^(s − 127) per tile)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from freetoken.codecs import CODECS, fp8, mxfp4, nvfp4
from freetoken.errors import FreeTokenError

Reader = Callable[[str], torch.Tensor]


@dataclass(frozen=True)
class QuantizedWeight:
    codec: str  # "FP8", "NVFP4" or "MXFP4"
    values: str  # the tensor holding the quantized values
    scale: str  # its block scales
    global_scale: str | None  # NVFP4's per-tensor scale
    divides: bool  # compressed-tensors: w = fp4 · scale / global
    shape: tuple[int, ...]  # the logical [R, C] ([E, C, R] for gpt-oss's MXFP4)
    parts: tuple[str, ...]  # every checkpoint tensor it consumes
    e8m0_scale: bool = False  # FP8 tiles scaled by e8m0 bytes (DeepSeek-V4's), not fp32 inverses

    def dequantize(self, get: Reader) -> torch.Tensor:
        if self.codec == "MXFP4" and len(self.shape) == 2:  # [R, C] rows as published
            return torch.from_numpy(CODECS["MXFP4"].dequantize(self.rows(get), self.shape[-1], self.values))
        if self.codec == "MXFP4":
            rows = self.rows(get)  # [E, R, G · 17]
            values = CODECS["MXFP4"].dequantize(rows, self.shape[-2], self.values)  # [E, R, C]
            return torch.from_numpy(values).transpose(-1, -2).contiguous()
        if self.codec == "FP8":
            return torch.from_numpy(fp8.dequantize_tiles(*self._fp8(get)))
        return torch.from_numpy(nvfp4.dequantize_packed(*self._nvfp4(get)))

    def rows(self, get: Reader) -> np.ndarray:
        """The codec's rows, uint8 [R, row bytes] ([E, R, row bytes] for MXFP4)."""
        if self.codec == "MXFP4":
            blocks = get(self.values).view(torch.uint8).numpy()
            scales = get(self.scale).view(torch.uint8).numpy()
            if len(self.shape) == 2:  # [R, C/2] packed pairs -> [R, C/32, 16]
                blocks = blocks.reshape(blocks.shape[0], -1, mxfp4.BLOCK // 2)
            try:
                return mxfp4.gguf_rows(blocks, scales)
            except ValueError as exc:
                raise FreeTokenError(f"{self.values}: {exc}") from None
        if self.codec == "FP8":
            return fp8.block_rows(*self._fp8(get))
        return nvfp4.block_rows(*self._nvfp4(get))

    def _fp8(self, get: Reader) -> tuple[np.ndarray, np.ndarray]:
        values = get(self.values).view(torch.uint8).numpy()
        if self.e8m0_scale:
            scales = np.exp2(get(self.scale).view(torch.uint8).numpy().astype(np.float32) - 127.0)
        else:
            scales = get(self.scale).float().numpy()
        rows, cols = values.shape
        if scales.shape != (-(-rows // fp8.TILE), -(-cols // fp8.TILE)):
            raise FreeTokenError(
                f"{self.scale} has shape {list(scales.shape)}, expected one scale per {fp8.TILE}x{fp8.TILE} "
                f"tile of {self.values} {[rows, cols]}"
            )
        return values, scales

    def _nvfp4(self, get: Reader) -> tuple[np.ndarray, np.ndarray, float]:
        packed, scales = get(self.values).numpy(), get(self.scale).view(torch.uint8).numpy()
        if scales.shape != (packed.shape[0], packed.shape[1] * 2 // nvfp4.BLOCK):
            raise FreeTokenError(
                f"{self.scale} has shape {list(scales.shape)}, expected one scale per {nvfp4.BLOCK} weights "
                f"of {self.values} {[packed.shape[0], packed.shape[1] * 2]}"
            )
        assert self.global_scale is not None
        value = float(get(self.global_scale).float().reshape(-1)[0])
        return packed, scales, (1.0 / value if self.divides else value)


def find_quantized(dtypes: dict[str, str], shapes: dict[str, tuple[int, ...]]) -> dict[str, QuantizedWeight]:
    """Logical weight name -> how it is stored, for every quantized weight among a checkpoint's tensors."""
    out: dict[str, QuantizedWeight] = {}
    for name, dtype in dtypes.items():
        if (
            dtype == "U8"
            and name.endswith("_blocks")
            and dtypes.get(name[: -len("blocks")] + "scales") == "U8"
        ):
            base, shape = name[: -len("_blocks")], shapes[name]  # [E, R, G, 16]
            if len(shape) == 4:
                scale = base + "_scales"
                logical = (shape[0], shape[2] * mxfp4.BLOCK, shape[1])
                out[base] = QuantizedWeight("MXFP4", name, scale, None, False, logical, (name, scale))
            continue
        base, _, leaf = name.rpartition(".")
        e8m0 = dtypes.get(f"{base}.scale") in ("U8", "F8_E8M0")
        if leaf == "weight" and e8m0 and dtype in ("U8", "I8") and len(shapes[name]) == 2:  # V4's FP4
            rows, half = shapes[name]
            scale = f"{base}.scale"
            out[name] = QuantizedWeight("MXFP4", name, scale, None, False, (rows, 2 * half), (name, scale))
            continue
        if leaf == "weight" and e8m0 and dtype == "F8_E4M3":  # V4's FP8, e8m0 tile scales
            out[name] = QuantizedWeight(
                "FP8", name, f"{base}.scale", None, False, shapes[name], (name, f"{base}.scale"), True
            )
            continue
        if dtype == "F8_E4M3" and name + "_scale_inv" in dtypes:
            rows, cols = shapes[name]
            out[name] = QuantizedWeight("FP8", name, name + "_scale_inv", None, False, (rows, cols),
                                        (name, name + "_scale_inv"))  # fmt: skip
            continue
        if dtype != "U8" or len(shapes[name]) != 2:
            continue
        base, _, leaf = name.rpartition(".")
        scale = f"{base}.weight_scale"
        if leaf == "weight" and scale in dtypes and f"{base}.weight_scale_2" in dtypes:
            glob, divides, extra, logical = f"{base}.weight_scale_2", False, f"{base}.input_scale", name
        elif leaf == "weight_packed" and scale in dtypes and f"{base}.weight_global_scale" in dtypes:
            glob, divides, extra, logical = (
                f"{base}.weight_global_scale",
                True,
                f"{base}.input_global_scale",
                f"{base}.weight",
            )
        else:
            continue
        rows, half = shapes[name]
        parts = (name, scale, glob) + ((extra,) if extra in dtypes else ())
        out[logical] = QuantizedWeight("NVFP4", name, scale, glob, divides, (rows, 2 * half), parts)
    return out
