"""Errors as each protocol spells them, and field validation that names the field.

OpenAI:    {"error": {"message", "type", "param", "code"}}
Anthropic: {"type": "error", "error": {"type", "message"}}
The protocol is chosen by path: /v1/messages* is Anthropic's, everything else OpenAI's.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import JSONResponse

# status -> (OpenAI type, Anthropic type)
_TYPES = {
    400: ("invalid_request_error", "invalid_request_error"),
    401: ("authentication_error", "authentication_error"),
    403: ("permission_error", "permission_error"),
    404: ("not_found_error", "not_found_error"),
    405: ("invalid_request_error", "invalid_request_error"),
    413: ("invalid_request_error", "request_too_large"),
    415: ("invalid_request_error", "invalid_request_error"),
    429: ("rate_limit_error", "rate_limit_error"),
    499: ("invalid_request_error", "invalid_request_error"),  # the client went away
    500: ("server_error", "api_error"),
    503: ("server_error", "overloaded_error"),
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


MAX_MESSAGE = 1000  # characters: a message may quote a field name or a value the client sent


def _printable(text: str, limit: int = MAX_MESSAGE) -> str:
    """`text` safe to encode (lone surrogates escaped) and cut to `limit` characters."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def error_body(
    path: str, status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """`code`: OpenAI's error code (e.g. model_not_found); Anthropic's errors carry none."""
    message, param = _printable(message), None if param is None else _printable(param, 200)
    fallback = _TYPES[400] if 400 <= status < 500 else _TYPES[500]
    openai_type, anthropic_type = _TYPES.get(status, fallback)
    if is_anthropic(path):
        return {"type": "error", "error": {"type": anthropic_type, "message": message}}
    return {"error": {"message": message, "type": openai_type, "param": param, "code": code}}


def error_response(
    path: str, status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(path, status, message, param, code), status_code=status)


def bad(field: str, message: str) -> ApiError:
    return ApiError(400, f"{field}: {message}", param=field)


_MISSING = object()


def get(
    body: dict[str, Any],
    field: str,
    kinds: type | tuple[type, ...],
    default: Any = _MISSING,
    where: str = "",
) -> Any:
    """body[field] checked against `kinds` (bool is not an int here); a missing field is `default`, or a
    400 naming it when there is none. `where` prefixes the name (e.g. 'messages[2].')."""
    name = f"{where}{field}"
    if field not in body or body[field] is None:
        if default is _MISSING:
            raise bad(name, "field required")
        return default
    value = body[field]
    kinds_t = kinds if isinstance(kinds, tuple) else (kinds,)
    numeric = float in kinds_t and isinstance(value, int) and not isinstance(value, bool)
    if isinstance(value, bool) and bool not in kinds_t:
        raise bad(name, f"expected {_names(kinds_t)}, got a boolean")
    if not numeric and not isinstance(value, kinds_t):
        raise bad(name, f"expected {_names(kinds_t)}, got {_kind(value)}")
    if numeric:
        if abs(value) > 1e300:
            raise bad(name, f"{value} is out of range")
        return float(value)
    return value


def _kind(value: Any) -> str:
    kinds = {str: "a string", int: "an integer", float: "a number", list: "an array", dict: "an object"}
    return kinds.get(type(value), type(value).__name__)


def join_text_blocks(blocks: list[Any], where: str, message: str) -> str:
    """The text of a list of {type: text, text} blocks; `message` (400, naming `where[j]`) for any other."""
    parts = []
    for j, block in enumerate(blocks):
        if (
            not isinstance(block, dict)
            or block.get("type") != "text"
            or not isinstance(block.get("text"), str)
        ):
            raise bad(f"{where}[{j}]", message)
        parts.append(block["text"])
    return "".join(parts)


def in_range(name: str, value: float | None, low: float, high: float) -> float | None:
    if value is not None and not low <= value <= high:
        raise bad(name, f"{value} is outside [{low}, {high}]")
    return value


def _names(kinds: tuple[type, ...]) -> str:
    words = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", list: "an array"}
    return " or ".join(words.get(k, "an object" if k is dict else k.__name__) for k in kinds)


async def sse_guard(path: str, events: AsyncIterator[str]) -> AsyncIterator[str]:
    """A failure after the stream started cannot change the status any more: it ends the stream with
    an error event in the protocol's schema instead of a cut connection."""
    try:
        async for event in events:
            yield event
    except Exception as exc:
        status, message = (
            (exc.status, exc.message) if isinstance(exc, ApiError) else (500, f"internal error: {exc}")
        )
        doc = json.dumps(error_body(path, status, message))
        yield f"event: error\ndata: {doc}\n\n" if is_anthropic(path) else f"data: {doc}\n\n"
