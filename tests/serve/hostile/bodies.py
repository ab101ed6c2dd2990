"""Valid bodies of each endpoint, and the helpers that make them wrong in one place.

Every body has a small max_tokens (generation is quick) and is sometimes a stream. `mutated` takes a
valid body and sets one (sometimes two) fields from a per-endpoint table of hostile values.
"""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from .core import CHAT, COMPLETIONS, COUNT, JSON, MESSAGES, VOCAB, HostileRequest, encode, put

TEXT = st.text(max_size=40)
WORDS = st.sampled_from(["Hello", "What is 2+2?", "Tell me a story.", "ok", "Paris", "¿Qué tal? 你好 🙂"])
SMALL_MAX = st.integers(1, 4)
TEXT_PARTS = st.lists(st.builds(lambda t: {"type": "text", "text": t}, TEXT), min_size=1, max_size=3)
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT_TOOL = st.builds(
    lambda name, desc: {
        "type": "function",
        "function": {"name": name, "description": desc, "parameters": WEATHER_SCHEMA},
    },
    st.sampled_from(["get_weather", "lookup", "f"]),
    TEXT,
)
ANTHROPIC_TOOL = st.builds(
    lambda name, desc: {"name": name, "description": desc, "input_schema": WEATHER_SCHEMA},
    st.sampled_from(["get_weather", "lookup", "f"]),
    TEXT,
)
STOP = TEXT.filter(bool) | st.lists(TEXT.filter(bool), max_size=4)
SAMPLING = {
    "temperature": st.floats(0.0, 2.0),
    "top_p": st.floats(0.01, 1.0),
    "top_k": st.integers(0, 50),
    "seed": st.integers(0, 2**63 - 1),
    "stop": STOP,
    "n": st.just(1),
}


@st.composite
def chat_body(draw: st.DrawFn) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        messages.append({"role": draw(st.sampled_from(["system", "developer"])), "content": draw(TEXT)})
    for _ in range(draw(st.integers(0, 2))):
        messages += [{"role": "user", "content": draw(WORDS)}, {"role": "assistant", "content": draw(TEXT)}]
    messages.append({"role": "user", "content": draw(WORDS | TEXT_PARTS)})
    optional = {
        **SAMPLING,
        "model": st.just("tiny"),
        "tools": st.lists(CHAT_TOOL, min_size=1, max_size=2),
        "tool_choice": st.sampled_from(["auto", "none"]),
        "chat_template_kwargs": st.fixed_dictionaries({}, optional={"enable_thinking": st.booleans()}),
        "ignore_eos": st.booleans(),
    }
    body = draw(st.fixed_dictionaries({"messages": st.just(messages)}, optional=optional))
    body[draw(st.sampled_from(["max_tokens", "max_completion_tokens"]))] = draw(SMALL_MAX)
    if draw(st.integers(0, 2)) == 0:
        body["stream"] = True
        if draw(st.booleans()):
            body["stream_options"] = {"include_usage": draw(st.booleans())}
    return body


@st.composite
def completion_body(draw: st.DrawFn) -> dict[str, Any]:
    prompt = draw(
        WORDS | TEXT.filter(str.strip) | st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20)
    )
    optional = {**SAMPLING, "model": st.just("tiny"), "ignore_eos": st.booleans()}
    body = draw(
        st.fixed_dictionaries({"prompt": st.just(prompt), "max_tokens": SMALL_MAX}, optional=optional)
    )
    if draw(st.integers(0, 2)) == 0:
        body["stream"] = True
    return body


ANTHROPIC_TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "Use the tool.", "signature": ""},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
        ],
    },
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
]


@st.composite
def anthropic_body(draw: st.DrawFn, count_tokens: bool = False) -> dict[str, Any]:
    if draw(st.integers(0, 3)) == 0:
        messages = copy.deepcopy(ANTHROPIC_TOOL_TURNS)
    else:
        messages = []
        for _ in range(draw(st.integers(0, 2))):
            messages += [
                {"role": "user", "content": draw(WORDS)},
                {"role": "assistant", "content": draw(TEXT)},
            ]
        messages.append({"role": "user", "content": draw(WORDS | TEXT_PARTS)})
    optional: dict[str, SearchStrategy[Any]] = {
        "system": TEXT | TEXT_PARTS,
        "tools": st.lists(ANTHROPIC_TOOL, min_size=1, max_size=2),
        "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "none"}]),
        "thinking": st.sampled_from([{"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"}]),
    }
    if count_tokens:
        required = {"model": st.just("tiny"), "messages": st.just(messages)}
        return draw(st.fixed_dictionaries(required, optional=optional))
    optional |= {
        "temperature": st.floats(0.0, 1.0),
        "top_p": st.floats(0.01, 1.0),
        "top_k": st.integers(0, 50),
        "stop_sequences": st.lists(TEXT.filter(bool), max_size=4),
    }
    required = {"model": st.just("tiny"), "max_tokens": SMALL_MAX, "messages": st.just(messages)}
    body = draw(st.fixed_dictionaries(required, optional=optional))
    if draw(st.integers(0, 2)) == 0:
        body["stream"] = True
    return body


BODIES: dict[str, SearchStrategy[dict[str, Any]]] = {
    CHAT: chat_body(),
    COMPLETIONS: completion_body(),
    MESSAGES: anthropic_body(),
    COUNT: anthropic_body(count_tokens=True),
}
MINIMAL: dict[str, dict[str, Any]] = {  # what every client sends; content-type variants ride on these
    CHAT: {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2},
    COMPLETIONS: {"model": "tiny", "prompt": "Hello", "max_tokens": 2},
    MESSAGES: {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Hello"}]},
    COUNT: {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}]},
}


def post(
    kind: str, path: str, body: Any, ascii_json: bool = True, content_type: str | None = JSON, **kw: Any
) -> HostileRequest:
    raw = body if isinstance(body, bytes) else encode(body, ascii_json)
    headers = {} if content_type is None else {"content-type": content_type}
    return HostileRequest(kind, "POST", path, headers, raw, **kw)


@st.composite
def mutated(
    draw: st.DrawFn, kind: str, table: dict[str, list[tuple[tuple[str | int, ...], SearchStrategy[Any]]]]
) -> HostileRequest:
    """A valid body of one endpoint of `table` with one (sometimes two) of its fields set to a hostile
    value drawn from the table."""
    path = draw(st.sampled_from(sorted(table)))
    body = draw(BODIES[path])
    for _ in range(draw(st.sampled_from([1, 1, 1, 2]))):
        where, values = draw(st.sampled_from(table[path]))
        body = put(body, where, draw(values))
    return post(kind, path, body, ascii_json=draw(st.booleans()))


def one_of_values(values: list[Any]) -> SearchStrategy[Any]:
    """One of `values` (a copy: bodies are changed in place later), by index, so that the strategy's
    repr stays short even when some values are large."""
    return st.sampled_from(range(len(values))).map(lambda i: copy.deepcopy(values[i]))


def at_fields(paths: list[tuple[str | int, ...]], values: SearchStrategy[Any]) -> list[tuple[Any, Any]]:
    return [(p, values) for p in paths]
