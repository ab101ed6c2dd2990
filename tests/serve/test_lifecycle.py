"""`freetoken serve` as a process: a port in use, SIGTERM with a request in flight, a second signal."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import pytest

from conftest import _free_port

CLI = [sys.executable, "-m", "freetoken"]


def start(port: int, *flags: str) -> subprocess.Popen[str]:
    cmd = [*CLI, "serve", "demo", "--port", str(port), "--moe-cpu-threads", "1", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("the server did not come up")


def stream_lines(port: int) -> Iterator[str]:
    """A long streamed chat request; yields its lines as they arrive."""
    body = {
        "messages": [{"role": "user", "content": "go"}],
        "max_tokens": 8000,
        "ignore_eos": True,
        "stream": True,
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        for raw in response:
            yield raw.decode()


def test_port_in_use_exits_2_before_loading() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start_t = time.monotonic()
        done = subprocess.run([*CLI, "serve", "demo", "--port", str(port)], capture_output=True, text=True)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert (
        len(lines) == 1 and lines[0].startswith("error: cannot listen on 127.0.0.1:") and "in use" in lines[0]
    )
    assert time.monotonic() - start_t < 30


@pytest.mark.parametrize("second_signal", [False, True])
def test_sigterm_drains_then_ends_requests_and_exits_0(second_signal: bool) -> None:
    port = _free_port()
    timeout = 2.0
    proc = start(port, "--shutdown-timeout", str(timeout))
    try:
        lines = stream_lines(port)
        assert next(lines).startswith("data: ")
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        if second_signal:
            time.sleep(0.3)
            proc.send_signal(signal.SIGTERM)
        rest = list(lines)  # the stream ends: with an error event, not a cut connection
        ended = time.monotonic() - signalled
        code = proc.wait(timeout=timeout + 5)
        exited = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "Traceback" not in proc.communicate()[1]  # a second signal too exits without one
    if second_signal:
        assert exited < 2.0
    else:
        events = [line for line in rest if line.startswith("data: ")]
        assert '"error"' in events[-1] and "shut down" in events[-1]
        assert timeout - 0.5 < ended < timeout + 1.5  # running requests had their time, then no more
        assert code == 0
        assert exited < timeout + 2


def test_sigint_on_an_idle_server_exits_0_quickly() -> None:
    port = _free_port()
    proc = start(port)
    signalled = time.monotonic()
    os.kill(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=10) == 0
    assert time.monotonic() - signalled < 3
    err = proc.communicate()[1]
    base = f"http://127.0.0.1:{port}"
    assert f"serving 'demo' at {base} (OpenAI: {base}/v1, Anthropic: {base}/v1/messages)" in err
    assert "warning" not in err and "Traceback" not in err


@pytest.mark.parametrize("keyed", [False, True])
def test_a_server_beyond_loopback_without_a_key_is_warned_of(keyed: bool) -> None:
    port = _free_port()
    proc = start(port, "--host", "0.0.0.0", *(["--api-key", "k"] if keyed else []))
    os.kill(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=10) == 0
    err = proc.communicate()[1]
    assert f"at http://0.0.0.0:{port} " in err
    warned = f"warning: listening on 0.0.0.0 without --api-key: anyone who can reach port {port} can use"
    assert (warned in err) is not keyed
