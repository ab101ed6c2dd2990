"""Environment variables are read in one module, `freetoken/env.py`."""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "freetoken"
READS = re.compile(r"os\.environ|os\.getenv|getenv\(")


def test_only_env_py_reads_the_environment() -> None:
    readers = [
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if path.name != "env.py" or path.parent != PACKAGE
        if READS.search(path.read_text())
    ]
    assert readers == []
    assert READS.search((PACKAGE / "env.py").read_text())  # the pattern finds reads where they are
