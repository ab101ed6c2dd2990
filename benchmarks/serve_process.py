"""The serve benchmarks' `freetoken serve` child processes: starting, waiting, signalling, killing; RSS.

    with Server.start("demo", ["--max-body-mib", "1"]) as server:
        status, doc = server.client().post_json("/v1/chat/completions", {...})
        print(server.rss_mib())

Every server started here runs in its own session (a Ctrl-C at the terminal reaches only the
benchmark) and is killed when the benchmark exits, however it exits.
"""

from __future__ import annotations

import atexit
import contextlib
import http.client
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from serve_client import Client

_LIVE: set[Server] = set()
READY_TIMES: list[float] = []  # seconds from spawn to a healthy /health, every server started here


def freetoken_command() -> list[str]:
    """The `freetoken` console script beside this interpreter, else on PATH, else `python -m freetoken`."""
    beside = Path(sys.executable).parent / "freetoken"
    if beside.exists():
        return [str(beside)]
    found = shutil.which("freetoken")
    return [found] if found else [sys.executable, "-m", "freetoken"]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def rss_mib(pid: int) -> float | None:
    """Resident set size of `pid` in MiB (VmRSS), None once it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def exit_on_sigterm() -> None:
    """A SIGTERM to the benchmark unwinds like Ctrl-C, so `finally` blocks kill the servers."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def describe_exit(code: int | None) -> str:
    if code is None:
        return "running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"{code} ({signal.Signals(-code).name})"
    return str(code)


# ---------------------------------------------------------------------------------------- server


class ServerError(RuntimeError):
    pass


@dataclass(eq=False)
class Server:
    """A `freetoken serve` child process on a free port, its stdout and stderr in temporary files."""

    proc: subprocess.Popen[bytes]
    host: str
    port: int
    args: list[str]
    api_key: str | None = None
    log_dir: tempfile.TemporaryDirectory[str] = field(default_factory=tempfile.TemporaryDirectory)
    started_at: float = field(default_factory=time.monotonic)
    ready_s: float | None = None  # seconds from spawn to the first healthy /health

    @classmethod
    def spawn(
        cls,
        model: str = "demo",
        serve_args: Iterable[str] = (),
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        api_key: str | None = None,
    ) -> Server:
        """Start the process; does not wait for it (see wait_ready)."""
        port = port or free_port(host)
        args = [*freetoken_command(), "serve", model, "--host", host, "--port", str(port)]
        if api_key:
            args += ["--api-key", api_key]
        args += list(serve_args)
        log_dir = tempfile.TemporaryDirectory(prefix="ft-serve-")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        logs = Path(log_dir.name)
        with open(logs / "stdout", "wb") as out, open(logs / "stderr", "wb") as err:
            proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env, start_new_session=True
            )
        server = cls(proc, host, port, args, api_key, log_dir)
        _LIVE.add(server)
        return server

    @classmethod
    def start(
        cls,
        model: str = "demo",
        serve_args: Iterable[str] = (),
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        api_key: str | None = None,
        timeout: float = 300.0,
    ) -> Server:
        """Start and wait for /health; ServerError (with the server's last stderr lines) if it never is."""
        server = cls.spawn(model, serve_args, host=host, port=port, api_key=api_key)
        try:
            server.wait_ready(timeout)
        except BaseException:
            server.stop()
            raise
        return server

    @property
    def pid(self) -> int:
        return self.proc.pid

    def client(self, timeout: float = 10.0) -> Client:
        return Client(self.host, self.port, timeout=timeout, api_key=self.api_key)

    def wait_ready(self, timeout: float = 300.0) -> float:
        deadline = time.monotonic() + timeout
        client = self.client(timeout=2.0)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(
                    f"server exited with {describe_exit(self.proc.returncode)}: {self.stderr_tail()}"
                )
            with contextlib.suppress(OSError, http.client.HTTPException, ValueError):
                status, _ = client.get_json("/health")
                if status == 200:
                    self.ready_s = time.monotonic() - self.started_at
                    READY_TIMES.append(self.ready_s)
                    return self.ready_s
            time.sleep(0.1)
        raise ServerError(f"no healthy /health after {timeout:.0f} s: {self.stderr_tail()}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss_mib(self) -> float | None:
        return rss_mib(self.pid) if self.alive() else None

    def signal(self, signum: int) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def wait(self, timeout: float) -> int | None:
        """The exit code, or None if it is still running after `timeout` seconds."""
        try:
            return self.proc.wait(timeout=max(timeout, 0.0))
        except subprocess.TimeoutExpired:
            return None

    def stop(self, grace: float = 5.0) -> int | None:
        """SIGINT, then SIGKILL after `grace` seconds; safe to call twice."""
        if self.alive():
            self.signal(signal.SIGINT)
            if self.wait(grace) is None:
                self.signal(signal.SIGKILL)
                self.wait(5.0)
        _LIVE.discard(self)
        return self.proc.returncode

    def stderr_text(self) -> str:
        try:
            return (Path(self.log_dir.name) / "stderr").read_text(errors="replace")
        except OSError:
            return ""

    def stdout_text(self) -> str:
        try:
            return (Path(self.log_dir.name) / "stdout").read_text(errors="replace")
        except OSError:
            return ""

    def stderr_tail(self, lines: int = 3) -> str:
        tail = [line for line in self.stderr_text().splitlines() if line.strip()][-lines:]
        return " | ".join(tail) or "(no stderr)"

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def kill_all_servers() -> None:
    for server in list(_LIVE):
        server.stop(grace=2.0)


atexit.register(kill_all_servers)
