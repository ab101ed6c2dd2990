"""What the serve lifecycle checks share: the rows they report, the context they run in, and the pool
of default servers (handed out idle, restarted when a check left one busy).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from serve_client import Client
from serve_process import Server, describe_exit


@dataclass
class Row:
    check: str
    metric: str
    value: Any  # None: not measured
    limit: str
    ok: bool
    note: str = ""


@dataclass
class Context:
    model: str
    console: Console
    quiet: bool
    pool: Pool

    def log(self, text: str) -> None:
        if not self.quiet:
            self.console.print(f"[dim]{text}[/dim]", highlight=False)


def seconds_row(check: str, metric: str, seconds: float | None, limit: float, note: str = "") -> Row:
    ok = seconds is not None and seconds <= limit
    return Row(check, metric, None if seconds is None else round(seconds, 3), f"≤ {limit:g} s", ok, note)


def equal_row(check: str, metric: str, value: Any, expected: Any, note: str = "") -> Row:
    return Row(check, metric, value, f"= {expected}", value == expected, note)


def exit_row(check: str, code: int | None, expected: int, note: str = "") -> Row:
    if code is not None and code < 0:  # killed by a signal
        note = f"{describe_exit(code)}; {note}".rstrip("; ")
    return equal_row(check, "exit code", code, expected, note)


# ------------------------------------------------------------------------------------- servers


class Pool:
    """Servers shared between checks, keyed by their extra flags; handed out idle or restarted."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.servers: dict[tuple[str, ...], Server] = {}

    def get(self, serve_args: tuple[str, ...] = ()) -> Server:
        server = self.servers.get(serve_args)
        if server is not None and not wait_idle(server, 5.0):
            server.stop(grace=2.0)
            server = None
        if server is None:
            server = Server.start(self.model, serve_args)
            self.servers[serve_args] = server
        return server

    def close(self) -> None:
        for server in self.servers.values():
            server.stop(grace=2.0)
        self.servers.clear()


def running(client: Client) -> int | None:
    """requests.running + requests.queued from /v1/stats, None when it does not answer."""
    doc = client.stats()
    if not doc:
        return None
    requests = doc.get("requests", {})
    return int(requests.get("running", 0)) + int(requests.get("queued", 0))


def wait_idle(server: Server, timeout: float) -> bool:
    if not server.alive():
        return False
    client = server.client(timeout=2.0)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if running(client) == 0:
            return True
        time.sleep(0.05)
    return False
