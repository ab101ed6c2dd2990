"""The HTTP around a body: content types, methods, unknown paths; and plain valid requests."""

from __future__ import annotations

from urllib.parse import quote

from hypothesis import strategies as st

from .bodies import BODIES, MINIMAL, TEXT, post
from .core import CHAT, COMPLETIONS, COUNT, GET_PATHS, JSON, MESSAGES, HostileRequest, encode

ACCEPTED_TYPES = ["application/json", "application/json; charset=utf-8", "application/json;charset=UTF-8"]
OTHER_TYPES = [
    None,
    "",
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=xyz",
    "application/xml",
    "application/jsonx",
    "application/json; charset=latin-1",
    "APPLICATION/JSON",
    "application/vnd.api+json",
    "text/event-stream",
]


@st.composite
def content_types(draw: st.DrawFn) -> HostileRequest:
    path = draw(st.sampled_from(sorted(MINIMAL)))
    kind = draw(st.sampled_from(ACCEPTED_TYPES + OTHER_TYPES))
    body = encode(MINIMAL[path])
    if kind == "application/x-www-form-urlencoded" and draw(st.booleans()):
        body = b"model=tiny&max_tokens=2&prompt=Hello"
    elif kind and kind.startswith("multipart") and draw(st.booleans()):
        body = b'--xyz\r\nContent-Disposition: form-data; name="json"\r\n\r\n' + body + b"\r\n--xyz--\r\n"
    return post("content_type", path, body, content_type=kind, must_accept=kind in ACCEPTED_TYPES)


METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "TRACE", "FOO", "get"]
ROUTES = {
    CHAT: "POST",
    COMPLETIONS: "POST",
    MESSAGES: "POST",
    COUNT: "POST",
    **dict.fromkeys(GET_PATHS, "GET"),
}


@st.composite
def wrong_method(draw: st.DrawFn) -> HostileRequest:
    path = draw(st.sampled_from(sorted(ROUTES)))
    method = draw(st.sampled_from([m for m in METHODS if m != ROUTES[path]]))  # HEAD too: 405 or 200
    body = encode(MINIMAL[path]) if path in MINIMAL and draw(st.booleans()) else b""
    return HostileRequest("wrong_method", method, path, {"content-type": JSON} if body else {}, body)


UNKNOWN_PATHS = [
    "/",
    "/v1",
    "/v1/",
    "/V1/models",
    "/v1/chat/completions/",
    "/v1//models",
    "//v1/models",
    "/v1/models/tiny",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/messages/batches",
    "/v1/messages/count_tokens/x",
    "/v1/messagesx",
    "/v1/messages%2Fcount_tokens",
    "/v2/chat/completions",
    "/docs",
    "/openapi.json",
    "/%2e%2e/health",
    "/v1/../health",
    "/%00",
    "/%ff%fe",
    "/%ed%a0%80",
    "/" + "a" * 8000,
    "*",
    "http://example.com/v1/models",
]


@st.composite
def unknown_path(draw: st.DrawFn) -> HostileRequest:
    path = draw(st.sampled_from(UNKNOWN_PATHS) | st.builds(lambda t: "/" + quote(t, safe="/"), TEXT))
    if draw(st.booleans()):
        return HostileRequest("unknown_path", "GET", path)
    return post("unknown_path", path, MINIMAL[CHAT])


@st.composite
def valid(draw: st.DrawFn) -> HostileRequest:
    path = draw(st.sampled_from([*sorted(BODIES), *GET_PATHS]))
    if path in GET_PATHS:
        query = draw(st.sampled_from(["", "?", "?x=1", "?limit=-1&after=%ff"]))
        return HostileRequest("valid", "GET", path + query)
    query = "?beta=true" if path.startswith(MESSAGES) and draw(st.booleans()) else ""
    headers = {"content-type": JSON}
    if path.startswith(MESSAGES):
        headers["anthropic-version"] = "2023-06-01"
    return HostileRequest(
        "valid", "POST", path + query, headers, encode(draw(BODIES[path]), draw(st.booleans()))
    )
