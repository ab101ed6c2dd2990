"""Serve lifecycle checks e–h, on signals and start-up: SIGTERM drains a stream, a second SIGTERM
ends the drain, SIGINT stops an idle server, a busy port fails fast. See serve_lifecycle.py.
"""

from __future__ import annotations

import contextlib
import http.client
import signal
import socket
import threading
import time
from typing import Any

from lifecycle_base import Context, Row, equal_row, exit_row, seconds_row
from serve_client import CHAT_PATH, chat_body
from serve_process import READY_TIMES, Server, describe_exit

LONG_TOKENS = 4000  # for the signal checks: far longer than the drain (capped at the context)


class StreamWatch(threading.Thread):
    """Reads a streamed chat request on its own thread and records how it ended."""

    def __init__(self, server: Server, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.client = server.client(timeout=60.0)
        self.body = chat_body("Tell me a very long story.", max_tokens, True, ignore_eos=True)
        self.status: int | None = None
        self.content_events = 0
        self.error_data: str | None = None
        self.end: str | None = None  # [DONE] | error event | EOF without [DONE] | cut (...) | HTTP n
        self.end_at: float | None = None
        self.started_at = time.monotonic()
        self.first_content = threading.Event()
        self.stream: Any = None

    def run(self) -> None:
        try:
            self.stream = self.client.stream(CHAT_PATH, self.body)
            self.status = self.stream.status
            if self.status != 200:
                self.end = f"HTTP {self.status}: {self.stream.body()[:200]!r}"
                return
            for event in self.stream.events():
                if event.done:
                    self.end = self.end or "[DONE]"
                    break
                if event.is_error:
                    self.end, self.error_data = "error event", event.data
                    continue  # read on: how the stream closes after it does not change the verdict
                doc = event.json()
                if isinstance(doc, dict) and any(
                    (c.get("delta") or {}).get("content") for c in doc.get("choices") or ()
                ):
                    self.content_events += 1
                    self.first_content.set()
            else:
                self.end = self.end or "EOF without [DONE]"
        except TimeoutError:
            self.end = self.end or "timeout (60 s without data)"
        except (OSError, http.client.HTTPException) as exc:
            self.end = self.end or f"cut ({type(exc).__name__})"
        finally:
            self.end_at = time.monotonic()
            self.first_content.set()

    def abort(self) -> None:
        if self.stream is not None:
            self.stream.abort()


def probe_refused(server: Server, timeout: float = 3.0) -> tuple[str, bool]:
    """A new small request: refused (connection refused, or 503) is what a draining server should do."""
    client = server.client(timeout=timeout)
    try:
        status, _ = client.post_json(CHAT_PATH, chat_body("hello", 4, False), timeout=timeout)
    except ConnectionRefusedError:
        return "connection refused", True
    except TimeoutError:
        return f"no answer in {timeout:g} s", False
    except (OSError, http.client.HTTPException) as exc:
        return f"{type(exc).__name__}: {exc}", False
    finally:
        client.close()
    return f"HTTP {status}", status == 503


def _signal_setup(ctx: Context, name: str) -> tuple[Server, StreamWatch] | list[Row]:
    """A --shutdown-timeout 5 server with a long stream that has produced content for 1 s."""
    server = Server.start(ctx.model, ["--shutdown-timeout", "5"])
    watch = StreamWatch(server, LONG_TOKENS)
    watch.start()
    if not watch.first_content.wait(30.0) or watch.content_events == 0:
        server.stop()
        return [Row(name, "stream started", watch.end or "no content in 30 s", "content", False)]
    time.sleep(max(0.0, watch.started_at + 1.0 - time.monotonic()))
    return server, watch


def check_sigterm_drain(ctx: Context) -> list[Row]:
    name = "e sigterm-drain"
    setup = _signal_setup(ctx, name)
    if isinstance(setup, list):
        return setup
    server, watch = setup
    try:
        signalled = time.monotonic()
        server.signal(signal.SIGTERM)
        time.sleep(0.5)
        probe, refused = probe_refused(server)
        code = server.wait(signalled + 15.0 - time.monotonic())
        exit_s = time.monotonic() - signalled if code is not None else None
        if code is None:  # the stream's fate is judged at the timeout, before the kill cuts it
            open_at_kill = watch.end is None
            server.stop(grace=1.0)
        else:
            open_at_kill = False
        watch.join(5.0)
    finally:
        server.stop(grace=1.0)
        watch.abort()
    exit_note = "" if code is not None else "still running 15 s after SIGTERM (killed)"
    if open_at_kill:
        stream_end, stream_note = "still open", "still open when the server was killed"
    else:
        stream_end = watch.end or "still open"
        stream_note = (
            f"ended {watch.end_at - signalled:.2f} s after SIGTERM, {watch.content_events} content events"
            if watch.end_at is not None
            else "still open 5 s after the server exited"
        )
    if watch.error_data:
        stream_note += f"; {watch.error_data[:120]}"
    return [
        exit_row(name, code, 0, exit_note),
        seconds_row(name, "s from SIGTERM to exit", exit_s, 7.0, exit_note),
        equal_row(name, "stream ended with", stream_end, "error event", stream_note),
        Row(name, "new request while draining", probe, "refused or 503", refused),
    ]


def check_second_signal(ctx: Context) -> list[Row]:
    name = "f second-signal"
    setup = _signal_setup(ctx, name)
    if isinstance(setup, list):
        return setup
    server, watch = setup
    try:
        server.signal(signal.SIGTERM)
        time.sleep(0.5)
        if not server.alive():
            code = server.proc.returncode
            return [Row(name, "alive after the 1st SIGTERM", describe_exit(code), "running", False)]
        second = time.monotonic()
        server.signal(signal.SIGTERM)
        code = server.wait(10.0)
        seconds = time.monotonic() - second if code is not None else None
    finally:
        server.stop(grace=1.0)
        watch.abort()
    note = f"exit code {describe_exit(code)}" if code is not None else "still running 10 s later (killed)"
    return [seconds_row(name, "s from 2nd SIGTERM to exit", seconds, 2.0, note)]


def check_sigint_idle(ctx: Context) -> list[Row]:
    name = "g sigint-idle"
    server = Server.start(ctx.model)
    try:
        signalled = time.monotonic()
        server.signal(signal.SIGINT)
        code = server.wait(15.0)
        seconds = time.monotonic() - signalled if code is not None else None
    finally:
        server.stop(grace=1.0)
    note = "" if code is not None else "still running 15 s after SIGINT (killed)"
    return [
        exit_row(name, code, 0, note),
        seconds_row(name, "s from SIGINT to exit", seconds, 2.0, note),
    ]


def _port_in_use_once(model: str) -> tuple[int | None, float | None, list[str]]:
    """Start the server on the port of a listening socket: (exit code, seconds to exit, stderr lines)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        t0 = time.monotonic()
        server = Server.spawn(model, port=holder.getsockname()[1])
        try:
            code = server.wait(60.0)
            seconds = time.monotonic() - t0 if code is not None else None
        finally:
            server.stop(grace=1.0)
    return code, seconds, [line for line in server.stderr_text().splitlines() if line.strip()]


def check_port_in_use(ctx: Context) -> list[Row]:
    """`Quick` is measured against a normal start of the same model on this machine (the fastest start
    seen in this run, or one made here): a server that loads the model before binding cannot beat it.
    Two attempts, the faster counts (a busy machine only ever adds time)."""
    name = "h port-in-use"
    code, seconds, lines = _port_in_use_once(ctx.model)
    attempts = [seconds]
    if code is not None:
        code2, seconds2, _ = _port_in_use_once(ctx.model)
        attempts.append(seconds2)
        if code2 == code and seconds2 is not None and seconds is not None:
            seconds = min(seconds, seconds2)
    if not READY_TIMES:
        with contextlib.suppress(Exception):
            Server.start(ctx.model).stop()
    normal = min(READY_TIMES) if READY_TIMES else None
    one_line = len(lines) == 1 and lines[0].startswith("error:")
    shown = " | ".join(lines[:2])[:160] + (f" (+{len(lines) - 2} more lines)" if len(lines) > 2 else "")
    tries = ", ".join("n/a" if a is None else f"{a:.2f}" for a in attempts)
    quick_note = f"attempts {tries} s" if code is not None else "still running 60 s later (killed)"
    quick = Row(
        name,
        "s to exit",
        None if seconds is None else round(seconds, 3),
        "n/a" if normal is None else f"< {normal:.2f} s (normal start)",
        seconds is not None and normal is not None and seconds < normal,
        quick_note,
    )
    return [
        exit_row(name, code, 2),
        quick,
        Row(name, "stderr", f"{len(lines)} line(s)", "1 line, error: …", one_line, shown),
    ]
