"""The checks every request passes before a handler sees it, as plain ASGI middleware.

In order: the Host header (on a loopback bind, only loopback names or --allowed-hosts: a web page that
rebinds its own DNS name to 127.0.0.1 is refused, 403); the API key (401); for POST, a JSON content type
(415: a form post or text/plain is how a page reaches a local server without a CORS preflight); and
while shutting down, 503. Errors come in the protocol's schema of the path.
"""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from freetoken.serve.errors import error_response
from freetoken.serve.state import ServeState, is_loopback

OPEN_PATHS = ("/health",)
METRICS_PATHS = ("/metrics", "/v1/stats")


def host_name(host: str) -> str:
    """The name part of a Host header: without the port; IPv6 literals keep their brackets."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class RequestGuard:
    def __init__(self, app: ASGIApp, state: ServeState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self.refusal(scope)
        if refusal is not None:
            status, message = refusal
            await error_response(scope["path"], status, message)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def refusal(self, scope: Scope) -> tuple[int, str] | None:
        config, path = self.state.config, scope["path"]
        headers = Headers(scope=scope)
        allowed = config.allowed_hosts
        host = headers.get("host")
        if allowed is not None and host is not None:
            name = host_name(host)
            if name not in allowed and not is_loopback(name):
                return 403, f"Host {name!r} is not allowed here (loopback names only; see --allowed-hosts)"
        open_path = path in OPEN_PATHS or (config.public_metrics and path in METRICS_PATHS)
        if config.api_key and not open_path and not _key_matches(headers, config.api_key):
            return 401, "invalid or missing API key"
        if scope["method"] == "POST":
            kind = headers.get("content-type", "").split(";")[0].strip().lower()
            if kind != "application/json":
                return 415, f"Content-Type must be application/json, got {kind or 'none'!r}"
            if self.state.draining:
                return 503, "the server is shutting down"
        return None


def _key_matches(headers: Headers, key: str) -> bool:
    given = headers.get("x-api-key") or ""
    auth = headers.get("authorization") or ""
    if auth.lower().startswith("bearer "):
        given = given or auth[7:].strip()
    return hmac.compare_digest(given.encode("utf-8", "replace"), key.encode())
