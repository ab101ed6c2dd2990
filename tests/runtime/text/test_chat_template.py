"""Chat prompts must match transformers' apply_chat_template byte for byte."""

from __future__ import annotations

import json

import pytest

from freetoken.errors import FreeTokenError
from freetoken.runtime.text.chat_template import compile_chat_template, render_chat_template

transformers = pytest.importorskip("transformers")

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": 'Current weather for a city <with> & "quotes"',
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}

CONVERSATIONS: dict[str, list[dict]] = {
    "system_user": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
    ],
    "user_only": [{"role": "user", "content": "Hi"}],
    "multi_turn_reasoning": [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Simple sum: 2 plus 2."},
        {"role": "user", "content": "And times 3?"},
        {"role": "assistant", "content": "12", "reasoning_content": "\n4 * 3 = 12\n"},
    ],
    "reasoning_alias_thinking": [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A", "thinking": "pondering"},
    ],
    "think_inside_content": [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "<think>\nold thoughts\n</think>\n\nA1"},
        {"role": "user", "content": "Q2"},
    ],
    "tools_round_trip": [
        {"role": "system", "content": "Use tools when helpful."},
        {"role": "user", "content": "Weather in Paris and the time?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "I need two tools.",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"type": "function", "function": {"name": "get_time", "arguments": '{"tz": "CET"}'}},
            ],
        },
        {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "a"},
        {"role": "tool", "content": "14:05", "tool_call_id": "b"},
        {"role": "assistant", "content": "It is 21 °C and 14:05 in Paris."},
    ],
    "unicode": [
        {"role": "system", "content": "Réponds en français, 日本語もOK 🙂"},
        {"role": "user", "content": "Ça va? 你好吗？ Ünïcödé ✓ 👩‍💻"},
        {"role": "assistant", "content": "Très bien — 很好 🎉"},
    ],
    "content_parts": [
        {"role": "user", "content": [{"type": "text", "text": "part one "}, {"type": "text", "text": "two"}]},
    ],
}


def _tools_for(name: str) -> list[dict] | None:
    return [WEATHER_TOOL, TIME_TOOL] if name.startswith("tools") else None


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_demo_template_matches_transformers(name: str, add_generation_prompt: bool, ours, theirs) -> None:
    messages, tools = CONVERSATIONS[name], _tools_for(name)
    expected = theirs.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    got = ours.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt)
    assert got == expected
    assert got.endswith("<|im_start|>assistant\n") == add_generation_prompt


@pytest.mark.parametrize("name", ["system_user", "multi_turn_reasoning", "tools_round_trip"])
def test_enable_thinking_false_matches_transformers(name: str, ours, theirs) -> None:
    messages, tools = CONVERSATIONS[name], _tools_for(name)
    expected = theirs.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    got = ours.apply_chat_template(messages, tools=tools, add_generation_prompt=True, enable_thinking=False)
    assert got == expected
    assert got.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_demo_template_structure(ours) -> None:
    reasoning = ours.apply_chat_template(CONVERSATIONS["multi_turn_reasoning"], add_generation_prompt=False)
    # Only the turn after the last user query keeps its reasoning.
    assert "Simple sum" not in reasoning
    assert "<|im_start|>assistant\n<think>\n4 * 3 = 12\n</think>\n\n12<|im_end|>\n" in reasoning

    tools = ours.apply_chat_template(CONVERSATIONS["tools_round_trip"], tools=[WEATHER_TOOL, TIME_TOOL])
    assert tools.startswith("<|im_start|>system\nUse tools when helpful.\n\n# Tools")
    assert json.dumps(WEATHER_TOOL, ensure_ascii=False) in tools  # not HTML-escaped
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in tools
    assert '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>' in tools
    assert tools.count("<|im_start|>user") == 2  # two tool results share one user turn
    assert "<tool_response>\n14:05\n</tool_response><|im_end|>" in tools
    assert "None" not in tools

    old = ours.apply_chat_template(CONVERSATIONS["think_inside_content"])
    assert "old thoughts" not in old and "<|im_start|>assistant\nA1<|im_end|>" in old


def test_unknown_role_is_a_freetoken_error(ours) -> None:
    with pytest.raises(FreeTokenError, match="unsupported chat role: narrator"):
        ours.apply_chat_template([{"role": "narrator", "content": "x"}])


def test_raise_exception_becomes_freetoken_error() -> None:
    template = (
        "{% if messages[0].role != 'user' %}"
        "{{ raise_exception('first message must be from the user') }}"
        "{% endif %}ok"
    )
    assert render_chat_template(template, [{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(FreeTokenError, match="first message must be from the user"):
        render_chat_template(template, [{"role": "system", "content": "x"}])


def test_template_errors_are_freetoken_errors() -> None:
    with pytest.raises(FreeTokenError, match="syntax error at line 2"):
        render_chat_template("ok\n{% if %}", [{"role": "user", "content": "x"}])
    with pytest.raises(FreeTokenError, match="underscore"):
        render_chat_template("{% set ns = namespace(_x=1) %}", [{"role": "user", "content": "x"}])
    with pytest.raises(FreeTokenError, match="TypeError"):
        render_chat_template("{{ 1 + messages[0].content }}", [{"role": "user", "content": "x"}])
    with pytest.raises(FreeTokenError, match="empty"):
        render_chat_template("x", [])


def test_tojson_keeps_html_and_unicode() -> None:
    out = render_chat_template("{{ messages[0].content | tojson }}", [{"role": "user", "content": "<a> & é"}])
    assert out == '"<a> & é"'


def test_templates_compile_once() -> None:
    template = "{{ messages | length }}"
    assert compile_chat_template(template) is compile_chat_template(template)
    assert compile_chat_template(template) is not compile_chat_template(template + " ")


# Exercises constructs real templates use: namespace mutation, loop.previtem/nextitem, tojson options,
# `{% generation %}`, loop controls, dict(), None-valued keys and reasoning aliases.
REALISTIC_TEMPLATE = """
{%- set ns = namespace(turns=0, last_role=none) -%}
{{- bos_token if bos_token is defined else '' -}}
{%- if tools %}[TOOLS]{{ tools | tojson(indent=2) }}[/TOOLS]
{% endif -%}
{%- for message in messages -%}
    {%- if message.role == 'skip' %}{% continue %}{% endif -%}
    {%- set ns.turns = ns.turns + 1 -%}
    {%- if not loop.first and loop.previtem.role == message.role %}(same speaker){% endif -%}
    [{{ message.role | upper }}]
    {%- if message.role == 'assistant' -%}
        {%- generation -%}
        {%- if message.reasoning_content is defined %}<r>{{ message.reasoning_content }}</r>{% endif -%}
        {%- if message.thinking is defined %}<t>{{ message.thinking }}</t>{% endif -%}
        {{ message.content if message.content is defined else '' }}
        {%- if message.tool_calls is defined -%}
            {%- for c in message.tool_calls -%}
                {{ c | tojson(sort_keys=true, separators=(',', ':')) }}
            {%- endfor -%}
        {%- endif -%}
        {{ eos_token }}
        {%- endgeneration -%}
    {%- else -%}
        {{ message.content }}
    {%- endif %}
{% if not loop.last %}{{ '->' + loop.nextitem.role }}{% endif %}
{% endfor -%}
{%- set meta = dict(turns=ns.turns, keys=(messages[-1] | list)) -%}
{{ meta | tojson }}
{%- if add_generation_prompt %}[ASSISTANT]{% endif -%}
"""


def test_realistic_template_matches_transformers_renderer() -> None:
    from transformers.utils.chat_template_utils import _normalize_chat_messages, render_jinja_template

    messages = [
        {"role": "user", "content": "héllo <b>"},
        {"role": "user", "content": "again"},
        {"role": "skip", "content": "ignored"},
        {
            "role": "assistant",
            "content": None,
            "reasoning": "legacy reasoning name",
            "tool_calls": [{"name": "f", "arguments": {"b": 1, "a": [1, 2]}}],
        },
    ]
    kwargs = {"bos_token": "<s>", "eos_token": "</s>"}
    for add_generation_prompt in (False, True):
        rendered, _ = render_jinja_template(
            # apply_chat_template drops None-valued keys before rendering; the renderer alone does not
            conversations=[_normalize_chat_messages(messages)],
            tools=[WEATHER_TOOL],
            chat_template=REALISTIC_TEMPLATE,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
        got = render_chat_template(
            REALISTIC_TEMPLATE,
            messages,
            tools=[WEATHER_TOOL],
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
        assert got == rendered[0]
    assert '"a":[1,2]' in got and "(same speaker)" in got and "None" not in got
    assert "<r>legacy reasoning name</r><t>legacy reasoning name</t>" in got
    assert messages[3]["content"] is None  # the caller's messages are not modified
