"""A GGUF file's header in one pass: its key/values and its tensor table, read with `struct` from the mapped
file. The gguf package's reader makes a numpy view per value: ~11 s for a 152k-token vocabulary on 2 cores,
against a fraction of a second here (tests compare every field and tensor with the package's reader).

Layout (little-endian; versions 2 and 3): magic "GGUF", version u32, tensor count u64, key/value count u64;
each key/value a string key, a u32 value type and the value; each tensor a string name, u32 dims, u64 ne per
dim (innermost first), u32 GGML type, u64 offset into the data section, which starts at the next multiple of
`general.alignment` (32 when absent) after the table.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
NUMPY = {"B": np.uint8, "b": np.int8, "H": np.uint16, "h": np.int16, "I": np.uint32, "i": np.int32,
         "f": np.float32, "?": np.bool_, "Q": np.uint64, "q": np.int64, "d": np.float64}  # fmt: skip
STRING, ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 8


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: int
    ne: tuple[int, ...]  # dims, innermost first (numpy shapes are these reversed)
    offset: int  # from the start of the file
    n_bytes: int


@dataclass(frozen=True)
class GgufHeader:
    fields: dict[str, Any]  # key -> int, float, bool, str, a list of those, or None for a skipped array
    tensors: list[TensorInfo]
    data_offset: int


class _Cursor:
    def __init__(self, buf: Any) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> Any:
        value = struct.unpack_from("<" + fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        end = self.take("Q") + self.pos
        if end > len(self.buf):
            raise ValueError("truncated string")
        start, self.pos = self.pos, end
        return bytes(self.buf[start:end]).decode("utf-8", "replace")

    def value(self, kind: int, arrays: bool) -> Any:
        if kind in SCALARS:
            return self.take(SCALARS[kind])
        if kind == STRING:
            return self.string()
        if kind != ARRAY:
            raise ValueError(f"unknown value type {kind}")
        item, count = self.take("I"), self.take("Q")
        if item in SCALARS:
            size = count * struct.calcsize(SCALARS[item])
            if self.pos + size > len(self.buf):
                raise ValueError("truncated array")
            dtype = NUMPY[SCALARS[item]]
            values = np.frombuffer(self.buf, dtype, count, self.pos).tolist() if arrays else None
            self.pos += size
            return values
        values = [self.value(item, arrays) for _ in range(count)]
        return values if arrays else None


def read_header(path: Path, arrays: bool = True) -> GgufHeader:
    """The header of one GGUF file; `arrays=False` skips building array values (they read as None).
    Raises ValueError (or struct.error) for a file that is not a whole GGUF header."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError("no GGUF magic")
        cursor = _Cursor(buf)
        cursor.pos = 4
        if (version := cursor.take("I")) not in (2, 3):
            raise ValueError(f"GGUF version {version & 0xFFFF} (or a big-endian file), not 2 or 3")
        tensor_count, kv_count = cursor.take("Q"), cursor.take("Q")
        fields = {}
        for _ in range(kv_count):
            key = cursor.string()
            fields[key] = cursor.value(cursor.take("I"), arrays)
        table = []
        for _ in range(tensor_count):
            name, dims = cursor.string(), cursor.take("I")
            if dims > MAX_DIMS:
                raise ValueError(f"tensor {name}: {dims} dimensions")
            ne = tuple(cursor.take("Q") for _ in range(dims))
            table.append((name, cursor.take("I"), ne, cursor.take("Q")))
        alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment!r} is not a power of two")
        data_offset = -(-cursor.pos // alignment) * alignment
        size = len(buf)
    tensors = []
    for name, kind, ne, offset in table:
        try:
            qtype = GGMLQuantizationType(kind)
        except ValueError:
            raise ValueError(f"tensor {name}: unknown GGML type {kind}") from None
        block, type_size = GGML_QUANT_SIZES[qtype]
        if ne and ne[0] % block:
            raise ValueError(
                f"tensor {name}: rows of {ne[0]} weights are not whole {qtype.name} blocks of {block}"
            )
        info = TensorInfo(name, kind, ne, data_offset + offset, math.prod(ne) // block * type_size)
        if info.offset + info.n_bytes > size:
            raise ValueError(
                f"tensor {name} ({qtype.name}, {info.n_bytes} bytes) runs past the end of the file "
                "(a truncated download?)"
            )
        tensors.append(info)
    return GgufHeader(fields, tensors, data_offset)
