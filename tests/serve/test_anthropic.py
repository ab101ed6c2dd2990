"""The Anthropic SDK against a live server: messages (plain, streamed), thinking, tool_use, count_tokens."""

from __future__ import annotations

from typing import Any

from conftest import Server

TOOLS = [
    {
        "name": "get_weather",
        "description": "Weather for a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]


def test_plain_and_streamed_agree(anthropic_client: Any) -> None:
    kw = dict(
        model="tiny",
        max_tokens=10,
        messages=[{"role": "user", "content": "Hello there"}],
        extra_body={"temperature": 0},  # greedy: the two calls must agree
    )
    r = anthropic_client.messages.create(**kw)
    assert r.role == "assistant" and r.type == "message" and r.stop_reason == "max_tokens"
    assert [b.type for b in r.content] == ["text"] and r.usage.output_tokens == 10
    with anthropic_client.messages.stream(**kw) as s:
        kinds = [event.type for event in s]
        final = s.get_final_message()
    assert final.content[0].text == r.content[0].text
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(kinds)
    assert final.usage.cache_read_input_tokens > 0  # the same prompt again: its KV was reused
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == r.usage.input_tokens


def test_thinking_and_tool_use_blocks(anthropic_client: Any, server: Server) -> None:
    kw = dict(
        model="tiny", max_tokens=80, tools=TOOLS, messages=[{"role": "user", "content": "[both] Oslo?"}]
    )
    r = anthropic_client.messages.create(**kw)
    assert [b.type for b in r.content] == ["thinking", "text", "tool_use"]
    assert r.content[0].thinking == "Need the weather."
    assert r.content[1].text == "Let me look."
    assert r.content[2].name == "get_weather" and r.content[2].input == {"city": "Oslo"}
    assert r.stop_reason == "tool_use"
    with anthropic_client.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[2].input == {"city": "Oslo"} and final.stop_reason == "tool_use"
    # tool_result goes back in a user turn
    follow = [
        *kw["messages"],
        {"role": "assistant", "content": [b.model_dump() for b in r.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": r.content[2].id, "content": "snow, -3 C"}],
        },
    ]
    # greedy: sampled freely, the random model's first token is its end of turn now and then
    r2 = anthropic_client.messages.create(
        model="tiny", max_tokens=4, tools=TOOLS, messages=follow, extra_body={"temperature": 0}
    )
    assert r2.content and r2.usage.output_tokens > 0
    prompt = server.scripted.prompts[-1]
    assert "<tool_response>\nsnow, -3 C\n</tool_response>" in prompt
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in prompt


def test_system_and_count_tokens(anthropic_client: Any, server: Server) -> None:
    messages = [{"role": "user", "content": "Count me"}]
    n = anthropic_client.messages.count_tokens(model="tiny", system="Be brief.", messages=messages)
    tokenizer = server.state.batcher.engine.tokenizer
    want = tokenizer.encode(
        tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."}, *messages])
    )
    assert n.input_tokens == len(want)
