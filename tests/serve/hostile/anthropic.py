"""Anthropic messages made wrong in their blocks: system, thinking, tool_choice, content blocks,
message sequences, tools."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from .bodies import one_of_values
from .core import COUNT, DELETE, MESSAGES

IMAGE_BLOCK = {
    "type": "image",
    "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
}
SYSTEM = [
    5,
    True,
    {"text": "x"},
    [{"type": "image"}],
    [{"type": "text"}],
    [{"type": "text", "text": 5}],
    [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}],
    ["a string"],
    [],
    [None],
    "",
]
THINKING = [
    {"type": "enabled"},
    {"type": "enabled", "budget_tokens": -1},
    {"type": "enabled", "budget_tokens": 0},
    {"type": "enabled", "budget_tokens": 2**70},
    {"type": "enabled", "budget_tokens": "many"},
    "enabled",
    True,
    1,
    [],
    {"type": "weird"},
    {"type": "adaptive"},
    {},
]
ANTHROPIC_TOOL_CHOICE = [
    "auto",
    "any",
    5,
    [],
    {},
    {"type": "tool"},
    {"type": "tool", "name": 5},
    {"type": "tool", "name": "missing"},
    {"type": "tool", "name": "get_weather"},
    {"type": "auto", "disable_parallel_tool_use": "yes"},
    {"type": "x"},
    {"type": None},
]
STOP_SEQUENCES = ["END", [1], [None], [""], ["a"] * 1000, [[]], {}]
USER_BLOCKS = [
    [IMAGE_BLOCK],
    [{"type": "document", "source": {"type": "text", "data": "d"}}],
    [{"type": "search_result"}],
    [{"type": "server_tool_use"}],
    [{"type": None}],
    [{}],
    ["a string block"],
    [5],
    [{"type": "text"}],
    [{"type": "text", "text": None}],
    [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
    [{"type": "thinking", "thinking": "x"}],
    [{"type": "tool_result", "tool_use_id": "t", "content": 5}],
    [{"type": "tool_result", "tool_use_id": "t", "content": [IMAGE_BLOCK]}],
    [{"type": "tool_result", "tool_use_id": "t", "content": {"a": 1}}],
    [{"type": "tool_result", "tool_use_id": "t", "content": None}],
    [
        {
            "type": "tool_result",
            "tool_use_id": "t",
            "content": [{"type": "text", "text": "ok"}],
            "is_error": "x",
        }
    ],
    [{"type": "tool_result"}],
    [{"type": "tool_result", "tool_use_id": 5, "content": "x"}],
    [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "tool_result", "content": "x"}]}],
    [],
    None,
    5,
    {"type": "text", "text": "x"},
]
ANTHROPIC_MESSAGES = [
    [],
    [{"role": "system", "content": "x"}],
    [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "not a dict"}]}],
    [{"role": "assistant", "content": [{"type": "tool_use"}]}],
    [{"role": "assistant", "content": [{"type": "tool_result", "content": "x"}]}],
    [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
    [{"role": "assistant", "content": [{"type": "thinking"}]}],
    [{"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": 5}]}],
    [{"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]}],
    [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope", "content": "x"}]}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": []}],
]
ANTHROPIC_TOOLS = [
    [{}],
    [{"name": 5}],
    [{"name": "f", "input_schema": "s"}],
    [{"name": "f", "input_schema": [1]}],
    [{"name": "f", "input_schema": None}],
    [{"type": "bash_20250124", "name": "bash"}],
    [{"type": "web_search_20250305", "name": "web_search"}],
    "tools",
    {},
    [None],
]
ANTHROPIC_SHAPES: list[tuple[Any, SearchStrategy[Any]]] = [
    (("system",), one_of_values(SYSTEM)),
    (("thinking",), one_of_values(THINKING)),
    (("tool_choice",), one_of_values(ANTHROPIC_TOOL_CHOICE)),
    (("messages", -1, "content"), one_of_values(USER_BLOCKS)),
    (("messages",), one_of_values(ANTHROPIC_MESSAGES)),
    (("tools",), one_of_values(ANTHROPIC_TOOLS)),
    (("model",), st.just(DELETE)),
]
ANTHROPIC_BLOCKS = {
    MESSAGES: [
        *ANTHROPIC_SHAPES,
        (("stop_sequences",), one_of_values(STOP_SEQUENCES)),
        (("max_tokens",), st.just(DELETE)),
    ],
    COUNT: ANTHROPIC_SHAPES,
}
