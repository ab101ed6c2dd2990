"""What the handlers share: the batcher, names, limits; and reading a JSON body within them."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from freetoken.runtime.batcher import Batcher
from freetoken.serve.errors import ApiError


@dataclass
class ServeState:
    batcher: Batcher
    model_names: tuple[str, ...]
    api_key: str | None = None
    max_body_bytes: int = 32 << 20
    default_max_tokens: int = 4096
    started: float = field(default_factory=time.time)

    def engine_context(self) -> int:
        return self.batcher.engine.max_seq_len


async def read_json(request: Request) -> dict[str, Any]:
    """The request body as a JSON object; 413 past the limit, 400 when it is not a JSON object."""
    state: ServeState = request.app.state.serve
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > state.max_body_bytes:
        raise ApiError(413, f"request body of {declared} bytes is over the limit of {state.max_body_bytes}")
    raw = b""
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > state.max_body_bytes:
            raise ApiError(413, f"request body is over the limit of {state.max_body_bytes} bytes")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"body: not valid JSON ({exc})", param="body") from None
    if not isinstance(body, dict):
        raise ApiError(400, "body: expected a JSON object", param="body")
    return body
