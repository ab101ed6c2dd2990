"""A local folder of safetensors: one file, or shards listed by `model.safetensors.index.json`.

Headers are read up front (names, shapes, dtypes); tensors are read one at a time, on demand, so a loader
never holds more than one checkpoint tensor beside its destination.

FP8 block-scaled weights (an F8_E4M3 `X.weight` with its `X.weight_scale_inv` tile grid, as Qwen3-FP8 and
DeepSeek-V3 ship them) read as one logical tensor: `read` dequantises it, `read_stored` gives the FP8
codec's rows (codecs/fp8.py) that the pool can keep; the scale grids are not listed as tensors.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from freetoken.codecs import CODECS, Codec
from freetoken.codecs import fp8 as fp8_codec
from freetoken.errors import FreeTokenError

INDEX_NAME = "model.safetensors.index.json"
_ELEMENT_SIZE = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
}
_FLOAT_CODECS = {"BF16": "bf16", "F16": "f16", "F32": "f32"}
SCALE_SUFFIX = "_scale_inv"


def shard_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a model folder, in index order."""
    index = model_dir / INDEX_NAME
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise FreeTokenError(
                f"{index}: not a valid safetensors index (needs a 'weight_map' object)"
            ) from None
        files = [model_dir / name for name in dict.fromkeys(weight_map.values())]
        for path in files:
            if not path.exists():
                raise FreeTokenError(f"{index}: lists shard {path.name}, which is missing")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FreeTokenError(f"{model_dir}: no *.safetensors files")
    return files


class SafetensorsCheckpoint:
    def __init__(self, model_dir: Path) -> None:
        self.model_dir = Path(model_dir)
        self._stack = ExitStack()
        self._handles: dict[str, Any] = {}  # tensor name -> open file handle
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, str] = {}
        for path in shard_files(self.model_dir):
            try:
                handle = self._stack.enter_context(safe_open(str(path), framework="pt"))
            except (SafetensorError, OSError) as exc:
                self.close()
                raise FreeTokenError(f"{path}: not a readable safetensors file ({exc})") from None
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not mappings
                if name in self._handles:
                    self.close()
                    raise FreeTokenError(f"{path}: tensor {name} also appears in another shard")
                sl = handle.get_slice(name)
                self._handles[name] = handle
                self._shapes[name] = tuple(sl.get_shape())
                self._dtypes[name] = sl.get_dtype()
        # FP8 weight -> its tile scales
        self._scales = {
            name: name + SCALE_SUFFIX
            for name, dtype in self._dtypes.items()
            if dtype == "F8_E4M3" and name + SCALE_SUFFIX in self._handles
        }
        hidden = set(self._scales.values())
        self._names = [name for name in self._handles if name not in hidden]

    def names(self) -> list[str]:
        return list(self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def nbytes(self, name: str) -> int:
        numel = 1
        for dim in self._shapes[name]:
            numel *= dim
        return numel * _ELEMENT_SIZE.get(self._dtypes[name], 4)

    def _get(self, name: str) -> torch.Tensor:
        try:
            return self._handles[name].get_tensor(name)
        except SafetensorError as exc:
            raise FreeTokenError(f"{self.model_dir}: cannot read tensor {name} ({exc})") from None

    def _fp8(self, name: str) -> tuple[Any, Any]:
        """(e4m3 bytes [R, C] uint8, tile scales) of an FP8 weight, as numpy arrays."""
        values = self._get(name).view(torch.uint8).numpy()
        scales = self._get(self._scales[name]).float().numpy()
        rows, cols = values.shape
        if scales.shape != (-(-rows // fp8_codec.TILE), -(-cols // fp8_codec.TILE)):
            raise FreeTokenError(
                f"{self.model_dir}: {self._scales[name]} has shape {list(scales.shape)}, expected one scale "
                f"per {fp8_codec.TILE}x{fp8_codec.TILE} tile of {name} {[rows, cols]}"
            )
        return values, scales

    def read(self, name: str) -> torch.Tensor:
        if name in self._scales:
            return torch.from_numpy(fp8_codec.dequantize_tiles(*self._fp8(name)))
        if self._dtypes.get(name) == "F8_E4M3":
            raise FreeTokenError(
                f"{self.model_dir}: tensor {name} is FP8 without a {name + SCALE_SUFFIX} tile grid; only "
                "block-scaled FP8 checkpoints are supported"
            )
        return self._get(name)

    def codec(self, name: str) -> Codec:
        """How the tensor is stored: FP8 for block-scaled weights, else its float dtype's codec."""
        if name in self._scales:
            return CODECS["FP8"]
        codec = _FLOAT_CODECS.get(self._dtypes[name])
        if codec is None:
            raise FreeTokenError(f"{self.model_dir}: tensor {name} is {self._dtypes[name]}, no weight codec")
        return CODECS[codec]

    def read_stored(self, name: str) -> Any:
        """An FP8 weight as the codec's rows, uint8 [R, C / 128 · 132] (C a multiple of 128)."""
        values, scales = self._fp8(name)
        CODECS["FP8"].row_bytes(values.shape[-1])  # whole blocks, or a one-line error
        return fp8_codec.block_rows(values, scales)

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> SafetensorsCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
