"""What a hostile request is, and how its JSON text is written.

The endpoints (`CHAT`, `COMPLETIONS`, `MESSAGES`, `COUNT`), the `HostileRequest` and its `Answer`;
`encode` writes JSON and puts a `Raw` value into the text as it is (NaN, 1e999, a lone surrogate escape,
invalid UTF-8); `put` sets (or, with `DELETE`, removes) one field deep inside a body.
"""

from __future__ import annotations

import copy
import itertools
import json
from dataclasses import dataclass, field
from typing import Any

CHAT, COMPLETIONS, MESSAGES, COUNT = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
)
GENERATING = (CHAT, COMPLETIONS, MESSAGES)
GET_PATHS = ("/v1/models", "/health", "/metrics", "/v1/stats")
VOCAB = 700  # ids below this exist in the tiny test model (708 tokens); the fuzz aims past it on purpose
JSON = "application/json"


@dataclass(frozen=True)
class Raw:
    """JSON text written into the body as it is."""

    text: bytes


DELETE = object()  # a field value that removes the field


@dataclass(frozen=True)
class HostileRequest:
    kind: str
    method: str
    path: str
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    must_accept: bool = False  # a plain valid request: anything but a 2xx is a failure

    def __repr__(self) -> str:
        body = self.body if len(self.body) <= 400 else self.body[:400] + b"...(%d bytes)" % len(self.body)
        return f"HostileRequest({self.kind}: {self.method} {self.path[:200]} {self.headers} {body!r})"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # hypothesis prints examples with this
        printer.text(repr(self))


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes


# ---------------------------------------------------------------------------------------------- JSON text


def encode(value: Any, ensure_ascii: bool = True) -> bytes:
    """JSON bytes of `value`, `Raw` pieces verbatim. Without ensure_ascii, lone surrogates in a str are
    written as their (invalid) UTF-8 bytes."""
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        items = (encode(str(k), ensure_ascii) + b":" + encode(v, ensure_ascii) for k, v in value.items())
        return b"{" + b",".join(items) + b"}"
    if isinstance(value, list | tuple):
        return b"[" + b",".join(encode(v, ensure_ascii) for v in value) + b"]"
    return json.dumps(value, ensure_ascii=ensure_ascii).encode("utf-8", "surrogatepass")


def put(body: dict[str, Any], path: tuple[str | int, ...], value: Any) -> dict[str, Any]:
    """A copy of `body` with the field at `path` set to `value` (removed, for DELETE). Containers on the
    way that are missing or of the wrong kind are made; an int indexes an existing item (clamped)."""
    out = copy.deepcopy(body)
    node: Any = out
    for key, after in itertools.pairwise(path):
        want = list if isinstance(after, int) else dict
        key = _slot(node, key)
        if not isinstance(node.get(key) if isinstance(node, dict) else node[key], want):
            node[key] = want()
        node = node[key]
    last = _slot(node, path[-1])
    if value is not DELETE:
        node[last] = value
    elif isinstance(node, dict):
        node.pop(last, None)
    else:
        del node[last]
    return out


def _slot(node: Any, key: str | int) -> str | int:
    if isinstance(key, int):
        if not node:
            node.append({})
        return max(-len(node), min(key, len(node) - 1))
    return key
