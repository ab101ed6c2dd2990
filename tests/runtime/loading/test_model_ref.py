"""MODEL -> a local path: paths, FreeToken's own models by bare name, repo ids in the Hugging Face cache;
anything else is one line saying where it was looked for, with close matches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from freetoken.errors import FreeTokenError
from freetoken.runtime.loading.model_ref import close_matches, resolve_model

COMMIT = "89abcdef0123456789abcdef0123456789abcdef"


@pytest.fixture
def places(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """A hub cache holding acme/tiny-moe (the hub's layout, files linked to blobs) and a FreeToken home
    holding an FTW folder `mymodel` and a GGUF file `tiny.gguf` (metadata only: nothing is loaded)."""
    import huggingface_hub.constants

    cache, home = tmp_path / "hub", tmp_path / "home"
    repo = cache / "models--acme--tiny-moe"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "blobs" / "cfg").write_text(json.dumps({"model_type": "qwen3_moe"}))
    (snapshot / "config.json").symlink_to("../../blobs/cfg")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    models = home / "models"
    (models / "mymodel").mkdir(parents=True)
    (models / "mymodel" / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    (models / "mymodel" / "ftw.json").write_text("{}")
    (models / "tiny.gguf").write_bytes(b"GGUF")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("FREETOKEN_HOME", str(home))
    monkeypatch.chdir(tmp_path)
    return {"cache": cache, "models": models, "snapshot": snapshot, "cwd": tmp_path}


def test_own_models_resolve_by_bare_name(places: dict[str, Path]) -> None:
    assert resolve_model("mymodel") == places["models"] / "mymodel"
    assert resolve_model("tiny.gguf") == places["models"] / "tiny.gguf"
    assert resolve_model("tiny") == places["models"] / "tiny.gguf"


def test_a_path_comes_before_an_own_model(places: dict[str, Path]) -> None:
    (places["cwd"] / "mymodel").mkdir()
    (places["cwd"] / "mymodel" / "config.json").write_text("{}")
    assert resolve_model("mymodel") == Path("mymodel")


def test_repo_id_in_the_cache(places: dict[str, Path]) -> None:
    assert resolve_model("acme/tiny-moe") == places["snapshot"]


def unknown(ref: str) -> str:
    with pytest.raises(FreeTokenError) as info:
        resolve_model(ref)
    message = str(info.value)
    assert "\n" not in message and info.value.exit_code == 1
    return message


def test_unknown_name_says_where_it_looked_and_suggests(places: dict[str, Path]) -> None:
    message = unknown("acme/tiny-mow")
    assert message == (
        f"acme/tiny-mow: unknown model: no file or folder {places['cwd'] / 'acme/tiny-mow'}, not in the "
        f"local Hugging Face cache ({places['cache']}), not among FreeToken's models ({places['models']}); "
        "FreeToken does not download; did you mean acme/tiny-moe? (see `ft models`)"
    )
    assert unknown("mymodle").endswith("did you mean mymodel? (see `ft models`)")
    assert unknown("Acme/Tiny-Moe2").endswith("did you mean acme/tiny-moe? (see `ft models`)")
    assert unknown("zzzzzz").endswith("FreeToken does not download; see `ft models`")


@pytest.mark.parametrize(
    "ref", ["a//b", "foo/bar/baz", "foo bar/baz", "fo..o/bar", "acme/..x", "-acme/x", "x/mymodel", "a/b/"]
)
def test_names_the_hub_rejects_are_one_line(places: dict[str, Path], ref: str) -> None:
    assert f"{ref}: unknown model: " in unknown(ref)


@pytest.mark.parametrize("ref", ["/no/such/model", "./nope", "../nope", "~/surely-not-here-model"])
def test_paths_that_do_not_exist(places: dict[str, Path], ref: str) -> None:
    with pytest.raises(FreeTokenError, match=r"no such model folder or \.gguf file$"):
        resolve_model(ref)


def test_close_matches_ignore_case() -> None:
    assert close_matches("qwen/qwen3-30b-a3b", ["Qwen/Qwen3-30B-A3B", "demo"]) == ["Qwen/Qwen3-30B-A3B"]
    assert close_matches("something", ["demo"]) == []
