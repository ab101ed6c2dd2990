"""Turn what the user typed as MODEL into a local folder: 'demo', a path, or a repo id in the HF cache."""

from __future__ import annotations

from pathlib import Path

from freetoken.errors import FreeTokenError

DEMO = "demo"


def resolve_model(ref: str) -> Path:
    if ref == DEMO:
        from freetoken.runtime.demo import ensure_demo_model

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
    if ref.count("/") == 1 and not ref.startswith((".", "/", "~")):
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            return Path(snapshot_download(ref, local_files_only=True))
        except LocalEntryNotFoundError:
            raise FreeTokenError(
                f"{ref}: not a folder, and not in the local Hugging Face cache (FreeToken does not download)"
            ) from None
    raise FreeTokenError(f"{ref}: no such model folder")
