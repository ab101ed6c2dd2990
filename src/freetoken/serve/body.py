"""Reading a request body: the size limit while reading, then JSON that every handler can trust.

Trusted means: an object; nested at most MAX_DEPTH deep; every string (and key) valid Unicode without
lone surrogates (tokenizers and the template engine fail on those); every number finite (the JSON
literals NaN/Infinity and overflowing ones like 1e999 are refused). Large bodies are parsed on a worker
thread so the event loop keeps serving other requests meanwhile.
"""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from freetoken.serve.errors import ApiError, bad

MAX_DEPTH = 64
INLINE_PARSE_BYTES = 1 << 20  # parse smaller bodies on the event loop itself


async def read_json(request: Request, max_bytes: int) -> dict[str, Any]:
    """The request body as a checked JSON object; 413 past `max_bytes` (checked while reading, before
    any parsing), 400 naming what is wrong otherwise."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > max_bytes:
        raise ApiError(413, f"request body of {int(declared)} bytes is over the limit of {max_bytes}")
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > max_bytes:
            raise ApiError(413, f"request body is over the limit of {max_bytes} bytes")
    if len(raw) > INLINE_PARSE_BYTES:
        return await run_in_threadpool(parse_body, bytes(raw))
    return parse_body(bytes(raw))


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")  # JSON over HTTP is UTF-8 (RFC 8259); json.loads would guess UTF-16/32
    except UnicodeDecodeError as exc:
        raise bad("body", f"not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        body = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise bad("body", f"JSON nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:  # JSONDecodeError, or an integer of more digits than Python converts
        raise bad("body", f"not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise bad("body", "expected a JSON object")
    check_tree(body)
    return body


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def check_tree(body: Any) -> None:
    """Depth, Unicode and finiteness of a parsed document, iteratively; 400 naming the first bad place."""
    stack: list[tuple[Any, str, int]] = [(body, "", 0)]
    while stack:
        value, where, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value, where or "body")
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise bad(where or "body", f"{value} is not a finite number")
        elif isinstance(value, dict | list):
            if depth >= MAX_DEPTH:
                raise bad(where or "body", f"nested deeper than {MAX_DEPTH} levels")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                name = f"{where}.{key}" if isinstance(key, str) else f"{where}[{key}]"
                name = name.lstrip(".")
                if isinstance(key, str):
                    _check_text(key, name)
                stack.append((item, name, depth + 1))


def _check_text(text: str, where: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad(where, f"invalid Unicode: lone surrogate at character {exc.start}") from None
