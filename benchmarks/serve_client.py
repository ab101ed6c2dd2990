"""The serve benchmarks' HTTP client: JSON requests, SSE streams, and a raw socket for cut-off uploads.

Standard library only, for exact control of the bytes on the wire: requests are written with
http.client (or a raw socket where the body must stop mid-way), SSE streams are parsed line by line,
and a stream can be cut by shutting its socket down.

    client = Client.from_url("http://127.0.0.1:8000")
    status, doc = client.post_json(CHAT_PATH, chat_body("hello", 16, False))
"""

from __future__ import annotations

import contextlib
import http.client
import json
import select
import socket
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

CHAT_PATH = "/v1/chat/completions"


def parse_url(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of a base URL such as http://127.0.0.1:8000 (a path is ignored)."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    scheme = parts.scheme or "http"
    return scheme, parts.hostname or "127.0.0.1", parts.port or (443 if scheme == "https" else 80)


def connect(host: str, port: int, timeout: float, scheme: str = "http") -> http.client.HTTPConnection:
    if scheme == "https":
        return http.client.HTTPSConnection(host, port, timeout=timeout)
    return http.client.HTTPConnection(host, port, timeout=timeout)


def cut(conn: http.client.HTTPConnection) -> None:
    """Close the connection now: shut the socket down (the peer sees EOF at once), then close it."""
    if conn.sock is not None:
        with contextlib.suppress(OSError):
            conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()


@dataclass
class SseEvent:
    event: str | None  # the `event:` field (Anthropic), None for data-only streams (OpenAI)
    data: str

    @property
    def done(self) -> bool:
        return self.data == "[DONE]"

    def json(self) -> Any:
        try:
            return json.loads(self.data)
        except ValueError:
            return None

    @property
    def is_error(self) -> bool:
        doc = self.json()
        return self.event == "error" or (isinstance(doc, dict) and "error" in doc)


class SseStream:
    """A streamed response: status first, then events until EOF. `abort()` cuts the connection."""

    def __init__(self, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse) -> None:
        self.conn, self.resp = conn, resp
        self.status = resp.status

    def body(self) -> bytes:
        return self.resp.read()

    def events(self) -> Iterator[SseEvent]:
        """Events as they arrive; ends at EOF. Socket errors and timeouts propagate."""
        name: str | None = None
        data: list[str] = []
        while True:
            raw = self.resp.readline()
            if not raw:
                if data:
                    yield SseEvent(name, "\n".join(data))
                return
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            if not line:
                if data:
                    yield SseEvent(name, "\n".join(data))
                name, data = None, []
            elif line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
            elif line.startswith("event:"):
                name = line[6:].strip()

    def abort(self) -> None:
        cut(self.conn)
        with contextlib.suppress(Exception):
            self.resp.close()

    def close(self) -> None:
        self.abort()


class Client:
    """JSON over http.client; one keep-alive connection, reopened after any failure."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        timeout: float = 10.0,
        api_key: str | None = None,
        scheme: str = "http",
    ) -> None:
        self.host, self.port, self.timeout, self.api_key, self.scheme = host, port, timeout, api_key, scheme
        self._conn: http.client.HTTPConnection | None = None

    @classmethod
    def from_url(cls, url: str, timeout: float = 10.0, api_key: str | None = None) -> Client:
        scheme, host, port = parse_url(url)
        return cls(host, port, timeout=timeout, api_key=api_key, scheme=scheme)

    def headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        out = {"Accept": "*/*"}
        if self.api_key:
            out["Authorization"] = f"Bearer {self.api_key}"
        return {**out, **(extra or {})}

    def connect(self, timeout: float | None = None) -> http.client.HTTPConnection:
        return connect(self.host, self.port, self.timeout if timeout is None else timeout, self.scheme)

    def request(
        self, method: str, path: str, body: bytes | None = None, timeout: float | None = None
    ) -> tuple[int, bytes]:
        """One request; a kept-alive connection that the server has closed meanwhile is retried once."""
        for attempt in (0, 1):
            reused = self._conn is not None and timeout is None
            if not reused:
                self.close()
                self._conn = self.connect(timeout)
            conn = self._conn
            assert conn is not None
            headers = self.headers({"Content-Type": "application/json"} if body is not None else None)
            try:
                conn.request(method, path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self.close()
                if reused and attempt == 0:
                    continue
                raise
            except BaseException:
                self.close()
                raise
            if resp.will_close or timeout is not None:
                self.close()
            return resp.status, data
        raise AssertionError("unreachable")

    def get_json(self, path: str, timeout: float | None = None) -> tuple[int, Any]:
        status, data = self.request("GET", path, timeout=timeout)
        return status, _loads(data)

    def post_json(self, path: str, doc: Any, timeout: float | None = None) -> tuple[int, Any]:
        status, data = self.request("POST", path, json.dumps(doc).encode(), timeout=timeout)
        return status, _loads(data)

    def stream(self, path: str, doc: Any, timeout: float | None = None) -> SseStream:
        """POST `doc` on a fresh connection and return once the status line and headers are in."""
        conn = self.connect(timeout)
        try:
            conn.request(
                "POST",
                path,
                body=json.dumps(doc).encode(),
                headers=self.headers({"Content-Type": "application/json", "Accept": "text/event-stream"}),
            )
            return SseStream(conn, conn.getresponse())
        except BaseException:
            cut(conn)
            raise

    def stats(self) -> dict[str, Any] | None:
        """GET /v1/stats, None when it does not answer 200 with JSON within the client's timeout."""
        try:
            status, doc = self.get_json("/v1/stats")
        except (OSError, http.client.HTTPException):
            return None
        return doc if status == 200 and isinstance(doc, dict) else None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _loads(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return data.decode("utf-8", errors="replace")


def chat_body(
    content: str, max_tokens: int, stream: bool, model: str | None = None, **extra: Any
) -> dict[str, Any]:
    """An OpenAI chat request with one user message; no `model` field unless given (the server's own)."""
    doc: dict[str, Any] = {"model": model} if model else {}
    return doc | {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": stream,
        **extra,
    }


# ------------------------------------------------------------------------------------ raw socket


@dataclass
class RawResult:
    status: int | None  # None: no status line came back
    status_s: float | None  # seconds from the first byte sent to the status line
    sent_bytes: int
    note: str  # how it ended: "response", "closed by server", "timeout", an OSError


def send_until_response(
    host: str, port: int, head: bytes, body: Iterable[bytes], timeout: float = 10.0
) -> RawResult:
    """Send `head` then the `body` pieces over one socket, and stop sending as soon as anything comes
    back: non-blocking sends interleaved with select(), so a server that answers early (413) is seen at
    once rather than after the whole upload. Reads until the status line is in."""
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.setblocking(False)
    pieces = iter([head])
    body_iter = iter(body)
    pending = memoryview(b"")
    received = b""
    sent = 0
    started = time.monotonic()
    deadline = started + timeout
    note = "timeout"
    writing = True
    try:
        while time.monotonic() < deadline:
            if writing and not pending:
                piece = next(pieces, None)
                if piece is None:
                    piece = next(body_iter, None)
                if piece is None:
                    writing = False
                else:
                    pending = memoryview(piece)
            readable, writable, _ = select.select(
                [sock], [sock] if writing else [], [], max(0.0, min(0.5, deadline - time.monotonic()))
            )
            if readable:
                try:
                    chunk = sock.recv(65536)
                except BlockingIOError:
                    chunk = None
                except OSError as exc:
                    note = f"recv: {exc.strerror or exc}"
                    break
                if chunk == b"":
                    note = "closed by server"
                    break
                if chunk:
                    received += chunk
                    if b"\r\n" in received:
                        note = "response"
                        break
            if writable and pending:
                try:
                    n = sock.send(pending[: 1 << 20])
                    sent += n
                    pending = pending[n:]
                except BlockingIOError:
                    pass
                except OSError as exc:  # EPIPE / ECONNRESET: the server stopped reading; a reply may be in
                    writing, pending = False, memoryview(b"")
                    note = f"send: {exc.strerror or exc}"
        elapsed = time.monotonic() - started
    finally:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()
    status = None
    line = received.split(b"\r\n", 1)[0].split()
    if len(line) >= 2 and line[0].startswith(b"HTTP/") and line[1].isdigit():
        status = int(line[1])
    return RawResult(status, elapsed if status is not None else None, sent, note)
