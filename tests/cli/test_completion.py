"""Shell completion from Typer (`ft --show-completion SHELL`); `ft help TOPIC` prints short man pages."""

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


@pytest.mark.parametrize("topic", ["backends", "formats", "qstar", "q*"])
def test_help_topics_print_their_page(topic: str) -> None:
    out = subprocess.run([sys.executable, "-m", "freetoken", "help", topic], capture_output=True, text=True)
    assert out.returncode == 0 and len(out.stdout.splitlines()) > 10, out.stderr


def test_an_unknown_help_topic_is_one_line() -> None:
    out = subprocess.run([sys.executable, "-m", "freetoken", "help", "nope"], capture_output=True, text=True)
    assert out.returncode == 1 and out.stderr.strip() == (
        "error: no help topic 'nope'; topics: backends, formats, qstar"
    )
