"""docs/design.md names only files and folders that exist (relative to src/freetoken, or to the project)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "design.md"
PACKAGE = ROOT / "src" / "freetoken"


def named_paths(text: str) -> list[str]:
    """Backticked words that look like paths: with a slash, or a source file's suffix."""
    words = re.findall(r"`([^`\s]+)`", text)
    return [w for w in words if "/" in w or w.endswith((".py", ".c", ".h", ".md"))]


def test_every_path_the_design_page_names_exists() -> None:
    paths = named_paths(DOC.read_text())
    assert len(paths) > 30  # the page is a map: it names files
    missing = [p for p in paths if not (PACKAGE / p).exists() and not (ROOT / p).exists()]
    assert missing == []


def test_the_check_sees_a_missing_file() -> None:
    assert named_paths("see `runtime/nowhere.py` and `cli/app.py`") == ["runtime/nowhere.py", "cli/app.py"]
    assert not (PACKAGE / "runtime/nowhere.py").exists()
