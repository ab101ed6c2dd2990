"""The server's life: its socket bound before the model loads, and a shutdown that lets work finish.

SIGTERM or SIGINT: stop admitting (new connections are not accepted, new requests on open ones get
503), let running requests finish for up to `shutdown_timeout_s`, then fail what is left (streams end
with an error event, others answer 503) and exit 0. A second signal exits at once.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
from types import FrameType

import uvicorn

from freetoken.errors import FreeTokenError
from freetoken.serve.app import create_app
from freetoken.serve.state import ServeState, is_loopback

log = logging.getLogger("freetoken.serve")


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, so a port in use is found before the model loads (exit code 2)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise FreeTokenError(f"--host {host}: cannot resolve it ({exc.strerror})", exit_code=2) from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise FreeTokenError(f"cannot listen on {host}:{port}: {exc.strerror}", exit_code=2) from None
    sock.set_inheritable(True)
    return sock


def address_lines(sock: socket.socket, names: tuple[str, ...], keyed: bool) -> tuple[str, str | None]:
    """(where the server answers, a warning or None): its base URL and the two protocols' paths; a
    warning when it listens beyond loopback with no API key (anyone who reaches the port can use it)."""
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    base = f"http://{shown}:{port}"
    served = ", ".join(repr(name) for name in names)
    line = f"serving {served} at {base} (OpenAI: {base}/v1, Anthropic: {base}/v1/messages)"
    if keyed or is_loopback(host):
        return line, None
    return line, f"listening on {host} without --api-key: anyone who can reach port {port} can use this model"


class GracefulServer(uvicorn.Server):
    """uvicorn's server with the drain above: the first signal starts it, a second forces the exit."""

    def __init__(self, config: uvicorn.Config, state: ServeState) -> None:
        super().__init__(config)
        self.serve_state = state
        self._deadline: threading.Timer | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        batcher = self.serve_state.batcher
        if self.should_exit:
            self.force_exit = True
            batcher.fail_all("the server stopped")
        else:
            timeout = self.serve_state.config.shutdown_timeout_s
            log.info("shutting down: %d running request(s) get %.0f s", batcher.running, timeout)
            self.serve_state.draining = True
            batcher.refuse_new("the server is shutting down")
            reason = f"the server shut down ({timeout:.0f} s for running requests ran out)"
            self._deadline = threading.Timer(timeout, batcher.fail_all, args=(reason,))
            self._deadline.daemon = True
            self._deadline.start()
        super().handle_exit(sig, frame)


def serve_forever(state: ServeState, sock: socket.socket, log_level: str = "info") -> None:
    """Serve on `sock` until a signal ends it as above; returns normally (exit code 0)."""
    grace = state.config.shutdown_timeout_s + 1.0  # the drain fails what is left first; this is a backstop
    # lifespan off: the app has no startup or shutdown hooks, and a second signal's forced exit would
    # otherwise cancel the lifespan task and log its CancelledError as a traceback
    config = uvicorn.Config(
        create_app(state), log_level=log_level, timeout_graceful_shutdown=int(grace + 0.999), lifespan="off"
    )
    server = GracefulServer(config, state)
    # uvicorn re-raises the signals it caught once it is done; handlers of ours take them, so the
    # process ends with exit code 0 instead of dying of the signal.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _after_shutdown)
    server.run(sockets=[sock])


def _after_shutdown(sig: int, frame: FrameType | None) -> None:
    """A signal after the server stopped: nothing left to do."""
