"""`ft models` listing: a fake Hugging Face cache (the hub's on-disk layout) and a $FREETOKEN_HOME/models
holding a converted FTW folder and GGUF files; every entry's format, architecture, support and sizes."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from freetoken.errors import FreeTokenError
from freetoken.runtime.loading import model_catalog
from freetoken.runtime.loading.model_catalog import (
    ModelEntry,
    config_expert_bytes,
    gguf_header,
    list_models,
    remove_own_model,
)
from gguf_fixture import write_gguf
from oracle import SUPPORTED_ARCHITECTURES

COMMIT = "0123456789abcdef0123456789abcdef01234567"
SUPPORTED = SUPPORTED_ARCHITECTURES
# tiny_model: 3 layers, layer 1 dense -> 2 MoE layers of 8 experts, hidden 64, moe_intermediate 32
TINY_EXPERT_NUMEL = 2 * 8 * 3 * 64 * 32


def hf_repo(
    cache: Path, repo_id: str, files: dict[str, bytes | Path], kind: str = "models", ref: str | None = "main"
) -> Path:
    """A repo in the hub cache's layout: blobs/<sha256>, snapshots/<commit>/<file> linking to its blob,
    refs/<ref> holding the commit. Returns the snapshot folder."""
    repo = cache / f"{kind}--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    for name, content in files.items():
        data = content.read_bytes() if isinstance(content, Path) else content
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    if ref is not None:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(COMMIT)
    return snapshot


def use(monkeypatch: pytest.MonkeyPatch, cache: Path, home: Path) -> None:
    """Point huggingface_hub (its constant is read at import, hence both) and FreeToken at these."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("FREETOKEN_HOME", str(home))


def write_llama_gguf(path: Path) -> Path:
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def world(tiny_model: tuple[Path, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from freetoken.runtime.loading.convert import convert_to_ftw

    root = tmp_path_factory.mktemp("catalog")
    folder, hf = tiny_model
    cache, models = root / "hub", root / "home" / "models"
    files = {p.name: p for p in folder.iterdir() if p.is_file()}
    q8 = write_gguf(hf, folder, root / "tiny-Q8_0.gguf", "Q8_0")
    out = {
        "tiny-moe": hf_repo(cache, "acme/tiny-moe", files),
        "llama": hf_repo(
            cache, "acme/llama-like", {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"x"}
        ),
        "broken": hf_repo(cache, "acme/broken", {"config.json": b"{not json", "model.safetensors": b"x"}),
        "gguf-repo": hf_repo(cache, "acme/tiny-gguf", {"tiny-Q8_0.gguf": q8}),
        "no-main": hf_repo(cache, "acme/no-main", files, ref=None),
        "q8": q8,
    }
    hf_repo(cache, "acme/data", {"config.json": b"{}"}, kind="datasets")
    models.mkdir(parents=True)
    convert_to_ftw(folder, models / "mymodel", dtype="bfloat16")
    out["split"] = write_gguf(hf, folder, models / "split.gguf", "F32", split_max_tensors=20)
    out["tiny"] = write_gguf(hf, folder, models / "tiny.gguf", "F32")
    write_llama_gguf(models / "llama.gguf")
    (models / "corrupt.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 40)
    (models / "demo-v1").mkdir()
    shutil.copy(folder / "config.json", models / "demo-v1" / "config.json")
    (models / "demo-v1" / "model.safetensors").write_bytes(b"x")
    (models / ".other.converting-123").mkdir()  # an unfinished convert: not listed
    return {**out, "cache": cache, "home": root / "home", "models": models}


@pytest.fixture(autouse=True)
def _env(world: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    use(monkeypatch, world["cache"], world["home"])


def by_name() -> dict[str, ModelEntry]:
    return {e.name: e for e in list_models()}


def test_lists_the_cache_and_freetokens_own_models(world: dict[str, Path]) -> None:
    entries = by_name()
    gguf_in_repo = str(world["gguf-repo"] / "tiny-Q8_0.gguf")
    assert set(entries) == {
        "acme/broken",
        "acme/llama-like",
        "acme/tiny-moe",
        gguf_in_repo,
        str(world["no-main"]),  # no `main` ref: a repo id would not resolve, its snapshot path does
        "corrupt.gguf",
        "demo",
        "llama.gguf",
        "mymodel",
        "split-00001-of-00002.gguf",
        "tiny.gguf",
    }
    rows = {n: (e.format, e.architecture, e.supported, e.source) for n, e in entries.items()}
    assert rows["acme/tiny-moe"] == ("safetensors", "qwen3_moe", True, "hf-cache")
    assert rows[gguf_in_repo] == ("gguf", "qwen3moe", True, "hf-cache")
    assert rows["mymodel"] == ("ftw", "qwen3_moe", True, "freetoken")
    assert rows["tiny.gguf"] == ("gguf", "qwen3moe", True, "freetoken")
    assert rows["split-00001-of-00002.gguf"] == ("gguf", "qwen3moe", True, "freetoken")
    assert rows["demo"] == ("safetensors", "qwen3_moe", True, "freetoken")
    assert entries["demo"].path == world["models"] / "demo-v1"
    assert all(e.reason is None for e in entries.values() if e.supported)


def test_unsupported_entries_say_why_in_one_line(world: dict[str, Path]) -> None:
    entries = by_name()
    llama = entries["acme/llama-like"]
    assert (llama.supported, llama.architecture) == (False, "llama")
    assert llama.reason == f"architecture 'llama' is not supported (supported: {SUPPORTED})"
    assert (
        entries["llama.gguf"].reason
        == "GGUF architecture 'llama' without experts (a dense model): not supported"
    )
    broken = entries["acme/broken"]
    assert not broken.supported and broken.reason.startswith(
        f"{world['broken'] / 'config.json'}: invalid JSON"
    )
    corrupt = entries["corrupt.gguf"]
    assert not corrupt.supported and corrupt.reason.startswith(
        f"{world['models'] / 'corrupt.gguf'}: not a readable"
    )
    assert all("\n" not in (e.reason or "") for e in entries.values())


def test_sizes_and_expert_bytes(world: dict[str, Path]) -> None:
    import gguf

    entries = by_name()
    blobs = world["tiny-moe"].parent.parent / "blobs"
    assert entries["acme/tiny-moe"].size_bytes == sum(p.stat().st_size for p in blobs.iterdir())
    assert entries["acme/tiny-moe"].expert_bytes == TINY_EXPERT_NUMEL * 4  # float32 in config.json
    assert entries["mymodel"].expert_bytes == TINY_EXPERT_NUMEL * 2  # converted to bf16
    manifest = json.loads((world["models"] / "mymodel" / "ftw.json").read_text())
    assert entries["mymodel"].size_bytes == sum(
        p.stat().st_size for p in (world["models"] / "mymodel").iterdir()
    )
    assert sum(t["nbytes"] for t in manifest["tensors"] if t["kind"] != "dense") == TINY_EXPERT_NUMEL * 2
    assert entries["tiny.gguf"].expert_bytes == TINY_EXPERT_NUMEL * 4
    shards = sorted(world["models"].glob("split-*.gguf"))
    assert len(shards) == 2 and entries["split-00001-of-00002.gguf"].size_bytes == sum(
        p.stat().st_size for p in shards
    )
    assert entries["split-00001-of-00002.gguf"].expert_bytes == TINY_EXPERT_NUMEL * 4
    q8 = gguf.GGUFReader(world["q8"]).tensors
    expected = sum(int(t.n_bytes) for t in q8 if "_exps" in t.name)
    assert expected == TINY_EXPERT_NUMEL // 32 * 34  # Q8_0: blocks of 32 weights in 34 bytes
    assert entries[str(world["gguf-repo"] / "tiny-Q8_0.gguf")].expert_bytes == expected
    # how they are stored: the GGUF's expert tensor types, the FTW banks' dtype
    assert entries[str(world["gguf-repo"] / "tiny-Q8_0.gguf")].expert_types == ("Q8_0",)
    assert entries["tiny.gguf"].expert_types == ("F32",)
    assert entries["mymodel"].expert_types == ("bfloat16",)
    assert entries["acme/tiny-moe"].expert_types == ()  # not read from safetensors headers


def test_gguf_header_agrees_with_the_gguf_package(world: dict[str, Path]) -> None:
    import gguf

    fields, tensors = gguf_header(world["q8"])
    reader = gguf.GGUFReader(world["q8"])
    assert tensors == {t.name: (int(t.n_bytes), int(t.tensor_type)) for t in reader.tensors}
    for key in ("general.architecture", "tokenizer.ggml.model", "qwen3moe.expert_count"):
        assert fields[key] == reader.fields[key].contents()
    assert fields["tokenizer.ggml.tokens"] is None  # arrays are skipped


def test_a_missing_shard_is_the_reason(world: dict[str, Path], tmp_path: Path) -> None:
    first = tmp_path / world["split"].name
    shutil.copy(world["split"], first)
    [entry] = list_models([str(first)])
    assert not entry.supported and entry.reason == f"{first}: shard split-00002-of-00002.gguf is missing"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({"num_hidden_layers": 4, "num_experts": 2, "hidden_size": 8, "moe_intermediate_size": 4}, None),
        (
            {
                "num_hidden_layers": 4,
                "num_experts": 2,
                "hidden_size": 8,
                "moe_intermediate_size": 4,
                "torch_dtype": "bfloat16",
                "decoder_sparse_step": 2,
            },
            2 * 2 * 3 * 8 * 4 * 2,
        ),
        (
            {
                "dtype": "bfloat16",
                "text_config": {
                    "num_hidden_layers": 3,
                    "num_experts": 4,
                    "hidden_size": 8,
                    "moe_intermediate_size": 2,
                    "mlp_only_layers": [0],
                },
            },
            2 * 4 * 3 * 8 * 2 * 2,
        ),
        (
            {
                "dtype": "bfloat16",
                "num_hidden_layers": 2,
                "num_experts": 2,
                "hidden_size": 8,
                "moe_intermediate_size": 4,
                "quantization_config": {"quant_method": "fp8"},
            },
            None,
        ),
        ({"dtype": "bfloat16", "num_hidden_layers": "many", "num_experts": 2}, None),
        ({"dtype": "bfloat16", "num_hidden_layers": 2, "hidden_size": 8, "intermediate_size": 16}, None),
    ],
)
def test_expert_bytes_from_config(raw: dict[str, Any], expected: int | None) -> None:
    assert config_expert_bytes(raw) == expected


def test_paths_are_listed_instead(world: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "folder").mkdir()
    shutil.copytree(world["models"] / "mymodel", tmp_path / "folder" / "a-ftw")
    shutil.copy(world["models"] / "tiny.gguf", tmp_path / "folder" / "b.gguf")
    given = [str(world["models"] / "tiny.gguf"), str(tmp_path / "folder"), str(tmp_path / "nope")]
    entries = list_models(given)
    assert [(e.name, e.format, e.source) for e in entries] == [
        (given[0], "gguf", "path"),
        (f"{given[1]}/a-ftw", "ftw", "path"),
        (f"{given[1]}/b.gguf", "gguf", "path"),
        (given[2], "", "path"),
    ]
    assert entries[-1].reason == f"{tmp_path / 'nope'}: no such file or folder"


def test_no_cache_folder_lists_only_own_models(
    world: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    use(monkeypatch, tmp_path / "no-such-hub", world["home"])
    assert {e.source for e in list_models()} == {"freetoken"}
    use(monkeypatch, tmp_path / "no-such-hub", tmp_path / "empty-home")
    assert list_models() == []


def test_removal_is_for_own_models_only(
    world: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    shutil.copytree(world["models"], home / "models", symlinks=True)
    use(monkeypatch, world["cache"], home)
    entries = by_name()
    with pytest.raises(FreeTokenError, match="FreeToken removes only its own models"):
        remove_own_model(entries["acme/tiny-moe"])
    assert world["tiny-moe"].is_dir()
    remove_own_model(entries["split-00001-of-00002.gguf"])
    remove_own_model(entries["mymodel"])
    assert not list((home / "models").glob("split-*")) and not (home / "models" / "mymodel").exists()


def test_copied_constants_equal_their_originals() -> None:
    from freetoken.formats import ftw, gguf_meta
    from freetoken.runtime.loading import demo

    assert model_catalog.FTW_MANIFEST == ftw.MANIFEST
    assert (model_catalog.FTW_FORMAT, model_catalog.FTW_VERSIONS) == (ftw.FORMAT, ftw.READABLE_VERSIONS)
    assert model_catalog.DEMO_FOLDER == demo.DEMO_NAME
    assert model_catalog.GGUF_ARCHITECTURES == gguf_meta.ARCHITECTURES
