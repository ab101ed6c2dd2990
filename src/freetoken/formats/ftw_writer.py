"""Write FTW shards: each tensor at a 4096-aligned offset, checksummed as it is written."""

from __future__ import annotations

import errno
import json
import os
import zlib
from pathlib import Path
from typing import Any

import torch

from freetoken.errors import FreeTokenError
from freetoken.formats.ftw import ALIGNMENT, FORMAT, MANIFEST, VERSION, TensorEntry, shard_name

_CHUNK = 64 << 20


def fsync_path(path: Path) -> None:
    """fsync a file or a folder (a folder's entry list is what makes a rename durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FtwWriter:
    """open -> add()* -> finish(); shards are named once their count is known."""

    def __init__(self, folder: Path, shard_bytes: int, label: Path | None = None) -> None:
        self.folder = Path(folder)
        self.label = label or self.folder  # the path errors name (the final folder, not the temporary one)
        self.shard_bytes = shard_bytes
        self.entries: list[TensorEntry] = []
        self._files: list[Path] = []
        self._handle: Any = None
        self._offset = 0
        self._finished = False

    def _open_shard(self) -> None:
        if self._handle is not None:
            self._handle.close()
        path = self.folder / f"shard-{len(self._files):05d}.partial"
        self._files.append(path)
        self._handle = open(path, "wb")  # noqa: SIM115 - kept open across add() calls
        self._offset = 0

    def add(
        self,
        name: str,
        tensor: torch.Tensor,
        kind: str = "dense",
        layer: int | None = None,
        codec: str | None = None,
    ) -> None:
        """`codec`: `tensor` is a uint8 bank of that codec's blocks."""
        if self._finished:
            raise RuntimeError("FtwWriter.add after finish")
        data = tensor.detach().contiguous().view(torch.uint8).reshape(-1).numpy()  # a view, no copy
        if self._handle is None or (self._offset and self._offset + len(data) > self.shard_bytes):
            self._open_shard()
        crc = 0
        try:
            for start in range(0, len(data), _CHUNK):
                piece = memoryview(data[start : start + _CHUNK])
                crc = zlib.crc32(piece, crc)
                self._handle.write(piece)
            pad = (-len(data)) % ALIGNMENT
            self._handle.write(b"\0" * pad)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise FreeTokenError(f"{self.label}: disk full while writing {name}") from None
            raise FreeTokenError(f"{self.label}: cannot write {name} ({exc.strerror})") from None
        dtype = str(tensor.dtype).removeprefix("torch.")
        self.entries.append(
            TensorEntry(
                name,
                kind,
                layer,
                dtype,
                tuple(tensor.shape),
                len(self._files) - 1,
                self._offset,
                len(data),
                crc,
                codec,
            )
        )
        self._offset += len(data) + pad

    def finish(self, dtype: str, architecture: str, config: dict[str, Any]) -> dict[str, Any]:
        """Close, name and fsync the shards, then write the manifest (last: its presence means whole)."""
        if self._finished:
            raise RuntimeError("FtwWriter.finish twice")
        if self._handle is not None:
            self._handle.close()
        count = len(self._files)
        shards = []
        for index, path in enumerate(self._files):
            final = self.folder / shard_name(index, count)
            path.rename(final)
            fsync_path(final)
            shards.append({"file": final.name, "nbytes": final.stat().st_size})
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "architecture": architecture,
            "dtype": dtype,
            "alignment": ALIGNMENT,
            "checksum": "crc32",
            "config": config,
            "shards": shards,
            "tensors": [entry.as_json() for entry in self.entries],
        }
        path = self.folder / MANIFEST
        path.write_text(json.dumps(manifest, indent=1) + "\n")
        fsync_path(path)
        self._finished = True
        return manifest
