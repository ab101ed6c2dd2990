"""Bad GGUF files: a tensor of an unknown type, a truncated block array, a part of a split missing or from
another split. `ft run` says so in one line naming the file, the tensor and the type, and exits 1."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from freetoken.cli.app import app
from freetoken.formats.gguf_header import read_header
from gguf_fixture import write_gguf


def run_fails(path: Path) -> str:
    """The one line `ft run` prints for `path`, checking it exits 1."""
    result = CliRunner().invoke(app, ["run", str(path), "-p", "hi", "-n", "1"])
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    return lines[0]


def type_field_at(path: Path, tensor: str) -> int:
    """The byte offset of `tensor`'s type id in the file's tensor table."""
    data = path.read_bytes()
    name = tensor.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    dims = struct.unpack_from("<I", data, at)[0]
    return at + 4 + 8 * dims


@pytest.fixture
def q8_file(tiny_model: tuple[Path, Any], tmp_path: Path) -> Path:
    return write_gguf(tiny_model[1], tiny_model[0], tmp_path / "q8.gguf", "Q8_0")


def test_an_unknown_type_names_the_file_the_tensor_and_the_type(q8_file: Path) -> None:
    data = bytearray(q8_file.read_bytes())
    struct.pack_into("<I", data, type_field_at(q8_file, "blk.0.ffn_down_exps.weight"), 99)
    q8_file.write_bytes(bytes(data))
    line = run_fails(q8_file)
    assert str(q8_file) in line and "blk.0.ffn_down_exps.weight: unknown GGML type 99" in line


def test_a_truncated_file_names_the_tensor_and_its_type(q8_file: Path) -> None:
    last = max(read_header(q8_file).tensors, key=lambda t: t.offset)
    with q8_file.open("r+b") as f:
        f.truncate(last.offset + last.n_bytes - 7)  # the last block array cut short
    line = run_fails(q8_file)
    assert str(q8_file) in line and f"tensor {last.name} (Q8_0, {last.n_bytes} bytes) runs past" in line


def test_rows_that_are_not_whole_blocks_are_named(q8_file: Path) -> None:
    data = bytearray(q8_file.read_bytes())
    at = type_field_at(q8_file, "blk.0.ffn_down_exps.weight")
    struct.pack_into("<I", data, at, 12)  # Q4_K: rows of 32 weights are not whole super-blocks of 256
    q8_file.write_bytes(bytes(data))
    line = run_fails(q8_file)
    assert "blk.0.ffn_down_exps.weight: rows of 32 weights are not whole Q4_K blocks of 256" in line


def test_a_missing_part_and_a_part_of_another_split(tiny_model: tuple[Path, Any], tmp_path: Path) -> None:
    hf, folder = tiny_model[1], tiny_model[0]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = write_gguf(hf, folder, tmp_path / "a" / "m.gguf", split_max_tensors=12)
    other = write_gguf(hf, folder, tmp_path / "b" / "m.gguf", split_max_tensors=20)
    parts = sorted(first.parent.glob("m-*.gguf"))
    count = len(parts)
    # a part of the 20-tensor split renamed into the 12-tensor set: its metadata says where it belongs
    second_other = sorted(other.parent.glob("m-*.gguf"))[1]
    parts[1].write_bytes(second_other.read_bytes())
    line = run_fails(first)
    assert parts[1].name in line and f"not part 2 of {count}" in line
    parts[1].unlink()
    line = run_fails(first)
    assert f"shard {parts[1].name} is missing" in line
