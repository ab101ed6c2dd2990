"""Read an FTW folder: sizes checked against the manifest up front, tensors read straight into their
destination buffers with parallel direct I/O (buffered reads where O_DIRECT is refused)."""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from freetoken.errors import FreeTokenError
from freetoken.formats.ftw import ALIGNMENT, MANIFEST, TensorEntry, check_manifest

_CHUNK = 32 << 20  # bytes per read request; requests of one tensor run in parallel


class FtwCheckpoint:
    def __init__(self, folder: Path, threads: int = 8) -> None:
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
        self.threads = threads
        self.direct_reads = 0
        self.buffered_reads = 0

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

    def _read_range(self, path: Path, offset: int, view: memoryview) -> None:
        """Fill `view` from `path` at `offset`: O_DIRECT for the aligned body when allowed."""
        length = len(view)
        body = length - length % ALIGNMENT
        address = np.frombuffer(view, dtype=np.uint8).ctypes.data if length else 0
        done = 0
        if body and offset % ALIGNMENT == 0 and address % ALIGNMENT == 0 and hasattr(os, "O_DIRECT"):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError:
                fd = -1
            if fd >= 0:
                try:
                    while done < body:
                        got = os.preadv(fd, [view[done:body]], offset + done)
                        if got <= 0:
                            break
                        done += got
                    self.direct_reads += 1
                except OSError:
                    done = 0  # the filesystem refused direct I/O for this request: read it buffered
                finally:
                    os.close(fd)
        if done < length:
            with open(path, "rb", buffering=0) as handle:
                while done < length:
                    got = os.preadv(handle.fileno(), [view[done:]], offset + done)
                    if got <= 0:
                        raise FreeTokenError(f"{path}: unexpected end of file")
                    done += got
            self.buffered_reads += 1

    def read_into(self, entry: TensorEntry, dest: torch.Tensor) -> None:
        """Read one tensor into `dest` (a contiguous host tensor of the entry's size)."""
        if not dest.is_contiguous() or dest.numel() * dest.element_size() != entry.nbytes:
            raise ValueError(f"destination for {entry.name} does not match its {entry.nbytes} bytes")
        view = memoryview(dest.view(torch.uint8).reshape(-1).numpy())
        path = self.shards[entry.shard]
        starts = range(0, entry.nbytes, _CHUNK)
        if len(starts) == 1:
            self._read_range(path, entry.offset, view)
            return
        with ThreadPoolExecutor(self.threads) as pool:
            list(pool.map(lambda s: self._read_range(path, entry.offset + s, view[s : s + _CHUNK]), starts))

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
