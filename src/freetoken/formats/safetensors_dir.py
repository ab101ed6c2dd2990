"""A local folder of safetensors: one file, or shards listed by `model.safetensors.index.json`.

Headers are read up front (names, shapes, dtypes); tensors are read one at a time, on demand, so a loader
never holds more than one checkpoint tensor beside its destination.

Quantized weights (FP8 block-scaled, NVFP4: quantized_weights.py) read as one logical tensor each: `read`
dequantises it, `read_stored` gives its codec's rows that the pool can keep; their scale tensors are not
listed.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from freetoken.codecs import CODECS, Codec
from freetoken.errors import FreeTokenError
from freetoken.formats.quantized_weights import find_quantized

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
        self._quantized = find_quantized(self._dtypes, self._shapes)  # logical name -> its parts
        hidden = {part for q in self._quantized.values() for part in q.parts}
        self._names = [name for name in self._handles if name not in hidden]
        self._names += [name for name in self._quantized if name not in self._handles or name in hidden]

    def names(self) -> list[str]:
        return list(self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        quantized = self._quantized.get(name)
        return quantized.shape if quantized is not None else self._shapes[name]

    def nbytes(self, name: str) -> int:
        quantized = self._quantized.get(name)
        if quantized is not None:
            return sum(self._stored_bytes(part) for part in quantized.parts)
        return self._stored_bytes(name)

    def _stored_bytes(self, name: str) -> int:
        numel = 1
        for dim in self._shapes[name]:
            numel *= dim
        return numel * _ELEMENT_SIZE.get(self._dtypes[name], 4)

    def _get(self, name: str) -> torch.Tensor:
        try:
            return self._handles[name].get_tensor(name)
        except SafetensorError as exc:
            raise FreeTokenError(f"{self.model_dir}: cannot read tensor {name} ({exc})") from None

    def read(self, name: str) -> torch.Tensor:
        quantized = self._quantized.get(name)
        if quantized is not None:
            return self._checked(name, lambda: quantized.dequantize(self._get))
        if self._dtypes.get(name) in ("F8_E4M3", "F8_E5M2"):
            raise FreeTokenError(
                f"{self.model_dir}: tensor {name} is FP8 without a {name}_scale_inv tile grid; only "
                "block-scaled FP8 checkpoints are supported"
            )
        return self._get(name)

    def codec(self, name: str) -> Codec:
        """How the tensor is stored: its quantized codec (FP8, NVFP4), else its float dtype's codec."""
        quantized = self._quantized.get(name)
        if quantized is not None:
            return CODECS[quantized.codec]
        codec = _FLOAT_CODECS.get(self._dtypes[name])
        if codec is None:
            raise FreeTokenError(f"{self.model_dir}: tensor {name} is {self._dtypes[name]}, no weight codec")
        return CODECS[codec]

    def read_stored(self, name: str) -> Any:
        """A quantized weight as its codec's rows, uint8 [R, row bytes] (C whole blocks of the codec)."""
        quantized = self._quantized[name]
        CODECS[quantized.codec].row_bytes(quantized.shape[-1])  # whole blocks, or a one-line error
        return self._checked(name, lambda: quantized.rows(self._get))

    def _checked(self, name: str, read: Any) -> Any:
        try:
            return read()
        except FreeTokenError as exc:
            raise FreeTokenError(f"{self.model_dir}: {exc}") from None

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> SafetensorsCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
