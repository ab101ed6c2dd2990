"""`convert` checks its source before writing, never leaves its temporary folder behind on a failure,
and clears the ones a killed convert left."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from freetoken.cli.app import app
from freetoken.errors import FreeTokenError
from freetoken.runtime.loading import convert as convert_module
from freetoken.runtime.loading.convert import convert_to_ftw, remove_stale_folders

runner = CliRunner()


@pytest.fixture
def source(tiny_model: tuple[Path, Any], tmp_path: Path) -> Path:
    folder = tmp_path / "src"
    shutil.copytree(tiny_model[0], folder)
    return folder


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_missing_tokenizer_fails_before_writing(source: Path, tmp_path: Path) -> None:
    (source / "tokenizer.json").unlink()
    out = tmp_path / "out" / "ftw"
    result = runner.invoke(app, ["convert", str(source), str(out)])
    assert result.exit_code == 1
    assert (
        result.stderr.strip()
        == f"error: {source}: no tokenizer.json; an FTW folder needs the model's tokenizer"
    )
    assert not out.parent.exists()


def test_broken_tokenizer_fails_before_writing(source: Path, tmp_path: Path) -> None:
    (source / "tokenizer.json").write_text('{"version": "1.0", "model": 7}')
    with pytest.raises(FreeTokenError, match=r"cannot load .*tokenizer\.json"):
        convert_to_ftw(source, tmp_path / "ftw")
    assert leftovers(tmp_path) == ["src"]


def test_bad_config_names_file_and_key_before_writing(source: Path, tmp_path: Path) -> None:
    raw = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**raw, "moe_intermediate_size": "32"}))
    result = runner.invoke(app, ["convert", str(source), str(tmp_path / "ftw")])
    assert result.exit_code == 1
    assert result.stderr.strip() == (
        f'error: {source / "config.json"}: moe_intermediate_size: expected a positive integer, got "32"'
    )
    assert leftovers(tmp_path) == ["src"]


def test_any_failure_removes_the_temporary_folder(
    source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any, **kwargs: Any) -> None:
        assert any(".ftw.converting-" in p.name for p in tmp_path.iterdir())  # it was there
        raise RuntimeError("a bug in the middle of the conversion")

    monkeypatch.setattr(convert_module, "_replace", broken)
    with pytest.raises(RuntimeError):
        convert_to_ftw(source, tmp_path / "ftw", dtype="float32")
    assert leftovers(tmp_path) == ["src"]


def test_a_failed_replace_keeps_the_old_output(
    source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "ftw"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    original = Path.rename

    def rename(self: Path, target: Any) -> Any:
        if ".converting-" in self.name:
            raise OSError(18, "Invalid cross-device link")
        return original(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(FreeTokenError, match="conversion failed"):
        convert_to_ftw(source, out, dtype="float32", force=True)
    assert leftovers(tmp_path) == ["ftw", "src"] and (out / "keep.txt").read_text() == "mine"


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_folders_of_dead_converts_are_removed(source: Path, tmp_path: Path) -> None:
    parent = tmp_path / "models"
    parent.mkdir()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead = parent / f".x.converting-{dead_pid()}"
        mine = parent / f".x.converting-{os.getpid()}"
        other = parent / f".y.converting-{live.pid}"
        for folder in (dead, mine, other):
            folder.mkdir()
            (folder / "data-00001-of-00002.ftw").write_bytes(b"partial")
        (parent / ".z.converting-notapid").mkdir()
        convert_to_ftw(source, parent / "ftw", dtype="float32")
        assert not dead.exists()
        assert mine.exists() and other.exists() and (parent / ".z.converting-notapid").exists()
        assert (parent / "ftw" / "ftw.json").exists()
        assert remove_stale_folders(parent) == []
    finally:
        live.kill()
        live.wait()
