"""A lower layer never imports a higher one: errors/env < codecs < formats < runtime < replay < serve
< cli. Imports under `if TYPE_CHECKING:` are annotations only and do not count; lazy imports inside
functions do.
Within runtime, config.py (the frozen configs) imports no architecture."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "freetoken"
LAYERS = ["codecs", "formats", "runtime", "replay", "serve", "cli"]


def imported_modules(path: Path) -> set[str]:
    """Every freetoken module `path` imports, at any depth, outside `if TYPE_CHECKING:` blocks."""
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            skipped.update(id(n) for child in node.body for n in ast.walk(child))
    names = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {n for n in names if n.startswith("freetoken.")}


def layer_of(module: str) -> int | None:
    part = module.split(".")[1] if module.count(".") else ""
    return LAYERS.index(part) if part in LAYERS else None


def violations() -> list[str]:
    found = []
    for path in PACKAGE.rglob("*.py"):
        own = layer_of("freetoken." + path.relative_to(PACKAGE).parts[0])
        if own is None:
            continue
        for module in imported_modules(path):
            other = layer_of(module)
            if other is not None and other > own:
                found.append(f"{path.relative_to(PACKAGE)} imports {module}")
    return sorted(found)


def test_no_lower_layer_imports_a_higher_one() -> None:
    assert violations() == []


def test_configs_import_no_architecture() -> None:
    assert not any(
        m.startswith("freetoken.runtime.models") for m in imported_modules(PACKAGE / "runtime/config.py")
    )


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from freetoken.cli.app import app\n"
        "def f():\n    from freetoken.serve.app import build\n"
    )
    assert imported_modules(probe) == {"freetoken.serve.app"}
    assert layer_of("freetoken.serve.app") > layer_of("freetoken.runtime.engine")
