"""Incremental parser of a Qwen-family model's output into reasoning, content and tool calls.

Formats (Qwen3 chat template):

* Reasoning: ``<think>`` ... ``</think>``; the text inside is reasoning. Qwen writes
  ``<think>\\n...\\n</think>\\n\\n``, so whitespace touching a tag is dropped: at the start and end of the
  reasoning and at the start of the content after it. When the prompt already ends in ``<think>\\n``
  (``starts_in_reasoning=True``), the output starts inside reasoning and a bare ``</think>`` closes it.
  ``<think>`` opens reasoning at most once per generation; after that, and with ``reasoning=False``, think
  tags are ordinary text.
* Tool calls: ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, possibly several in a row
  and possibly after some text. The body is buffered until ``</tool_call>`` and then parsed. It is a call if
  it is a JSON object with a non-empty string ``name`` and ``arguments`` an object, or a JSON string holding
  an object, or missing (``{}``); or, as GLM-4.5's template writes them, the function's name on the first
  line followed by ``<arg_key>k</arg_key>`` ``<arg_value>v</arg_value>`` pairs (a value that parses as JSON
  is taken as such, else as a string). MiniMax-M2's block ``<minimax:tool_call>`` ... ``</minimax:tool_call>``
  holds one or more ``<invoke name="f">`` with ``<parameter name="k">v</parameter>`` each (values likewise);
  its calls are valid only all together; DeepSeek-V3's and Kimi's call sections likewise, and Mistral's
  ``[TOOL_CALLS]``, which the end of the generation closes (tool_formats.py has every format). Anything
  else, and a call still open at the end, becomes content text verbatim, tags included, exactly as if tool
  parsing were off (``tools=False``). Whitespace touching a valid call is dropped.

Streaming: text arrives in arbitrary chunks (``"<too"`` + ``"l_call>"``). Everything is emitted at once except
(a) a suffix that could still grow into a tag, (b) trailing whitespace of a segment, which is dropped if a tag
follows, and (c) the body of an open tool call. Hence the concatenated events never depend on the split.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from freetoken.serve.tool_formats import TOOL_FORMATS

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN = "<tool_call>"
TOOL_TAGS = {tag: form.close for tag, form in TOOL_FORMATS.items()}  # a call block's opening -> closing


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """One complete tool call, emitted when its closing tag arrives."""

    index: int  # 0, 1, ... in order of appearance (valid calls only)
    id: str  # "call_" + 24 hex chars
    name: str
    arguments: str  # JSON text of the arguments object


Event = TextDelta | ReasoningDelta | ToolCallDelta


def partial_tag_len(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`."""
    return max((n for tag in tags for n in range(1, len(tag)) if text.endswith(tag[:n])), default=0)


class ParsedOutput:
    """What a parser has made of a generation so far: content, reasoning and tool calls, and the events
    it hands out (adjacent deltas of one kind merged, none empty)."""

    def __init__(self) -> None:
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self.tool_calls: list[ToolCallDelta] = []

    @property
    def content(self) -> str:
        return "".join(self._content)

    @property
    def reasoning(self) -> str:
        return "".join(self._reasoning)

    def _deliver(self, text: str, reasoning: bool, out: list[Event]) -> None:
        if not text:
            return
        (self._reasoning if reasoning else self._content).append(text)
        kind = ReasoningDelta if reasoning else TextDelta
        if out and type(out[-1]) is kind:
            text = out.pop().text + text  # type: ignore[union-attr]
        out.append(kind(text))

    def _call(self, name: str, arguments: str, out: list[Event]) -> None:
        call = ToolCallDelta(len(self.tool_calls), "call_" + secrets.token_hex(12), name, arguments)
        self.tool_calls.append(call)
        out.append(call)


class OutputParser(ParsedOutput):
    def __init__(self, reasoning: bool = True, tools: bool = True, starts_in_reasoning: bool = False) -> None:
        super().__init__()
        self._think_on = reasoning
        self._tools_on = tools
        # "content", "reasoning" or "tool" (inside <tool_call>, buffering the body)
        self._mode = "reasoning" if reasoning and starts_in_reasoning else "content"
        self._think_seen = self._mode == "reasoning"  # <think> opens reasoning at most once
        self._buf = ""  # unprocessed text: a possible partial tag, or the body of the open tool call
        self._open_tag = TOOL_OPEN  # the opening tag of the call block being read
        self._ws = ""  # trailing whitespace of the current segment, held back: dropped if a tag follows
        self._lead = self._mode == "reasoning"  # the segment follows a tag: drop its leading whitespace

    def push(self, text: str) -> list[Event]:
        """Events for this chunk; adjacent deltas of the same kind are merged, none is empty."""
        out: list[Event] = []
        self._buf += text
        while self._buf:
            if self._mode == "tool":
                close = TOOL_TAGS[self._open_tag]
                end = self._buf.find(close) if close else -1  # no closing tag: the generation's end closes
                if end < 0:
                    break
                body, self._buf = self._buf[:end], self._buf[end + len(close) :]
                self._close_call(body, out)
                continue
            tags = self._tags()
            hits = [(i, tag) for tag in tags if (i := self._buf.find(tag)) >= 0]
            if not hits:
                cut = len(self._buf) - partial_tag_len(self._buf, tags)
                self._text(self._buf[:cut], out)
                self._buf = self._buf[cut:]
                break
            i, tag = min(hits)
            self._text(self._buf[:i], out)
            self._buf = self._buf[i + len(tag) :]
            self._open(tag)
        return out

    def flush(self) -> list[Event]:
        """End of generation: release held-back text; an open tool call becomes text (one whose format has
        no closing tag is complete now)."""
        out: list[Event] = []
        if self._mode == "tool" and not TOOL_TAGS[self._open_tag]:
            self._close_call(self._buf, out)
        elif self._mode == "tool":
            self._mode = "content"
            self._text(self._open_tag + self._buf, out)
        else:
            self._text(self._buf, out)
        self._buf = ""
        ws, self._ws = self._ws, ""
        self._emit(ws, out)
        return out

    def _tags(self) -> tuple[str, ...]:
        """The tags that end the current (content or reasoning) segment."""
        if self._mode == "reasoning":
            return (THINK_CLOSE,)
        on = [(THINK_OPEN, self._think_on and not self._think_seen)]
        on += [(tag, self._tools_on) for tag in TOOL_TAGS]
        return tuple(tag for tag, enabled in on if enabled)

    def _open(self, tag: str) -> None:
        if tag in TOOL_TAGS:
            # _ws and _lead are kept: if the call turns out invalid it is put back as text
            self._mode, self._open_tag = "tool", tag
            return
        self._mode = "reasoning" if tag == THINK_OPEN else "content"
        self._think_seen = True
        self._ws, self._lead = "", True

    def _close_call(self, body: str, out: list[Event]) -> None:
        self._mode = "content"
        calls = TOOL_FORMATS[self._open_tag].parse(body)
        if calls is None:
            self._text(self._open_tag + body + (TOOL_TAGS[self._open_tag] or ""), out)
            return
        for name, arguments in calls:
            self._call(name, arguments, out)
        self._ws, self._lead = "", True

    def _text(self, text: str, out: list[Event]) -> None:
        """Segment text: drop leading whitespace after a tag, hold back trailing whitespace."""
        if self._lead:
            text = text.lstrip()
            self._lead = not text
        text = self._ws + text
        body = text.rstrip()
        self._ws = text[len(body) :]
        self._emit(body, out)

    def _emit(self, text: str, out: list[Event]) -> None:
        self._deliver(text, self._mode == "reasoning", out)


def parse_output(text: str, **kwargs: bool) -> OutputParser:
    """Parse a whole generation at once: push(text) + flush()."""
    parser = OutputParser(**kwargs)
    parser.push(text)
    parser.flush()
    return parser
