"""Parameters the server does not know (or does not implement), of OpenAI and Anthropic, and random keys."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from .bodies import BODIES, one_of_values, post
from .core import MESSAGES, HostileRequest
from .wrong_values import ANY_JSON

UNKNOWN_OPENAI: dict[str, list[Any]] = {
    "response_format": [
        {"type": "json_object"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
        {"type": "text"},
        "json",
    ],
    "functions": [[{"name": "f", "parameters": {}}], "f"],
    "function_call": ["auto", {"name": "f"}],
    "frequency_penalty": [0.5, -2.0, 3, 1e308],
    "presence_penalty": [0.5, -2.0, 3],
    "logit_bias": [{"5": -100}, {"1": 100}, {"x": "y"}, []],
    "min_p": [0.1, -1, 2],
    "repetition_penalty": [1.1, 0, -1],
    "echo": [True, False],
    "suffix": ["x", 5],
    "best_of": [1, 2, 100],
    "user": ["u", 5],
    "metadata": [{"k": "v"}, "m"],
    "store": [True],
    "service_tier": ["auto", "flex"],
    "reasoning_effort": ["low", "max"],
    "modalities": [["text", "audio"]],
    "audio": [{"voice": "x", "format": "wav"}],
    "prediction": [{"type": "content", "content": "x"}],
    "web_search_options": [{}],
    "typical_p": [0.5],
    "mirostat": [2],
}
UNKNOWN_ANTHROPIC: dict[str, list[Any]] = {
    "metadata": [{"user_id": "u"}, {"user_id": 5}, {"x": 1}, "m"],
    "service_tier": ["auto", "standard_only", 5],
    "container": ["c"],
    "mcp_servers": [[{"type": "url", "url": "http://x", "name": "m"}]],
    "top_logprobs": [5],
    "frequency_penalty": [0.5],
    "response_format": [{"type": "json_object"}],
    "n": [2],
    "seed": [1],
}
RANDOM_KEY = st.text(min_size=1, max_size=20)


def unknown(table: dict[str, list[Any]]) -> list[tuple[Any, SearchStrategy[Any]]]:
    return [*(((key,), one_of_values(values)) for key, values in table.items()), (("",), ANY_JSON)]


@st.composite
def unknown_params(draw: st.DrawFn) -> HostileRequest:
    path = draw(st.sampled_from(sorted(BODIES)))
    body = draw(BODIES[path])
    table = UNKNOWN_ANTHROPIC if path.startswith(MESSAGES) else UNKNOWN_OPENAI
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(sorted(table)) | RANDOM_KEY)
        body[key] = draw(one_of_values(table[key]) if key in table else ANY_JSON)
    return post("unknown_params", path, body)
