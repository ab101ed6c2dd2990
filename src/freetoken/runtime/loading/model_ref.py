"""Turn what the user typed as MODEL into a local folder or .gguf file: 'demo', a path, one of
FreeToken's own models by name (under $FREETOKEN_HOME/models), or a repo id in the HF cache."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import TYPE_CHECKING

from freetoken.errors import FreeTokenError

if TYPE_CHECKING:
    from freetoken.runtime.loading.model_catalog import ModelEntry

DEMO = "demo"


def resolve_model(ref: str) -> Path:
    if ref == DEMO:
        from freetoken.runtime.loading.demo import ensure_demo_model

        return ensure_demo_model()
    path = Path(ref).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FreeTokenError(f"{path}: not a model folder (no config.json)")
        return path
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.exists():
        raise FreeTokenError(f"{path}: expected a model folder or a .gguf file")
    if ref.startswith(("/", "~", "./", "../")) or ref in (".", ".."):
        raise FreeTokenError(f"{ref}: no such model folder or .gguf file")
    own = own_model_path(ref)
    if own is not None:
        return own
    if ref.count("/") <= 1:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

        from freetoken.runtime.loading.model_catalog import hf_cache_dir

        try:
            return Path(snapshot_download(ref, local_files_only=True, cache_dir=hf_cache_dir()))
        except (HFValidationError, LocalEntryNotFoundError):
            pass  # not a valid repo id, or not cached: the same answer
    raise unknown_model(ref)


def own_model_path(name: str) -> Path | None:
    """`name` as one of FreeToken's own models: a model folder or .gguf file directly under
    $FREETOKEN_HOME/models, by its name (the .gguf suffix may be left out)."""
    from freetoken.env import models_dir
    from freetoken.runtime.loading.model_catalog import is_model

    if not name or name.startswith(".") or "/" in name or "\\" in name:
        return None
    root = models_dir()
    return next((p for p in (root / name, root / f"{name}.gguf") if is_model(p)), None)


def find_own_model(name: str) -> ModelEntry | None:
    """The listed own model that `name` names: its listed name, its file or folder name, or a .gguf stem."""
    from freetoken.runtime.loading.model_catalog import own_models

    for entry in own_models():
        if name in (entry.name, entry.path.name) or f"{name}.gguf" == entry.path.name:
            return entry
    return None


def known_names() -> list[str]:
    """Every name that resolves to a listed model (what close matches are drawn from)."""
    from freetoken.runtime.loading.model_catalog import hf_cache_models, own_models

    names = {DEMO}
    for entry in hf_cache_models() + own_models():
        names.add(entry.name)
        if entry.source == "freetoken":
            names.update((entry.path.name, entry.path.name.removesuffix(".gguf")))
    return sorted(names)


def close_matches(ref: str, names: list[str]) -> list[str]:
    """Up to three of `names` that look like `ref`, ignoring case."""
    by_key = {name.lower(): name for name in names}
    return [by_key[key] for key in difflib.get_close_matches(ref.lower(), list(by_key), n=3, cutoff=0.6)]


def unknown_model(ref: str) -> FreeTokenError:
    """One line: where `ref` was looked for, and the known names it is close to."""
    from freetoken.env import models_dir
    from freetoken.runtime.loading.model_catalog import hf_cache_dir

    close = close_matches(ref, known_names())
    hint = f"; did you mean {', '.join(close)}? (see `ft models`)" if close else "; see `ft models`"
    return FreeTokenError(
        f"{ref}: unknown model: no file or folder {Path(ref).absolute()}, not in the local Hugging Face "
        f"cache ({hf_cache_dir()}), not among FreeToken's models ({models_dir()}); FreeToken does not "
        f"download{hint}"
    )
