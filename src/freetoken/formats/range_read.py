"""Byte ranges of files read straight into host buffers by several threads at once (FTW shards, GGUF
tensors that need no conversion): direct I/O for the aligned body of a range where the filesystem allows it,
buffered reads elsewhere. No file mapping is involved, so nothing pays for page tables of the source:
the kernel copies from its cache (or the disk) into the buffer, and each request leaves the interpreter
lock, so the requests run in parallel.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from freetoken.errors import FreeTokenError
from freetoken.formats.ftw import ALIGNMENT  # what O_DIRECT asks of offsets, lengths and addresses

CHUNK = 32 << 20  # bytes per request: a large range is many requests, in parallel
MAX_THREADS = 16  # beyond this a host's read bandwidth no longer grows (19.7 GB/s at 16 from tmpfs)


def default_threads() -> int:
    return max(1, min(MAX_THREADS, os.cpu_count() or 1))


@dataclass(frozen=True)
class Piece:
    """`view` (writable, contiguous bytes) filled from `path` at byte `offset`."""

    path: Path
    offset: int
    view: memoryview


class RangeReader:
    """Reads pieces into their buffers on `threads` worker threads; counts direct and buffered requests."""

    def __init__(self, threads: int | None = None, direct: bool = True, chunk: int = CHUNK) -> None:
        self.threads, self.chunk = threads or default_threads(), chunk
        self.direct = direct and hasattr(os, "O_DIRECT")
        self.direct_reads = 0
        self.buffered_reads = 0

    def read(self, pieces: list[Piece]) -> None:
        """Fill every piece; a short file raises FreeTokenError naming it."""
        requests = [
            Piece(p.path, p.offset + start, p.view[start : start + self.chunk])
            for p in pieces
            for start in range(0, len(p.view), self.chunk)
        ]
        if len(requests) <= 1 or self.threads == 1:
            for request in requests:
                self._read_one(request)
            return
        with ThreadPoolExecutor(min(self.threads, len(requests))) as pool:
            list(pool.map(self._read_one, requests))

    def _read_one(self, piece: Piece) -> None:
        view, offset, length = piece.view, piece.offset, len(piece.view)
        body = length - length % ALIGNMENT
        address = np.frombuffer(view, dtype=np.uint8).ctypes.data if length else 0
        done = 0
        if self.direct and body and offset % ALIGNMENT == 0 and address % ALIGNMENT == 0:
            done = self._direct(piece.path, offset, view[:body])
        if done < length:
            with open(piece.path, "rb", buffering=0) as handle:
                while done < length:
                    got = os.preadv(handle.fileno(), [view[done:]], offset + done)
                    if got <= 0:
                        raise FreeTokenError(f"{piece.path}: unexpected end of file at byte {offset + done}")
                    done += got
            self.buffered_reads += 1

    def _direct(self, path: Path, offset: int, view: memoryview) -> int:
        """Bytes of `view` read with O_DIRECT (0 where the filesystem refuses it: read buffered)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError:
            return 0
        done = 0
        try:
            while done < len(view):
                got = os.preadv(fd, [view[done:]], offset + done)
                if got <= 0:
                    break
                done += got
            self.direct_reads += 1
        except OSError:
            done = 0
        finally:
            os.close(fd)
        return done


def byte_views(dest: torch.Tensor) -> list[memoryview]:
    """`dest` (a host tensor, possibly a strided view such as one half of every expert's rows) as its
    contiguous blocks in C order, each a writable byte view: what a file's C-ordered bytes fill in turn."""
    if dest.is_contiguous():
        return [memoryview(dest.reshape(-1).view(torch.uint8).numpy())] if dest.numel() else []
    if dest.dim() <= 1:
        raise ValueError("a strided vector has no contiguous blocks to read into")
    return [view for part in dest.unbind(0) for view in byte_views(part)]
