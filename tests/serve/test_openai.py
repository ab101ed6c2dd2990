"""The OpenAI SDK against a live server: chat (plain, streamed), tools, reasoning, completions."""

from __future__ import annotations

import json
from typing import Any

from conftest import Server

USER = [{"role": "user", "content": "Tell me about the weather in the mountains."}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def test_models(openai_client: Any) -> None:
    assert [m.id for m in openai_client.models.list().data] == ["tiny"]


def test_chat_plain_and_streamed_agree(openai_client: Any) -> None:
    full = openai_client.chat.completions.create(model="tiny", messages=USER, max_tokens=12, temperature=0)
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert full.usage.completion_tokens == 12 and choice.finish_reason == "length"
    assert full.usage.prompt_tokens > 0
    chunks = list(
        openai_client.chat.completions.create(
            model="tiny",
            messages=USER,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12
    # the second identical prompt reused the first one's KV
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_stop_string(openai_client: Any) -> None:
    full = openai_client.chat.completions.create(model="tiny", messages=USER, max_tokens=12, temperature=0)
    text = full.choices[0].message.content
    stop = text[len(text) // 2 :][:3]
    cut = openai_client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=12, temperature=0, stop=[stop]
    )
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(openai_client: Any) -> None:
    def once() -> str:
        r = openai_client.chat.completions.create(
            model="tiny", messages=USER, max_tokens=10, temperature=1.0, top_p=0.9, seed=7
        )
        return r.choices[0].message.content

    assert once() == once()


def test_tool_call_round_trip(openai_client: Any, server: Server) -> None:
    messages = [{"role": "user", "content": "[tool] What is the weather in Paris?"}]
    r = openai_client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=64)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id.startswith("call_") and not choice.message.content
    # streamed: the same call arrives as a tool_calls delta
    chunks = list(
        openai_client.chat.completions.create(
            model="tiny", messages=messages, tools=TOOLS, max_tokens=64, stream=True
        )
    )
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == [
        (0, "get_weather", {"city": "Paris"})
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the result goes back; the template renders both the call and the response
    follow = [
        *messages,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    r2 = openai_client.chat.completions.create(
        model="tiny", messages=follow, tools=TOOLS, max_tokens=4, temperature=0
    )
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens
    prompt = server.scripted.prompts[-1]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt


def test_malformed_tool_call_degrades_to_text(openai_client: Any) -> None:
    messages = [{"role": "user", "content": "[bad-tool] go"}]
    r = openai_client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=64)
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == "<tool_call>\n{not json}\n</tool_call>"
    assert r.choices[0].finish_reason == "stop"


def test_reasoning_split(openai_client: Any) -> None:
    messages = [{"role": "user", "content": "[think] What is 2 + 2?"}]
    r = openai_client.chat.completions.create(model="tiny", messages=messages, max_tokens=64)
    message = r.choices[0].message
    assert message.reasoning_content == "First add, then check."
    assert message.content == "It is 4."
    chunks = list(
        openai_client.chat.completions.create(model="tiny", messages=messages, max_tokens=64, stream=True)
    )
    reasoning = "".join(
        getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (reasoning, content) == ("First add, then check.", "It is 4.")


def test_completions(openai_client: Any) -> None:
    r = openai_client.completions.create(model="tiny", prompt="The weather", max_tokens=6, temperature=0)
    assert r.choices[0].text and r.usage.completion_tokens == 6
    streamed = "".join(
        c.choices[0].text
        for c in openai_client.completions.create(
            model="tiny", prompt="The weather", max_tokens=6, temperature=0, stream=True
        )
    )
    assert streamed == r.choices[0].text
