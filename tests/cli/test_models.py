"""`freetoken models` / `ls` / `models rm` through typer's CliRunner, on a fake Hugging Face cache and a
FreeToken home holding a converted FTW folder and a GGUF file; errors are one line, exit code 1."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from freetoken.cli import models as models_module
from freetoken.cli.app import app
from gguf_fixture import write_gguf
from oracle import SUPPORTED_ARCHITECTURES

runner = CliRunner()
COMMIT = "fedcba9876543210fedcba9876543210fedcba98"
SUPPORTED = SUPPORTED_ARCHITECTURES


def hf_repo(cache: Path, repo_id: str, files: dict[str, bytes]) -> Path:
    """A model repo in the hub cache's layout (blobs, snapshots linking to them, refs/main)."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture(scope="module")
def built(tiny_model: tuple[Path, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A converted FTW folder and a GGUF file of the tiny model, made once; tests copy them."""
    from freetoken.runtime.loading.convert import convert_to_ftw

    root = tmp_path_factory.mktemp("built")
    convert_to_ftw(tiny_model[0], root / "mymodel", dtype="float32")
    return {"ftw": root / "mymodel", "gguf": write_gguf(tiny_model[1], tiny_model[0], root / "tiny.gguf")}


@pytest.fixture
def places(
    built: dict[str, Path], tiny_model: tuple[Path, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> dict[str, Path]:
    import shutil

    import huggingface_hub.constants

    cache, home = tmp_path / "hub", tmp_path / "home"
    files = {p.name: p.read_bytes() for p in tiny_model[0].iterdir() if p.is_file()}
    hf_repo(cache, "acme/tiny-moe", files)
    hf_repo(cache, "acme/llama-like", {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"x"})
    models = home / "models"
    models.mkdir(parents=True)
    shutil.copytree(built["ftw"], models / "mymodel")
    shutil.copy(built["gguf"], models / "tiny.gguf")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("FREETOKEN_HOME", str(home))
    return {"cache": cache, "home": home, "models": models, "tmp": tmp_path}


def listed(*args: str) -> dict[str, dict[str, Any]]:
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    return {e["name"]: e for e in json.loads(result.stdout)}


def one_line_error(args: list[str], input: str | None = None) -> str:
    result = runner.invoke(app, args, input=input)
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    return lines[0]


def test_json_lists_every_model_with_its_verdict(places: dict[str, Path]) -> None:
    entries = listed("models")
    assert sorted(entries) == ["acme/llama-like", "acme/tiny-moe", "mymodel", "tiny.gguf"]
    verdict = {n: (e["format"], e["architecture"], e["supported"], e["source"]) for n, e in entries.items()}
    assert verdict == {
        "acme/llama-like": ("safetensors", "llama", False, "hf-cache"),
        "acme/tiny-moe": ("safetensors", "qwen3_moe", True, "hf-cache"),
        "mymodel": ("ftw", "qwen3_moe", True, "freetoken"),
        "tiny.gguf": ("gguf", "qwen3moe", True, "freetoken"),
    }
    assert (
        entries["acme/llama-like"]["reason"]
        == f"architecture 'llama' is not supported (supported: {SUPPORTED})"
    )
    assert (
        entries["mymodel"]["expert_bytes"] == entries["tiny.gguf"]["expert_bytes"] == 2 * 8 * 3 * 64 * 32 * 4
    )
    assert entries["mymodel"]["path"] == str(places["models"] / "mymodel")
    assert listed("ls") == entries


def test_table_shows_names_and_reasons(places: dict[str, Path]) -> None:
    result = runner.invoke(app, ["models"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    rows = {line.split("│")[1].strip(): line for line in result.stdout.splitlines() if line.count("│") > 2}
    assert {"acme/tiny-moe", "acme/llama-like", "mymodel", "tiny.gguf"} <= set(rows)
    assert "no: architecture 'llama' is not supported" in rows["acme/llama-like"]
    assert " ftw " in rows["mymodel"] and " header ok " in rows["mymodel"] and "KiB" in rows["mymodel"]
    assert runner.invoke(app, ["ls"], env={"COLUMNS": "400"}).stdout == result.stdout


def test_paths_given_are_listed_instead(places: dict[str, Path]) -> None:
    gguf, nope = str(places["models"] / "tiny.gguf"), str(places["tmp"] / "nope")
    entries = listed("models", gguf, nope)
    assert list(entries) == [gguf, nope] and entries[gguf]["source"] == "path"
    assert entries[nope]["reason"] == f"{nope}: no such file or folder"
    assert listed("ls", gguf) == {gguf: entries[gguf]}


def test_an_empty_listing_says_where_it_looked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("FREETOKEN_HOME", str(tmp_path / "home"))
    result = runner.invoke(app, ["models"])
    assert result.exit_code == 0 and result.stdout == ""
    assert result.stderr.strip() == f"no models found in {tmp_path / 'hub'}, {tmp_path / 'home' / 'models'}"
    assert runner.invoke(app, ["models", "--json"]).stdout.strip() == "[]"


def test_rm_removes_an_own_model(places: dict[str, Path]) -> None:
    result = runner.invoke(app, ["models", "rm", "mymodel", "--yes"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == f"removed {places['models'] / 'mymodel'}"
    assert runner.invoke(app, ["models", "rm", "tiny", "-y"]).exit_code == 0  # the .gguf may be left out
    assert list(places["models"].iterdir()) == []
    assert sorted(listed("models")) == ["acme/llama-like", "acme/tiny-moe"]


def test_rm_removes_a_link_not_what_it_points_to(places: dict[str, Path]) -> None:
    target = places["tmp"] / "elsewhere.gguf"
    (places["models"] / "tiny.gguf").rename(target)
    (places["models"] / "linked.gguf").symlink_to(target)
    assert runner.invoke(app, ["models", "rm", "linked.gguf", "--yes"]).exit_code == 0
    assert target.is_file() and not (places["models"] / "linked.gguf").is_symlink()


@pytest.mark.parametrize(
    ("name", "tail"),
    [
        ("acme/tiny-moe", "this one is in the Hugging Face cache: use `hf cache rm`"),
        ("mymodle", "did you mean mymodel?"),
        ("../home", "`ft models rm` removes only those"),
        ("/etc", "`ft models rm` removes only those"),
    ],
)
def test_rm_refuses_anything_else(places: dict[str, Path], name: str, tail: str) -> None:
    line = one_line_error(["models", "rm", name, "--yes"])
    assert line.startswith(f"error: {name}: not one of FreeToken's own models (those in {places['models']})")
    assert line.endswith(tail)
    assert (places["cache"] / "models--acme--tiny-moe").is_dir() and (places["models"] / "mymodel").is_dir()


def test_rm_asks_first(places: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    line = one_line_error(["models", "rm", "mymodel"])  # no terminal, no --yes
    where = places["models"] / "mymodel"
    assert line == f"error: mymodel: not removing {where} without --yes (no terminal to ask on)"
    monkeypatch.setattr(models_module, "stdin_is_terminal", lambda: True)
    kept = runner.invoke(app, ["models", "rm", "mymodel"], input="n\n")
    assert kept.exit_code == 0 and "not removed" in kept.stderr and (places["models"] / "mymodel").is_dir()
    removed = runner.invoke(app, ["models", "rm", "mymodel"], input="y\n")
    assert removed.exit_code == 0 and not (places["models"] / "mymodel").exists()


def test_run_resolves_own_models_by_name_and_suggests_for_typos(places: dict[str, Path]) -> None:
    result = runner.invoke(
        app, ["run", "mymodel", "-p", "hi", "-n", "2", "-t", "0", "--device", "cpu", "--json"]
    )
    assert result.exit_code == 0, result.output
    line = one_line_error(["run", "acme/tiny-mo", "-p", "hi"])
    assert "not in the local Hugging Face cache" in line and line.endswith(
        "did you mean acme/tiny-moe? (see `ft models`)"
    )
    for odd in ("a//b", "foo/bar/baz", "foo bar/baz", "x/../y"):
        assert one_line_error(["run", odd, "-p", "hi"]).startswith(f"error: {odd}: unknown model: ")


@pytest.mark.parametrize(
    "args", [["models", "--json"], ["ls"], ["models", "--help"], ["models", "rm", "--help"]]
)
def test_listing_imports_no_torch(places: dict[str, Path], args: list[str]) -> None:
    code = (
        "import sys\n"
        "from freetoken.cli.app import app\n"
        f"try:\n    app({args!r})\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    # a fresh process: huggingface_hub finds the cache through the environment alone
    env = {
        **os.environ,
        "HF_HUB_CACHE": str(places["cache"]),
        "FREETOKEN_HOME": str(places["home"]),
        "COLUMNS": "400",
    }
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "--help" in args or ("mymodel" in proc.stdout and "acme/tiny-moe" in proc.stdout)
