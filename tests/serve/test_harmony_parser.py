"""gpt-oss's harmony output: analysis -> reasoning, final -> content, commentary to=functions.X -> tool
calls; the same events whatever the split; malformed calls and plain text are content."""

from __future__ import annotations

import json

import pytest

from freetoken.serve.harmony_parser import HarmonyParser
from freetoken.serve.output_parser import ReasoningDelta, TextDelta, ToolCallDelta

ANSWER = (
    "<|channel|>analysis<|message|>User asks the weather. Call the tool.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    '{"city": "Paris", "days": 2}<|call|>'
)
FINAL = (
    "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>4 < 5.<|return|>"
)


def run(chunks: list[str], **kwargs: bool) -> tuple[list[object], HarmonyParser]:
    parser = HarmonyParser(**kwargs)
    events = [e for chunk in chunks for e in parser.push(chunk)] + parser.flush()
    return events, parser


def summary(parser: HarmonyParser) -> tuple[str, str, list[tuple[str, dict]]]:
    calls = [(c.name, json.loads(c.arguments)) for c in parser.tool_calls]
    return parser.reasoning, parser.content, calls


def test_reasoning_then_a_tool_call() -> None:
    events, parser = run([ANSWER])
    assert summary(parser) == (
        "User asks the weather. Call the tool.",
        "",
        [("get_weather", {"city": "Paris", "days": 2})],
    )
    assert isinstance(events[0], ReasoningDelta) and isinstance(events[-1], ToolCallDelta)
    assert parser.tool_calls[0].id.startswith("call_")


def test_reasoning_then_the_final_answer() -> None:
    _, parser = run([FINAL])
    assert summary(parser) == ("Easy.", "4 < 5.", [])


@pytest.mark.parametrize("text", [ANSWER, FINAL])
def test_any_split_gives_the_same_result(text: str) -> None:
    whole = summary(run([text])[1])
    for i in range(1, len(text)):
        assert summary(run([text[:i], text[i:]])[1]) == whole
    assert summary(run(list(text))[1]) == whole  # a character at a time


def test_bodies_stream_before_they_end() -> None:
    parser = HarmonyParser()
    assert parser.push("<|channel|>final<|message|>Hello wor") == [TextDelta("Hello wor")]
    assert parser.push("ld<|ret") == [TextDelta("ld")]  # the partial marker is held back
    assert parser.push("urn|>") == [] and parser.content == "Hello world"


def test_a_call_that_is_not_a_json_object_is_content() -> None:
    text = "<|channel|>commentary to=functions.f <|constrain|>json<|message|>[1, 2]<|call|>"
    _, parser = run([text])
    assert parser.tool_calls == [] and parser.content == "[1, 2]"


def test_recipient_before_the_channel_and_tools_off() -> None:
    text = '<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{"q": "x"}<|call|>'
    assert summary(run([text])[1])[2] == [("lookup", {"q": "x"})]
    _, off = run([text], tools=False)
    assert off.tool_calls == [] and off.content == '{"q": "x"}'


def test_reasoning_off_keeps_analysis_as_content_and_plain_text_survives() -> None:
    _, parser = run([FINAL], reasoning=False)
    assert (parser.reasoning, parser.content) == ("", "Easy.4 < 5.")
    _, plain = run(["no markers at all"])
    assert plain.content == "no markers at all"
