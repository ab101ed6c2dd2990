"""Putting a `HostileRequest` on the wire, and the verdict on its answer.

`send` uses http.client (bytes and headers go as they are, streams are read to the end) and `verdict`
says what is wrong with the answer: a 5xx, a 4xx body outside the protocol's error schema, a stream that
carries a server error or stops before its end, a 200 body without the protocol's shape.
"""

from __future__ import annotations

import http.client
import json
from typing import Any
from urllib.parse import unquote

from .core import CHAT, COMPLETIONS, COUNT, MESSAGES, Answer, HostileRequest


def send(request: HostileRequest, host: str, port: int, api_key: str | None, timeout: float = 60.0) -> Answer:
    """Send `request` as it is (plus the API key) and read the whole answer, streams included."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        headers = dict(request.headers)
        if api_key is not None:
            headers["authorization"] = f"Bearer {api_key}"
        body = request.body if request.body or request.method != "GET" else None
        conn.request(request.method, request.path, body=body, headers=headers)
        response = conn.getresponse()
        raw = response.read()
        return Answer(response.status, {k.lower(): v for k, v in response.getheaders()}, raw)
    finally:
        conn.close()


def is_anthropic(path: str) -> bool:
    """The protocol the server answers in: by the decoded path, without the query."""
    return unquote(path.partition("?")[0]).startswith(MESSAGES)


SERVER_ERROR_TYPES = ("server_error", "api_error", "overloaded_error")


def error_schema_problem(path: str, body: bytes) -> str | None:
    """None when `body` is an error in the protocol's schema, else what is wrong with it."""
    try:
        doc = json.loads(body)
    except ValueError:
        return f"error body is not JSON: {body[:200]!r}"
    if is_anthropic(path):
        error = doc.get("error") if isinstance(doc, dict) and doc.get("type") == "error" else None
        want = '{"type": "error", "error": {"type", "message"}}'
    else:
        error = doc.get("error") if isinstance(doc, dict) else None
        want = '{"error": {"message", "type", ...}}'
    if not isinstance(error, dict) or not all(isinstance(error.get(k), str) for k in ("type", "message")):
        return f"error body is not {want}: {body[:200]!r}"
    return None


def stream_problem(path: str, body: bytes) -> str | None:
    """None when an SSE stream carries no server error and reaches its end (or a client error event)."""
    anthropic = is_anthropic(path)
    ended = False
    for line in body.splitlines():  # bytes: only CR and LF end an SSE line, not U+2028 and the like
        if not line.startswith(b"data:"):
            continue
        data = line[5:].decode("utf-8", "replace").strip()
        if data == "[DONE]":
            ended = True
            continue
        try:
            doc = json.loads(data)
        except ValueError:
            return f"stream event is not JSON: {data[:200]!r}"
        error = doc.get("error") if isinstance(doc, dict) else None
        if isinstance(error, dict):
            if error.get("type") in SERVER_ERROR_TYPES:
                return f"stream carries a server error: {data[:300]}"
            ended = True
        elif anthropic and isinstance(doc, dict) and doc.get("type") == "message_stop":
            ended = True
    if not ended:
        tail = body[-200:]
        return f"stream ended before {'message_stop' if anthropic else '[DONE]'}: ...{tail!r}"
    return None


def verdict(request: HostileRequest, answer: Answer) -> str | None:
    """What is wrong with `answer` as the answer to `request`, or None when nothing is."""
    if answer.status >= 500:
        return f"{answer.status} on {request.method} {request.path[:80]}: {answer.body[:300]!r}"
    if request.must_accept and not 200 <= answer.status < 300:
        return f"{answer.status} for a plain valid request: {answer.body[:300]!r}"
    if request.method == "HEAD":
        return None
    if 400 <= answer.status < 500:
        return error_schema_problem(request.path, answer.body)
    kind = answer.headers.get("content-type", "")
    if answer.status == 200 and kind.startswith("text/event-stream"):
        return stream_problem(request.path, answer.body)
    if answer.status == 200 and kind.startswith("application/json"):
        return result_problem(request.path, answer.body)
    return None


def result_problem(path: str, body: bytes) -> str | None:
    """None when a 200 JSON body of a generating endpoint has the protocol's shape (the parts a fuzzed
    request could break: the object type, the message, tool calls), else what is wrong."""
    try:
        doc = json.loads(body)
    except ValueError:
        return f"200 body is not JSON: {body[:200]!r}"
    try:
        ok = _result_ok(unquote(path.partition("?")[0]), doc)
    except (KeyError, IndexError, TypeError):
        ok = False
    return None if ok else f"200 body is not the protocol's result: {body[:300]!r}"


def _result_ok(route: str, doc: Any) -> bool:
    if route == CHAT:
        message = doc["choices"][0]["message"]
        calls = message.get("tool_calls") or []
        return (
            doc["object"] == "chat.completion"
            and message["role"] == "assistant"
            and isinstance(message["content"], str | None)
            and all(isinstance(c["function"]["arguments"], str) for c in calls)
        )
    if route == COMPLETIONS:
        return doc["object"] == "text_completion" and isinstance(doc["choices"][0]["text"], str)
    if route == MESSAGES:
        blocks = doc["content"]
        return doc["type"] == "message" and all(
            block["type"] in ("text", "thinking")
            or (block["type"] == "tool_use" and isinstance(block["input"], dict))
            for block in blocks
        )
    if route == COUNT:
        return isinstance(doc["input_tokens"], int)
    return True
