"""HF -> FTW -> load: identical weights and logits; damage and interruptions are caught."""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from freetoken.cli.app import app
from freetoken.errors import FreeTokenError
from freetoken.formats import ftw_writer
from freetoken.formats.ftw import MANIFEST
from freetoken.formats.ftw_reader import FtwCheckpoint
from freetoken.runtime.engine import build_engine
from freetoken.runtime.loading import ftw_load
from freetoken.runtime.loading.convert import convert_to_ftw

PROMPT = [5, 77, 301, 12, 9, 250, 33, 401]
runner = CliRunner()


def engines(src: Path, ftw: Path, dtype: str) -> tuple[Any, Any]:
    return (
        build_engine(src, device="cpu", dtype=dtype, moe_backend="fused"),
        build_engine(ftw, device="cpu", dtype=dtype, moe_backend="fused"),
    )


@pytest.mark.parametrize(("dtype", "shard_bytes"), [("float32", 4 << 30), ("bfloat16", 64 << 10)])
def test_roundtrip_is_bit_identical(
    tiny_model: tuple[Path, Any], tmp_path: Path, dtype: str, shard_bytes: int
) -> None:
    src = tiny_model[0]
    result = convert_to_ftw(src, tmp_path / "ftw", dtype=dtype, shard_bytes=shard_bytes)
    assert (result.shards > 2) == (shard_bytes < 1 << 20)
    manifest = json.loads((tmp_path / "ftw" / MANIFEST).read_text())
    assert all(t["offset"] % 4096 == 0 for t in manifest["tensors"])
    assert {t["kind"] for t in manifest["tensors"]} == {"dense", "gate_up", "down"}
    a, b = engines(src, tmp_path / "ftw", dtype)
    for (name, p), (name2, q) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        assert name == name2 and torch.equal(p, q), name
    for layer in a.pool.layers:
        assert torch.equal(a.pool.gate_up[layer], b.pool.gate_up[layer])
        assert torch.equal(a.pool.down[layer], b.pool.down[layer])
    assert torch.equal(
        a.forward(a.new_sequence(), PROMPT, all_logits=True),
        b.forward(b.new_sequence(), PROMPT, all_logits=True),
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (tmp_path / "ftw" / name).exists()


def test_banks_are_read_straight_into_aligned_pool_buffers(
    tiny_model: tuple[Path, Any], tmp_path: Path
) -> None:
    convert_to_ftw(tiny_model[0], tmp_path / "ftw", dtype="float32")
    engine = build_engine(tmp_path / "ftw", device="cpu", dtype="float32")
    for layer in engine.pool.layers:
        assert engine.pool.gate_up[layer].data_ptr() % 4096 == 0
    ftw = FtwCheckpoint(tmp_path / "ftw")
    entry = next(e for e in ftw.entries if e.kind == "gate_up")
    ftw.read(entry)
    assert ftw.direct_reads + ftw.buffered_reads > 0  # O_DIRECT where the filesystem allows it


def test_truncated_shard_names_shard_and_tensor(tiny_model: tuple[Path, Any], tmp_path: Path) -> None:
    convert_to_ftw(tiny_model[0], tmp_path / "ftw", dtype="float32")
    shard = next((tmp_path / "ftw").glob("data-*.ftw"))
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(FreeTokenError, match=rf"shard {shard.name} is truncated: tensor \S+ needs bytes"):
        build_engine(tmp_path / "ftw", device="cpu", dtype="float32")


def test_bad_checksum_fails_the_load(
    tiny_model: tuple[Path, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    convert_to_ftw(tiny_model[0], tmp_path / "ftw", dtype="float32")
    manifest = json.loads((tmp_path / "ftw" / MANIFEST).read_text())
    victim = next(t for t in manifest["tensors"] if t["kind"] == "down")
    shard = tmp_path / "ftw" / manifest["shards"][victim["shard"]]["file"]
    raw = bytearray(shard.read_bytes())
    raw[victim["offset"] + 100] ^= 0xFF
    shard.write_bytes(bytes(raw))
    result = runner.invoke(app, ["convert", "--verify", str(tmp_path / "ftw")])
    assert result.exit_code == 1 and f"checksum mismatch in {victim['name']}" in result.stderr
    monkeypatch.setattr(ftw_load, "allowed_cores", lambda: tuple(range(ftw_load.MIN_CORES_TO_CHECKSUM)))
    with pytest.raises(FreeTokenError, match=f"checksum mismatch in {victim['name']}"):
        build_engine(tmp_path / "ftw", device="cpu", dtype="float32")  # verified as it loads, by default
    good = runner.invoke(app, ["convert", "--verify", str(tmp_path / "ftw"), "--json"])
    assert json.loads(good.stdout)["bad"] == [victim["name"]]
    run = ["run", str(tmp_path / "ftw"), "-p", "hi", "-n", "1", "--device", "cpu", "--dtype", "float32"]
    refused = runner.invoke(app, [*run, "--verify"])
    assert refused.exit_code == 1 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines()[-1].endswith("(convert again, or load with --no-verify)")
    assert runner.invoke(app, [*run, "--no-verify"]).exit_code == 0  # a flipped bit in one weight: it runs


def test_interrupted_convert_leaves_nothing_that_looks_valid(
    tiny_model: tuple[Path, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = {"n": 0}
    original = ftw_writer.FtwWriter.add

    def flaky(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 10:
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ftw_writer.FtwWriter, "add", flaky)
    with pytest.raises(KeyboardInterrupt):
        convert_to_ftw(tiny_model[0], tmp_path / "ftw", dtype="float32")
    assert list(tmp_path.iterdir()) == []


def test_disk_full_is_one_line(
    tiny_model: tuple[Path, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Full:
        def __init__(self, *a: Any, **k: Any) -> None:
            pass

        def write(self, data: Any) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self) -> None:
            pass

    monkeypatch.setattr(ftw_writer, "open", Full, raising=False)
    with pytest.raises(FreeTokenError, match=r"ftw: disk full while writing \S+\.weight$"):
        convert_to_ftw(tiny_model[0], tmp_path / "ftw", dtype="float32")
    assert list(tmp_path.iterdir()) == []


def test_out_is_kept_without_force(tiny_model: tuple[Path, Any], tmp_path: Path) -> None:
    out = tmp_path / "ftw"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = runner.invoke(app, ["convert", str(tiny_model[0]), str(out)])
    assert result.exit_code == 1 and "exists; pass --force" in result.stderr
    assert (out / "keep.txt").read_text() == "mine"
    result = runner.invoke(
        app, ["convert", str(tiny_model[0]), str(out), "--force", "--json", "--dtype", "fp32"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["tensors"] > 0 and not (out / "keep.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ftw"]


def test_unreadable_input_is_one_line(tmp_path: Path) -> None:
    result = runner.invoke(app, ["convert", str(tmp_path / "nope"), str(tmp_path / "out")])
    line = f"error: {tmp_path / 'nope'}: no such model folder or .gguf file"
    assert result.exit_code == 1 and result.stderr.strip() == line


def test_populating_a_mapping_in_chunks_maps_every_chunk(tmp_path: Path) -> None:
    """A range of several chunks from an unaligned start, up to the mapping's last byte: every thread's call
    covers pages of the mapping (a chunk cut wrong runs past its end, and the call then fails)."""
    import mmap
    import sys

    import numpy as np

    from freetoken.formats.ftw import POPULATE_CHUNK, populate_mapping

    if not sys.platform.startswith("linux"):
        pytest.skip("madvise(MADV_POPULATE_READ) is Linux's")
    path = tmp_path / "f.bin"
    size = 3 * POPULATE_CHUNK + 12345
    with open(path, "wb") as handle:
        handle.truncate(size)
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), size, prot=mmap.PROT_READ) as mapped:
        view = np.frombuffer(mapped, dtype=np.uint8)
        address = view.ctypes.data
        if not populate_mapping(address, 4096):
            pytest.skip("this kernel refuses MADV_POPULATE_READ (before 5.14)")
        assert populate_mapping(address + 100, size - 100)
        del view
