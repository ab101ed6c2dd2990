"""Parallel range reads into host buffers: strided destinations filled block by block in C order, requests
cut in chunks and spread over threads, a short file named."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from freetoken.errors import FreeTokenError
from freetoken.formats.range_read import Piece, RangeReader, byte_views


def test_a_strided_half_is_filled_in_c_order_by_chunked_requests(tmp_path: Path) -> None:
    bank = torch.zeros(3, 4, 5, dtype=torch.int16)  # [E, 2I, H]: the gate half is rows 0..1 of each expert
    want = np.arange(1, 3 * 2 * 5 + 1, dtype=np.int16).reshape(3, 2, 5)
    path = tmp_path / "f.bin"
    path.write_bytes(b"xyz" + want.tobytes())  # an unaligned offset
    dest = bank[:, :2]
    views = byte_views(dest)
    assert [len(v) for v in views] == [20, 20, 20]
    reader = RangeReader(threads=3, chunk=6)  # 4 requests a block, on 3 threads
    offset, pieces = 3, []
    for view in views:
        pieces.append(Piece(path, offset, view))
        offset += len(view)
    reader.read(pieces)
    assert np.array_equal(dest.numpy(), want)
    assert not bank[:, 2:].any()  # the other half untouched
    assert reader.buffered_reads == 12


def test_a_contiguous_destination_is_one_view() -> None:
    dest = torch.zeros(2, 3, dtype=torch.bfloat16)
    assert [len(v) for v in byte_views(dest)] == [12]


def test_a_short_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "short.bin"
    path.write_bytes(b"0123456789")
    dest = torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(FreeTokenError, match=r"short\.bin: unexpected end of file"):
        RangeReader(threads=2, chunk=4).read([Piece(path, 0, byte_views(dest)[0])])
