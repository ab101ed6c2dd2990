"""The client examples run as shipped against a live server, found through --base-url / --model or
FREETOKEN_URL / FREETOKEN_MODEL."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import API_KEY, Server

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("script", ["openai_client.py", "anthropic_client.py"])
@pytest.mark.parametrize("via", ["flag", "env"])
def test_client_example_streams_an_answer(server: Server, script: str, via: str) -> None:
    env = {**os.environ, "FREETOKEN_API_KEY": API_KEY}
    args = [sys.executable, str(EXAMPLES / script)]
    if via == "flag":
        args += ["--base-url", server.url, "--model", "tiny"]
        env.pop("FREETOKEN_URL", None)
        env.pop("FREETOKEN_MODEL", None)
    else:
        env["FREETOKEN_URL"], env["FREETOKEN_MODEL"] = server.url, "tiny"
    out = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1].startswith("[")  # the usage line after the streamed text
