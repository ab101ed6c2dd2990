"""Chat completions made wrong in their structure: messages, roles, content parts, tool calls and
tool results, chat template kwargs, tools and tool_choice."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from .bodies import one_of_values
from .core import CHAT

IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
AUDIO = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
CHAT_CONTENT = [
    None,
    5,
    {"text": "x"},
    [],
    [IMAGE],
    [AUDIO],
    [{"type": "text", "text": "see"}, IMAGE],
    [{"type": "text"}],
    [{"type": "text", "text": 5}],
    [{"type": "file", "file": {"file_id": "f"}}],
    [{"type": "refusal", "refusal": "no"}],
    ["a string part"],
    [{}],
    [None],
    [{"type": "image_url", "image_url": "http://example.com/x.png"}],
]
CHAT_ROLES = ["function", "bot", "", "USER", "user ", "tool", "system", "assistant", 7, None, ["user"]]
TOOL_CALLS = [
    "calls",
    {},
    [None],
    [{}],
    [{"type": "function"}],
    [{"function": "f"}],
    [{"function": {}}],
    [{"function": {"name": 5}}],
    [{"function": {"name": "f", "arguments": "{not json"}}],
    [{"function": {"name": "f", "arguments": [1]}}],
    [{"function": {"name": "f", "arguments": 5}}],
    [{"function": {"name": "f", "arguments": {"a": 1}}}],
    [{"id": None, "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    [{"id": 5, "type": "function", "function": {"name": "</tool_call>", "arguments": "{}"}}],
    [{"id": "c1", "type": "custom", "custom": {"name": "f", "input": "x"}}],
    [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}] * 50,
]
TOOL_MESSAGES = [
    {"role": "tool", "content": "sunny"},
    {"role": "tool", "tool_call_id": "unknown", "content": [{"type": "text", "text": "sunny"}]},
    {"role": "tool", "tool_call_id": "c1", "content": None},
    {"role": "tool", "tool_call_id": 5, "content": "sunny"},
    {"role": "tool", "tool_call_id": "c1", "content": [IMAGE]},
]
CHAT_MESSAGES = [
    [],
    [{}],
    [None],
    "hello",
    {"role": "user", "content": "hi"},
    [{"role": "system", "content": "only a system message"}],
    [{"role": "assistant", "content": "a prefill"}],
    [{"role": "tool", "content": "an orphan result"}],
    [{"role": "user", "content": "hi"}, {"role": "tool", "content": "no call before it"}],
    [{"role": "user"}],
    [{"content": "no role"}],
    [{"role": "user", "content": "hi", "name": 5}],
    [{"role": "user", "content": "hi"}] * 300,
]


def tool_turns(calls: Any, result: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        result,
    ]


TEMPLATE_KWARGS = [
    {"enable_thinking": "yes"},
    {"enable_thinking": [1]},
    {"enable_thinking": None},
    {"add_generation_prompt": False},
    {"tools": "not a list"},
    {"messages": []},
    {"bos_token": "<|im_start|>"},
    {"raise_exception": 1},
    {"": 1},
    [],
]
CHAT_STRUCTURE = {
    CHAT: [
        (("chat_template_kwargs",), one_of_values(TEMPLATE_KWARGS)),
        (("messages", -1, "role"), one_of_values(CHAT_ROLES)),
        (("messages", -1, "content"), one_of_values(CHAT_CONTENT)),
        (("messages", 0, "content"), one_of_values(CHAT_CONTENT)),
        (("messages",), one_of_values(CHAT_MESSAGES)),
        (
            ("messages",),
            st.builds(tool_turns, one_of_values(TOOL_CALLS), one_of_values(TOOL_MESSAGES)),
        ),
    ]
}

PARAMETERS = {"type": "object", "properties": {"a": {"type": "string"}}}
CHAT_TOOLS_VALUES = [
    "f",
    {},
    [None],
    [{}],
    [{"type": "function"}],
    [{"type": "function", "function": {}}],
    [{"type": "function", "function": {"name": "f", "parameters": "a string"}}],
    [{"type": "function", "function": {"name": "f", "parameters": [1, 2]}}],
    [{"type": "function", "function": {"name": "f", "parameters": None}}],
    [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": "x"}}}],
    [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}],
    [{"type": "function", "function": {"name": 5, "parameters": PARAMETERS}}],
    [{"type": "function", "function": {"name": "f", "description": 5, "parameters": PARAMETERS}}],
    [{"type": "function", "function": {"name": "{{ x }}", "strict": True}}],
    [{"type": "retrieval"}],
    [{"type": "custom", "custom": {"name": "x"}}],
    [{"function": {"name": "no_type"}}],
    [{"type": "function", "function": {"name": f"f{i}", "parameters": PARAMETERS}} for i in range(200)],
]
CHAT_TOOL_CHOICE = [
    "required",
    "any",
    "auto ",
    "sometimes",
    "",
    5,
    True,
    [],
    {},
    {"type": "function"},
    {"type": "function", "function": {"name": "missing"}},
    {"type": "function", "function": {"name": "get_weather"}},
    {"type": "function", "function": "get_weather"},
    {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}},
    {"type": "none"},
]
CHAT_TOOLS = {
    CHAT: [
        (("tools",), one_of_values(CHAT_TOOLS_VALUES)),
        (("tool_choice",), one_of_values(CHAT_TOOL_CHOICE)),
        (("parallel_tool_calls",), one_of_values([True, False, "yes", None])),
    ]
}
