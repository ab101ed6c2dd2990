"""FTW, FreeToken's fast-load layout: tensors 4096-aligned in flat shards, experts pre-merged per layer.

Folder: `ftw.json` (the manifest), `config.json` and the tokenizer files, `data-XXXXX-of-YYYYY.ftw`.
Manifest tensors: {name, kind ("dense" | "gate_up" | "down" | "gate_up_bias" | "down_bias"), layer,
dtype, shape, shard, offset, nbytes, crc32[, codec]}; expert banks are the pool's own layout (gate_up
[E, 2I, H], down [E, H, I]; the biases of experts that have them fp32 [E, 2I] and [E, H]). A bank kept in
a codec's blocks (version 2: "codec": "Q8_0", ...) is dtype uint8 of shape
[E, rows, row bytes], rows as the codec stores them.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from freetoken.errors import FreeTokenError

MANIFEST = "ftw.json"
FORMAT = "freetoken-ftw"
VERSION = 2  # 2: expert banks may be codec blocks
READABLE_VERSIONS = (1, 2)
ALIGNMENT = 4096
SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "freetoken_model.json",  # the random-weights marker of generated models
)
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
STORED_DTYPES = {**DTYPES, "uint8": torch.uint8}  # uint8: a bank of codec blocks


@dataclass(frozen=True)
class TensorEntry:
    name: str
    kind: (
        str  # "dense", "gate_up", "down", or experts' fp32 biases "gate_up_bias" [E, 2I], "down_bias" [E, H]
    )
    layer: int | None
    dtype: str
    shape: tuple[int, ...]
    shard: int
    offset: int
    nbytes: int
    crc32: int
    codec: str | None = None  # a bank of this codec's blocks (dtype uint8)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> TensorEntry:
        return cls(
            raw["name"],
            raw["kind"],
            raw.get("layer"),
            raw["dtype"],
            tuple(raw["shape"]),
            raw["shard"],
            raw["offset"],
            raw["nbytes"],
            raw["crc32"],
            raw.get("codec"),
        )

    def as_json(self) -> dict[str, Any]:
        codec = {"codec": self.codec} if self.codec is not None else {}
        return {
            "name": self.name,
            "kind": self.kind,
            "layer": self.layer,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "shard": self.shard,
            "offset": self.offset,
            "nbytes": self.nbytes,
            "crc32": self.crc32,
            **codec,
        }

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype not in STORED_DTYPES:
            raise FreeTokenError(f"tensor {self.name}: unknown dtype {self.dtype!r} in the FTW manifest")
        return STORED_DTYPES[self.dtype]


def shard_name(index: int, count: int) -> str:
    return f"data-{index + 1:05d}-of-{count:05d}.ftw"


def is_ftw(folder: Path) -> bool:
    return (Path(folder) / MANIFEST).is_file()


HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h


def aligned_empty(
    shape: tuple[int, ...], dtype: torch.dtype, alignment: int = ALIGNMENT, huge: bool = False
) -> torch.Tensor:
    """A host tensor whose data starts on an `alignment` boundary (what direct I/O needs).

    `huge`: start on a 2 MiB boundary and ask the kernel for transparent huge pages before the first
    touch (madvise), so a streaming read of the tensor takes 512 times fewer TLB misses; ignored where
    the call is refused or unknown.
    """
    numel = 1
    for dim in shape:
        numel *= dim
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    huge = huge and nbytes >= HUGE_PAGE
    alignment = max(alignment, HUGE_PAGE) if huge else alignment
    raw = torch.empty(nbytes + alignment, dtype=torch.uint8)
    start = (-raw.data_ptr()) % alignment
    if huge:
        advise_hugepages(raw.data_ptr() + start, nbytes - nbytes % HUGE_PAGE)
    return raw[start : start + nbytes].view(dtype).view(shape)


def advise_hugepages(address: int, nbytes: int) -> bool:
    """madvise(MADV_HUGEPAGE) over [address, address + nbytes), page-aligned; False when refused."""
    return _madvise(address, nbytes, MADV_HUGEPAGE)


def populate_mapping(address: int, nbytes: int) -> bool:
    """madvise(MADV_POPULATE_READ) over the pages holding [address, address + nbytes) of a file mapping:
    the kernel maps them in one call, where a copy out of the mapping would fault them in one page at a
    time (a 3 GB tensor in tmpfs: 0.2 s against ~1.2 s). A large range is cut in chunks mapped by several
    threads at once (page tables fill in parallel; each call leaves the interpreter lock). False where
    refused (kernels before 5.14)."""
    start = address - address % PAGE
    total = nbytes + (address - start)
    chunks = [(start + at, min(POPULATE_CHUNK, total - at)) for at in range(0, total, POPULATE_CHUNK)]
    threads = min(len(chunks), POPULATE_THREADS, os.cpu_count() or 1)
    if threads <= 1:
        return _madvise(start, total, MADV_POPULATE_READ)
    with ThreadPoolExecutor(threads) as pool:
        done = list(pool.map(lambda chunk: _madvise(*chunk, MADV_POPULATE_READ), chunks))
    return all(done)


PAGE = 4096
POPULATE_CHUNK = 64 << 20  # bytes a thread maps in one call
POPULATE_THREADS = 8
MADV_POPULATE_READ = 22  # linux/mman.h, since 5.14


def _madvise(address: int, nbytes: int, advice: int) -> bool:
    import ctypes
    import sys

    if not sys.platform.startswith("linux") or nbytes <= 0:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), advice) == 0
    except (OSError, AttributeError):
        return False


def check_manifest(raw: dict[str, Any], path: Path) -> None:
    if raw.get("format") != FORMAT:
        raise FreeTokenError(f"{path}: not an FTW manifest (format {raw.get('format')!r})")
    if raw.get("version") not in READABLE_VERSIONS:
        versions = " and ".join(map(str, READABLE_VERSIONS))
        raise FreeTokenError(f"{path}: FTW version {raw.get('version')}, this FreeToken reads {versions}")
    for key in ("shards", "tensors", "dtype", "alignment"):
        if key not in raw:
            raise FreeTokenError(f"{path}: manifest lacks {key!r}")
