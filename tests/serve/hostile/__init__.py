"""Hostile HTTP requests for `freetoken serve`, as hypothesis strategies: valid and malformed, each labelled.

`hostile_requests()` draws one `HostileRequest` (method, path, headers, body bytes, `kind` = its class)
from the table `CLASSES`. Bodies start as a valid request of one endpoint (always a small max_tokens, so
generation is quick; sometimes `stream: true`) and are then made wrong in one place, from per-field
tables. `encode` writes the JSON and mixes in what Python's json will not write by itself: a `Raw`
value goes into the text as it is (NaN, 1e999, a lone surrogate escape, invalid UTF-8, 100000 `[`).

`send` puts a request on the wire with http.client (bytes and headers go as they are, streams are read
to the end) and `verdict` says what is wrong with the answer: a 5xx, a 4xx body outside the protocol's
error schema, a stream that carries a server error or stops before its end.

The modules: core (the request, the answer, JSON text), bodies (valid bodies, mutation helpers),
wrong_values (wrong types, ranges, non-finite numbers), bad_json (strings, nesting, malformed JSON),
chat (chat structure and tools), tokens (token ids, logprobs, forced tokens), unknown (unknown
parameters), anthropic (Anthropic blocks), envelope (content types, methods, paths, valid requests),
wire (send and verdict).
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from .anthropic import ANTHROPIC_BLOCKS
from .bad_json import BAD_STRINGS, deep_nesting, malformed_json
from .bodies import MINIMAL, mutated, post
from .chat import CHAT_STRUCTURE, CHAT_TOOLS
from .core import Answer, HostileRequest
from .envelope import content_types, unknown_path, valid, wrong_method
from .tokens import LOGPROBS, TOKEN_IDS, forced_tokens
from .unknown import unknown_params
from .wire import send, verdict
from .wrong_values import NON_FINITE_FIELDS, OUT_OF_RANGE, WRONG_TYPE

__all__ = ["MINIMAL", "Answer", "HostileRequest", "hostile_requests", "post", "send", "verdict"]

CLASSES: dict[str, SearchStrategy[HostileRequest]] = {
    "valid": valid(),
    "wrong_type": mutated("wrong_type", WRONG_TYPE),
    "out_of_range": mutated("out_of_range", OUT_OF_RANGE),
    "non_finite": mutated("non_finite", NON_FINITE_FIELDS),
    "bad_string": mutated("bad_string", BAD_STRINGS),
    "deep_nesting": deep_nesting(),
    "malformed_json": malformed_json(),
    "chat_messages": mutated("chat_messages", CHAT_STRUCTURE),
    "chat_tools": mutated("chat_tools", CHAT_TOOLS),
    "token_ids": mutated("token_ids", TOKEN_IDS),
    "logprobs": mutated("logprobs", LOGPROBS),
    "forced_tokens": forced_tokens(),
    "unknown_params": unknown_params(),
    "anthropic_blocks": mutated("anthropic_blocks", ANTHROPIC_BLOCKS),
    "content_type": content_types(),
    "wrong_method": wrong_method(),
    "unknown_path": unknown_path(),
}


def hostile_requests() -> SearchStrategy[HostileRequest]:
    """One request of any class, the class drawn first (so each class gets about an even share)."""
    return st.one_of([CLASSES[name] for name in sorted(CLASSES)])
