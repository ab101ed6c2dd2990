"""Serve lifecycle checks a–d, on requests: a client that disconnects (streamed or not), an oversized
body (Content-Length and chunked), a huge prompt beside a small request. See serve_lifecycle.py.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

from lifecycle_base import Context, Row, equal_row, running, seconds_row
from serve_client import CHAT_PATH, Client, chat_body, cut, send_until_response
from serve_process import Server

POLL_S = 0.010


def poll_until_idle(client: Client, since: float, cap: float) -> tuple[float | None, str]:
    """Seconds from `since` until running == 0, polled every 10 ms; None (and what was seen) past `cap`."""
    last: int | None = None
    while time.monotonic() - since < cap:
        last = running(client)
        if last == 0:
            return time.monotonic() - since, ""
        time.sleep(POLL_S)
    seen = "no /v1/stats answer" if last is None else f"still running: {last}"
    return None, f"not idle after {cap:g} s ({seen})"


def cancelled(client: Client) -> int | None:
    doc = client.stats()
    return None if not doc else doc.get("requests", {}).get("cancelled")


class RssWatch:
    """Samples a process's RSS every 20 ms on a thread, for the peak during a check."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.before = server.rss_mib()
        self.peak = self.before
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            value = self.server.rss_mib()
            if value is not None and (self.peak is None or value > self.peak):
                self.peak = value

    def growth(self) -> float | None:
        self._stop.set()
        self._thread.join(1.0)
        if self.before is None or self.peak is None:
            return None
        return self.peak - self.before


def check_stream_disconnect(ctx: Context) -> list[Row]:
    name = "a stream-disconnect"
    server = ctx.pool.get()
    monitor = server.client(timeout=2.0)
    cancelled_before = cancelled(monitor)
    watch = server.client(timeout=30.0)
    stream = watch.stream(CHAT_PATH, chat_body("Tell me a long story.", 900, True, ignore_eos=True))
    try:
        if stream.status != 200:
            return [Row(name, "status", stream.status, "= 200", False, repr(stream.body()[:200]))]
        seen = 0
        for event in stream.events():
            if event.done or event.is_error:
                break
            seen += 1
            if seen >= 4:
                break
        busy = running(monitor)
        since = time.monotonic()
    finally:
        stream.abort()
    if seen < 4:
        return [Row(name, "events before the cut", seen, "≥ 4", False, "the stream ended early")]
    seconds, note = poll_until_idle(monitor, since, cap=10.0)
    note = note or f"running before the cut: {busy}"
    rows = [seconds_row(name, "s to running = 0", seconds, 1.0, note)]
    return rows + cancelled_rows(name, monitor, cancelled_before)


def cancelled_rows(name: str, monitor: Client, before: int | None) -> list[Row]:
    """requests.cancelled went up: the request was cancelled, not finished (only where /v1/stats says)."""
    after = cancelled(monitor)
    if before is None or after is None:
        return []
    return [Row(name, "requests.cancelled +", after - before, "≥ 1", after > before)]


def check_nonstream_disconnect(ctx: Context) -> list[Row]:
    name = "b nonstream-disconnect"
    server = ctx.pool.get()
    monitor = server.client(timeout=2.0)
    cancelled_before = cancelled(monitor)
    client = server.client(timeout=30.0)
    conn = client.connect()
    body = json.dumps(chat_body("Tell me a long story.", 900, False, ignore_eos=True)).encode()
    try:
        conn.request(
            "POST", CHAT_PATH, body=body, headers=client.headers({"Content-Type": "application/json"})
        )
        time.sleep(0.5)
        busy = running(monitor)
        since = time.monotonic()
    finally:
        cut(conn)
    if not busy:
        return [Row(name, "running before the cut", busy, "≥ 1", False, "the request was not running")]
    seconds, note = poll_until_idle(monitor, since, cap=10.0)
    rows = [seconds_row(name, "s to running = 0", seconds, 1.0, note or f"running before the cut: {busy}")]
    return rows + cancelled_rows(name, monitor, cancelled_before)


BIG_BODY = 30 << 20


def _head(server: Server, extra: str) -> bytes:
    auth = f"Authorization: Bearer {server.api_key}\r\n" if server.api_key else ""
    return (
        f"POST {CHAT_PATH} HTTP/1.1\r\nHost: {server.host}:{server.port}\r\n"
        f"Content-Type: application/json\r\n{auth}{extra}\r\n"
    ).encode()


def _big_json_pieces(total: int) -> Iterator[bytes]:
    """A chat request of exactly `total` bytes, as pieces of at most 1 MiB (one filler block reused)."""
    prefix = b'{"max_tokens": 4, "messages": [{"role": "user", "content": "'
    suffix = b'"}]}'
    filler = total - len(prefix) - len(suffix)
    block = b"abcdefg " * (1 << 17)  # 1 MiB
    yield prefix
    while filler > 0:
        yield block[: min(filler, len(block))]
        filler -= len(block)
    yield suffix


def _chunked(pieces: Iterator[bytes]) -> Iterator[bytes]:
    for piece in pieces:
        yield b"%x\r\n" % len(piece) + piece + b"\r\n"
    yield b"0\r\n\r\n"


def check_body_limit(ctx: Context) -> list[Row]:
    name = "c body-limit"
    server = ctx.pool.get(("--max-body-mib", "1"))
    rows = []
    variants = (
        ("content-length", f"Content-Length: {BIG_BODY}\r\n", _big_json_pieces(BIG_BODY)),
        ("chunked", "Transfer-Encoding: chunked\r\n", _chunked(_big_json_pieces(BIG_BODY))),
    )
    for label, header, pieces in variants:
        if not server.alive():
            server = ctx.pool.get(("--max-body-mib", "1"))
        rss = RssWatch(server)
        result = send_until_response(server.host, server.port, _head(server, header), pieces, timeout=15.0)
        time.sleep(0.3)  # let a server that buffers the body finish growing
        growth = rss.growth()
        sent = f"sent {result.sent_bytes / 2**20:.1f} MiB, ended: {result.note}"
        rows.append(equal_row(name, f"{label}: status", result.status, 413, sent))
        rows.append(seconds_row(name, f"{label}: s to status line", result.status_s, 1.0))
        rows.append(
            Row(
                name,
                f"{label}: RSS growth MiB",
                None if growth is None else round(growth, 1),
                "≤ 100 MiB",
                growth is not None and growth <= 100,
                "" if server.alive() else "the server died",
            )
        )
    return rows


def _words_mib(mib: float, seed: int = 0) -> bytes:
    """ASCII words and spaces, `mib` MiB, built by repeating a random 1 MiB block (fast, word-split)."""
    rng = random.Random(seed)
    vocab = ("stone", "river", "cloud", "garden", "engine", "window", "silver", "market", "forest", "letter")
    block = " ".join(rng.choices(vocab, k=(1 << 20) // 6)).encode()[: 1 << 20]
    whole, rest = divmod(int(mib * (1 << 20)), 1 << 20)
    return block * whole + block[:rest]


def check_huge_prompt(ctx: Context) -> list[Row]:
    name = "d huge-prompt"
    server = ctx.pool.get()
    content = _words_mib(30)
    body = b'{"max_tokens": 4, "messages": [{"role": "user", "content": "%s"}]}' % content
    client = server.client(timeout=30.0)
    conn = client.connect()
    small: dict[str, Any] = {}

    def small_request() -> None:
        t0 = time.monotonic()
        try:
            status, _ = server.client(timeout=30.0).post_json(
                CHAT_PATH, chat_body("hi", 4, False), timeout=30.0
            )
            small.update(status=status)
        except (OSError, http.client.HTTPException) as exc:
            small.update(status=None, error=f"{type(exc).__name__}: {exc}")
        small["seconds"] = time.monotonic() - t0

    t0 = time.monotonic()
    status: int | None = None
    note = ""
    side = threading.Thread(target=small_request, daemon=True)
    try:
        conn.putrequest("POST", CHAT_PATH)
        for key, value in client.headers({"Content-Type": "application/json"}).items():
            conn.putheader(key, value)
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            conn.send(body)
        uploaded = time.monotonic() - t0
        side.start()  # the server is now parsing / rendering / tokenizing the big one
        resp = conn.getresponse()
        status = resp.status
        detail = resp.read()[:160].decode("utf-8", errors="replace")
        note = f"upload {uploaded:.2f} s; {detail}"
    except TimeoutError:
        note = "no answer in 30 s"
    except (OSError, http.client.HTTPException) as exc:
        note = f"{type(exc).__name__}: {exc}"
    finally:
        seconds = time.monotonic() - t0
        cut(conn)
    if side.ident is not None:  # started
        side.join(35.0)
    rows = [
        equal_row(name, "status", status, 400, note),
        seconds_row(name, "s to the answer", seconds if status is not None else None, 2.0),
    ]
    if "seconds" in small:
        small_ok = small.get("status") == 200
        small_note = f"status {small.get('status')} after {small['seconds']:.2f} s {small.get('error', '')}"
        rows.append(
            seconds_row(
                name,
                "concurrent small request s",
                small["seconds"] if small_ok else None,
                2.0,
                small_note.rstrip(),
            )
        )
    else:
        rows.append(Row(name, "concurrent small request s", None, "≤ 2 s", False, "not sent"))
    return rows
