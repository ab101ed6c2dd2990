"""Incremental parsing of model output into reasoning, content and tool calls (Qwen's tags, and the
tool-call formats of GLM-4.5, MiniMax-M2, DeepSeek-V3.x and Kimi)."""

from __future__ import annotations

import dataclasses
import json
import random
import re
from itertools import pairwise

import pytest

from freetoken.serve.output_parser import (
    Event,
    OutputParser,
    ReasoningDelta,
    TextDelta,
    ToolCallDelta,
    parse_output,
)

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>'

# (text, parser options) covering every tag, whitespace rule and degraded call
SAMPLES: list[tuple[str, dict[str, bool]]] = [
    ("<think>\nLet me think.\n</think>\n\nThe answer is 4.", {}),
    ("I should greet.\n</think>\n\nHello  there!\n", {"starts_in_reasoning": True}),
    (f"<think>\nNeed weather.\n</think>\n\nLet me check.\n\n{WEATHER}\n{TIME}", {}),
    ('Hi <tool_call>\n{"name": "f", "arguments": "{\\"a\\": [1, 2]}"}\n</tool_call> bye', {}),
    ("Before\n<tool_call>\n{not json\n</tool_call>\nafter </tool_call> <think", {}),
    ('<think>\n思考中…\n</think>\n\nこんにちは 🌍\n<tool_call>{"name": "f", "argu', {}),
    ("a < b <t <th <thinking> <tool <tool_cal x", {}),
    ("<think>x</think>y<think>z</think>", {}),
    (f"<think>\nr\n</think>\n\n{WEATHER}", {"reasoning": False, "tools": False}),
]


def summary(p: OutputParser) -> tuple[str, str, list[tuple[int, str, str]]]:
    return p.content, p.reasoning, [(c.index, c.name, c.arguments) for c in p.tool_calls]


def events_summary(events: list[Event]) -> tuple[str, str, list[tuple[int, str, str]]]:
    content = "".join(e.text for e in events if isinstance(e, TextDelta))
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    calls = [(e.index, e.name, e.arguments) for e in events if isinstance(e, ToolCallDelta)]
    return content, reasoning, calls


def stream(pieces: list[str], **kwargs: bool) -> tuple[OutputParser, list[Event]]:
    p = OutputParser(**kwargs)
    events: list[Event] = []
    for piece in pieces:
        batch = p.push(piece)
        assert_well_formed(batch)
        events += batch
    batch = p.flush()
    assert_well_formed(batch)
    return p, events + batch


def assert_well_formed(batch: list[Event]) -> None:
    for e in batch:
        if not isinstance(e, ToolCallDelta):
            assert e.text, "empty delta"
    for a, b in pairwise(batch):
        assert not (type(a) is type(b) and not isinstance(a, ToolCallDelta)), "unmerged deltas"


@pytest.mark.parametrize(("text", "kwargs"), SAMPLES)
def test_every_split_matches_one_shot(text: str, kwargs: dict[str, bool]) -> None:
    whole, events = stream([text], **kwargs)
    expected = summary(whole)
    assert events_summary(events) == expected
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    rng = random.Random(0)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), 4))
        splits.append([text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    for pieces in splits:
        p, events = stream(pieces, **kwargs)
        assert summary(p) == expected, pieces
        assert events_summary(events) == expected, pieces


def test_reasoning_then_content() -> None:
    p = parse_output("<think>\nStep 1.\n\nStep 2.\n</think>\n\nThe answer\n\nis 4.")
    assert p.reasoning == "Step 1.\n\nStep 2."
    assert p.content == "The answer\n\nis 4."
    assert p.tool_calls == []


def test_reasoning_started_in_prompt() -> None:
    text = "I should greet.\n</think>\n\nHello!"
    p = parse_output(text, starts_in_reasoning=True)
    assert (p.reasoning, p.content) == ("I should greet.", "Hello!")
    assert parse_output(text).content == text  # without it, a bare </think> is text
    assert parse_output("still thinking\n", starts_in_reasoning=True).reasoning == "still thinking\n"


def test_streaming_emits_at_once_and_holds_only_partial_tags() -> None:
    p = OutputParser()
    assert p.push("<think>\nHmm") == [ReasoningDelta("Hmm")]
    assert p.push(", ok\n</thi") == [ReasoningDelta(", ok")]
    assert p.push("nk>\n\nHi <too") == [TextDelta("Hi")]
    assert p.push("l_call>") == []
    assert p.push('{"name": "f"}') == []
    call, text = p.push("</tool_call>\nx <")
    assert isinstance(call, ToolCallDelta) and (call.name, call.arguments) == ("f", "{}")
    assert text == TextDelta("x")  # " " may still touch a tag, "<" may still start one
    assert p.push("b") == [TextDelta(" <b")]  # "<b" cannot become a tag: released
    assert p.flush() == []


def test_two_tool_calls_after_text() -> None:
    p = parse_output(f"Let me check.\n\n{WEATHER}\n{TIME}")
    assert p.content == "Let me check."
    assert p.reasoning == ""
    first, second = p.tool_calls
    assert (first.index, first.name, json.loads(first.arguments)) == (0, "get_weather", {"city": "Paris"})
    assert (second.index, second.name) == (1, "get_time")
    assert json.loads(second.arguments) == {"tz": "Europe/Paris"}
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in p.tool_calls)
    assert first.id != second.id
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.name = "x"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ('"{\\"city\\": \\"Zürich\\"}"', '{"city": "Zürich"}'),  # a JSON string holding an object
        ('{"city": "Zürich", "days": [1, 2]}', '{"city": "Zürich", "days": [1, 2]}'),  # ensure_ascii=False
        ("{}", "{}"),
    ],
)
def test_arguments(arguments: str, expected: str) -> None:
    [call] = parse_output(f'<tool_call>\n{{"name": "f", "arguments": {arguments}}}\n</tool_call>').tool_calls
    assert call.arguments == expected


@pytest.mark.parametrize(
    "body",
    [
        "{not json",
        '{"arguments": {}}',
        '{"name": "", "arguments": {}}',
        '{"name": 3, "arguments": {}}',
        "[1, 2]",
        '"just a string"',
        '{"name": "f", "arguments": [1]}',
        '{"name": "f", "arguments": null}',
        '{"name": "f", "arguments": "not json"}',
        '{"name": "f", "arguments": "[1]"}',
        "[" * 100_000,
    ],
)
def test_invalid_call_degrades_to_raw_text(body: str) -> None:
    text = f"Before\n<tool_call>\n{body}\n</tool_call>\nafter"
    p = parse_output(text)
    assert p.content == text
    assert p.tool_calls == []
    assert summary(p) == summary(parse_output(text, tools=False))


def test_glm_tool_calls() -> None:
    """GLM-4.5's calls: the name on the first line, then key/value pairs (JSON values taken as such)."""
    glm = (
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>[1, 2]</arg_value>\n</tool_call>"
    )
    p = parse_output(f"<think>\nweather\n</think>\n\nChecking.\n{glm}\n<tool_call>now\n</tool_call>")
    assert (p.reasoning, p.content) == ("weather", "Checking.")
    first, second = p.tool_calls
    assert (first.name, json.loads(first.arguments)) == ("get_weather", {"city": "Paris", "days": [1, 2]})
    assert (second.index, second.name, second.arguments) == (1, "now", "{}")
    for i in range(1, len(glm)):  # any split streams the same
        assert summary(stream([glm[:i], glm[i:]])[0]) == summary(parse_output(glm))


@pytest.mark.parametrize(
    "body", ["f\ntext between <arg_key>a</arg_key><arg_value>1</arg_value>", "two words", "f\n<arg_key>a"]
)
def test_malformed_glm_calls_are_text(body: str) -> None:
    text = f"<tool_call>{body}</tool_call>"
    p = parse_output(text)
    assert p.tool_calls == [] and p.content == text


def test_minimax_tool_calls() -> None:
    """MiniMax-M2's block: several invokes, each with its parameters (JSON values taken as such)."""
    block = (
        '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
        '<parameter name="days">3</parameter>\n</invoke>\n<invoke name="now">\n</invoke>\n'
        "</minimax:tool_call>"
    )
    p = parse_output(f"Checking.\n{block}")
    assert p.content == "Checking."
    first, second = p.tool_calls
    assert (first.index, first.name, json.loads(first.arguments)) == (
        0,
        "get_weather",
        {"city": "Paris", "days": 3},
    )
    assert (second.index, second.name, second.arguments) == (1, "now", "{}")
    for i in range(1, len(block), 7):  # any split streams the same
        assert summary(stream([block[:i], block[i:]])[0]) == summary(parse_output(block))
    broken = '<minimax:tool_call><invoke name="f">stray</invoke></minimax:tool_call>'
    assert parse_output(broken).content == broken and parse_output(broken).tool_calls == []
    assert parse_output("<minimax:tool_call><invoke").content == "<minimax:tool_call><invoke"


DEEPSEEK_V31 = (
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
    '{"city": "Paris", "days": 3}<｜tool▁call▁end｜><｜tool▁call▁begin｜>now<｜tool▁sep｜>{}'
    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
)
DEEPSEEK_V3 = (
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
    '{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>now\n'
    "```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
)
KIMI = (
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
    '{"city": "Paris", "days": 3}<|tool_call_end|><|tool_call_begin|>functions.now:1'
    "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>"
)


@pytest.mark.parametrize(
    "block", [DEEPSEEK_V31, DEEPSEEK_V3, KIMI], ids=["deepseek-v3.1", "deepseek-v3", "kimi"]
)
def test_deepseek_and_kimi_call_sections(block: str) -> None:
    """A section of two calls, after reasoning and some text: both calls, in order, and any split of the
    text streams the same; a section with a call that is not one stays text, verbatim."""
    text = f"<think>Need the weather.</think>\nChecking.\n{block}"
    p = parse_output(text)
    assert (p.reasoning, p.content) == ("Need the weather.", "Checking.")
    assert [(c.index, c.name, json.loads(c.arguments)) for c in p.tool_calls] == [
        (0, "get_weather", {"city": "Paris", "days": 3}),
        (1, "now", {}),
    ]
    for i in range(1, len(text), 5):
        assert summary(stream([text[:i], text[i:]])[0]) == summary(p)
    broken = block.replace("{}", "[1]")  # arguments that are not an object
    assert parse_output(broken).tool_calls == [] and parse_output(broken).content == broken
    opened = block[: len(block) // 2]  # cut off mid-section: text at the end
    assert parse_output(opened).content == opened


@pytest.mark.parametrize(
    "tail",
    [
        ' [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "now", "arguments": "{}"}]',
        'get_weather[ARGS]{"city": "Paris"}',
    ],
    ids=["list", "args"],
)
def test_mistral_calls_close_with_the_generation(tail: str) -> None:
    """Mistral's `[TOOL_CALLS]` has no closing tag: the calls are read when the generation ends, from any
    split; one that is not a call stays text."""
    text = f"Checking. [TOOL_CALLS]{tail}"
    p = parse_output(text)
    assert p.content == "Checking."
    want = [("get_weather", {"city": "Paris"}), ("now", {})][: 2 if tail.startswith(" [") else 1]
    assert [(c.name, json.loads(c.arguments)) for c in p.tool_calls] == want
    for i in range(1, len(text), 4):
        assert summary(stream([text[:i], text[i:]])[0]) == summary(p)
    for broken in ("Checking. [TOOL_CALLS] [oops", 'x [TOOL_CALLS] [{"name": "f"}, 3]', "y [TOOL_CALLS]"):
        q = parse_output(broken)
        assert q.tool_calls == [] and q.content == broken


def test_valid_call_after_invalid_one_gets_index_zero() -> None:
    bad = "<tool_call>\n{oops}\n</tool_call>"
    p = parse_output(f"{bad}\n{WEATHER}")
    assert p.content == bad
    [call] = p.tool_calls
    assert (call.index, call.name) == (0, "get_weather")


@pytest.mark.parametrize("cut", [1, 5, 11, 12, 30, len(WEATHER) - 1])
def test_unterminated_call_at_flush_is_text(cut: int) -> None:
    text = "Sure.\n" + WEATHER[:cut]
    p, events = stream([text])
    assert p.content == text
    assert p.tool_calls == []
    assert events_summary(events) == (text, "", [])


def test_open_call_is_held_until_flush() -> None:
    p = OutputParser()
    assert p.push('Ok <tool_call>\n{"name": "f", "arguments": {"a": "</tool') == [TextDelta("Ok")]
    assert p.flush() == [TextDelta(' <tool_call>\n{"name": "f", "arguments": {"a": "</tool')]


@pytest.mark.parametrize(
    ("kwargs", "expected_content", "expected_reasoning", "calls"),
    [
        ({"reasoning": False}, "<think>\nr\n</think>\n\nx", "", 1),
        ({"tools": False}, "x\n\n" + WEATHER, "r", 0),
        ({"reasoning": False, "tools": False, "starts_in_reasoning": True}, None, "", 0),
    ],
)
def test_disabled_tags_are_text(
    kwargs: dict[str, bool], expected_content: str | None, expected_reasoning: str, calls: int
) -> None:
    text = f"<think>\nr\n</think>\n\nx\n\n{WEATHER}"
    p = parse_output(text, **kwargs)
    assert p.content == (text if expected_content is None else expected_content)
    assert p.reasoning == expected_reasoning
    assert len(p.tool_calls) == calls


def test_think_opens_reasoning_only_once() -> None:
    p = parse_output("<think>a</think>b <think>c</think>")
    assert (p.reasoning, p.content) == ("a", "b <think>c</think>")
    p = parse_output("<think>x</think>", starts_in_reasoning=True)
    assert (p.reasoning, p.content) == ("<think>x", "")


def test_tool_tags_inside_reasoning_are_reasoning() -> None:
    p = parse_output(f"<think>\nmaybe {WEATHER}\n</think>\n\nno")
    assert p.reasoning == f"maybe {WEATHER}"
    assert (p.content, p.tool_calls) == ("no", [])


def test_unicode_char_by_char() -> None:
    text = "<think>\n思考中…\n</think>\n\nこんにちは 🌍 " + WEATHER.replace("Paris", "東京")
    p, events = stream(list(text))
    assert (p.reasoning, p.content) == ("思考中…", "こんにちは 🌍")
    assert json.loads(p.tool_calls[0].arguments) == {"city": "東京"}
    assert "東京" in p.tool_calls[0].arguments
    assert events_summary(events) == summary(p)


def test_empty_and_whitespace_only_output() -> None:
    assert summary(parse_output("")) == ("", "", [])
    assert summary(parse_output("<think>\n\n</think>\n\n")) == ("", "", [])
    p, events = stream(["\n", "\n"])
    assert (p.content, events) == ("\n\n", [TextDelta("\n\n")])  # no tag follows: kept
