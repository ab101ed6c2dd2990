"""-v says what the engine decides, -q leaves only answers and errors; exit codes are in --help."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

RUN = ["run", "-p", "hi", "-n", "1", "-t", "0", "--device", "cpu", "--dtype", "bfloat16"]


def ft(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "freetoken", *args], capture_output=True, text=True)


def test_verbose_shows_the_engines_decisions_and_quiet_hides_warnings(tiny_model: tuple[Path, Any]) -> None:
    model = str(tiny_model[0])
    loud = ft("-v", *RUN[:1], model, *RUN[1:], "--moe-cpu-threads", "999")
    assert loud.returncode == 0, loud.stderr
    assert "freetoken: decode steps on the CPU run as one native call each" in loud.stderr
    assert "warning: --moe-cpu-threads 999 is above" in loud.stderr
    hushed = ft("-q", *RUN[:1], model, *RUN[1:], "--moe-cpu-threads", "999")
    assert hushed.returncode == 0, hushed.stderr
    assert hushed.stderr.strip() == "" and hushed.stdout.strip()  # no warning, banner or stats: the answer


def test_help_documents_exit_codes() -> None:
    out = ft("--help")
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    assert "Exit codes: 0 done; 1 an error" in text and "130 interrupted" in text and "NO_COLOR" in text
