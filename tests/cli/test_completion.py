"""Shell completion comes from Typer: `ft --show-completion SHELL` prints the script to source."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

FT = Path(sys.executable).parent / "ft"


@pytest.mark.skipif(not FT.exists(), reason="the `ft` entry point is not installed in this environment")
@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_show_completion_prints_a_script_for_ft(shell: str) -> None:
    out = subprocess.run([str(FT), "--show-completion", shell], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "_FT_COMPLETE" in out.stdout  # the variable Typer's completion calls `ft` back with
