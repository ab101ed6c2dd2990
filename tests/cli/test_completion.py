"""Shell completion from Typer (`ft --install-completion`); `ft help TOPIC` prints short man pages."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

FT = Path(sys.executable).parent / "ft"


def complete(*words: str, cword: int) -> str:
    """What `ft`'s bash completion offers for the command line `words` (Typer's completion protocol,
    as the script `ft --install-completion` writes calls it)."""
    env = {
        **os.environ,
        "_FT_COMPLETE": "complete_bash",
        "COMP_WORDS": " ".join(words),
        "COMP_CWORD": str(cword),
    }
    out = subprocess.run([str(FT)], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.skipif(not FT.exists(), reason="the `ft` entry point is not installed in this environment")
def test_completion_offers_commands_and_flags() -> None:
    assert complete("ft", "ru", cword=1).split() == ["run"]
    assert "--moe-backend" in complete("ft", "run", "--moe-b", cword=2).split()
    assert "rm" in complete("ft", "models", "r", cword=2).split()


@pytest.mark.parametrize("topic", ["backends", "formats", "qstar", "q*"])
def test_help_topics_print_their_page(topic: str) -> None:
    out = subprocess.run([sys.executable, "-m", "freetoken", "help", topic], capture_output=True, text=True)
    assert out.returncode == 0 and len(out.stdout.splitlines()) > 10, out.stderr


def test_an_unknown_help_topic_is_one_line() -> None:
    out = subprocess.run([sys.executable, "-m", "freetoken", "help", "nope"], capture_output=True, text=True)
    assert out.returncode == 1 and out.stderr.strip() == (
        "error: no help topic or command 'nope'; topics: backends, formats, qstar; "
        "commands: run, convert, serve, ls, bench, replay, models"
    )


@pytest.mark.parametrize("command", ["run", "bench"])
def test_help_of_a_command_is_its_help_flag(command: str) -> None:
    cli = [sys.executable, "-m", "freetoken"]
    got = subprocess.run([*cli, "help", command], capture_output=True, text=True)
    want = subprocess.run([*cli, command, "--help"], capture_output=True, text=True)
    assert got.returncode == want.returncode == 0 and got.stdout == want.stdout and "Usage" in got.stdout
