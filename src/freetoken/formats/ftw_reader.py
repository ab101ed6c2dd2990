"""Read an FTW folder: sizes checked against the manifest up front, tensors read straight into their
destination buffers with parallel direct I/O (buffered reads where O_DIRECT is refused)."""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from freetoken.errors import FreeTokenError
from freetoken.formats.ftw import MANIFEST, TensorEntry, check_manifest
from freetoken.formats.range_read import Piece, RangeReader, byte_views


class FtwCheckpoint:
    def __init__(self, folder: Path, threads: int | None = None) -> None:
        self.folder = Path(folder)
        path = self.folder / MANIFEST
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise FreeTokenError(f"{path}: unreadable FTW manifest ({exc})") from None
        check_manifest(raw, path)
        self.manifest: dict[str, Any] = raw
        self.entries = [TensorEntry.from_json(t) for t in raw["tensors"]]
        self.by_name = {e.name: e for e in self.entries}
        self.shards = [self.folder / s["file"] for s in raw["shards"]]
        self._check_sizes()
        self.reader = RangeReader(threads)

    def _check_sizes(self) -> None:
        sizes = []
        for path in self.shards:
            if not path.exists():
                raise FreeTokenError(f"{self.folder}: shard {path.name} is missing")
            sizes.append(path.stat().st_size)
        for entry in self.entries:
            end = entry.offset + entry.nbytes
            if end > sizes[entry.shard]:
                raise FreeTokenError(
                    f"{self.folder}: shard {self.shards[entry.shard].name} is truncated: tensor {entry.name} "
                    f"needs bytes up to {end}, the file has {sizes[entry.shard]}"
                )

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @property
    def direct_reads(self) -> int:
        return self.reader.direct_reads

    @property
    def buffered_reads(self) -> int:
        return self.reader.buffered_reads

    def read_into(self, entry: TensorEntry, dest: torch.Tensor) -> None:
        """Read one tensor into `dest` (a contiguous host tensor of the entry's size)."""
        if not dest.is_contiguous() or dest.numel() * dest.element_size() != entry.nbytes:
            raise ValueError(f"destination for {entry.name} does not match its {entry.nbytes} bytes")
        self.reader.read([Piece(self.shards[entry.shard], entry.offset, view) for view in byte_views(dest)])

    def read(self, entry: TensorEntry) -> torch.Tensor:
        from freetoken.formats.ftw import aligned_empty

        out = aligned_empty(entry.shape, entry.torch_dtype)
        self.read_into(entry, out)
        return out

    def verify(self, progress: Callable[[int, int], None] | None = None) -> list[str]:
        """Names of tensors whose bytes do not match their checksum (buffered reads, 64 MiB at a time)."""
        bad, done, total = [], 0, self.nbytes
        for entry in self.entries:
            crc = 0
            with open(self.shards[entry.shard], "rb") as handle:
                handle.seek(entry.offset)
                left = entry.nbytes
                while left:
                    piece = handle.read(min(left, 64 << 20))
                    if not piece:
                        break
                    crc = zlib.crc32(piece, crc)
                    left -= len(piece)
            if crc != entry.crc32 or left:
                bad.append(entry.name)
            done += entry.nbytes
            if progress is not None:
                progress(done, total)
        return bad
