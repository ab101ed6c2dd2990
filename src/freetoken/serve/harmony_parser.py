"""Incremental parser of gpt-oss's output (OpenAI's harmony format) into reasoning, content and tool calls,
with OutputParser's interface (push / flush / content / reasoning / tool_calls).

The prompt ends with ``<|start|>assistant``; the model then writes messages, each a header and a body:

  <|channel|>analysis<|message|>...<|end|>                       reasoning
  <|start|>assistant<|channel|>final<|message|>...<|return|>      content
  <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{...}<|call|>

A header names the channel (analysis, commentary, final) and perhaps a recipient (``to=functions.NAME``,
before or after the channel). Bodies end at ``<|end|>``, ``<|return|>`` or ``<|call|>``. An analysis body
is reasoning (content when reasoning is off); a body addressed to ``functions.NAME`` is a tool call when it
is a JSON object (else it becomes content text verbatim); any other body, and text outside a message, is
content. Streaming: bodies are emitted as they come except a suffix that could still grow into a marker,
and a tool call's body, which is held until it ends; the events never depend on how the text was split.
"""

from __future__ import annotations

import json
import re

from freetoken.serve.output_parser import Event, ParsedOutput, partial_tag_len

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
GENERATION_PROMPT = "<|start|>assistant"  # how a harmony prompt ends: the parser's cue
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


class HarmonyParser(ParsedOutput):
    def __init__(self, reasoning: bool = True, tools: bool = True) -> None:
        super().__init__()
        self._reasoning_on, self._tools_on = reasoning, tools
        self._mode = "header"  # "header": reading up to <|message|>; "body"; "call": a tool call's body
        self._kind = "content"  # the open body's: "content", "reasoning"
        self._recipient = ""
        self._buf = ""  # unprocessed text: the header being read, a possible partial marker, a call's body

    def push(self, text: str) -> list[Event]:
        out: list[Event] = []
        self._buf += text
        while self._buf:
            if self._mode == "header":
                at = self._buf.find(MESSAGE)
                if at < 0:
                    break
                self._open_body(self._buf[:at])
                self._buf = self._buf[at + len(MESSAGE) :]
                continue
            hits = [(i, tag) for tag in ENDS if (i := self._buf.find(tag)) >= 0]
            if not hits:
                if self._mode == "body":
                    cut = len(self._buf) - partial_tag_len(self._buf, ENDS)
                    self._emit(self._buf[:cut], out)
                    self._buf = self._buf[cut:]
                break
            i, tag = min(hits)
            self._close_body(self._buf[:i], out)
            self._buf = self._buf[i + len(tag) :]
        return out

    def flush(self) -> list[Event]:
        """End of generation: an unfinished body is closed (a tool call's becomes text); header text with
        no message (the model wrote plain text) is content."""
        out: list[Event] = []
        if self._mode == "header":
            rest = self._buf.removeprefix(START).removeprefix("assistant")
            self._kind = "content"
            if CHANNEL not in rest:
                self._emit(rest, out)
        else:
            self._close_body(self._buf, out)
        self._buf, self._mode = "", "header"
        return out

    def _open_body(self, header: str) -> None:
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        self._recipient = recipient.group(1) if recipient else ""
        name = channel.group(1) if channel else ""
        if self._tools_on and self._recipient.startswith("functions."):
            self._mode = "call"
            return
        self._mode = "body"
        self._kind = "reasoning" if name == "analysis" and self._reasoning_on else "content"

    def _close_body(self, body: str, out: list[Event]) -> None:
        if self._mode == "call":
            self._close_call(body, out)
        else:
            self._emit(body, out)
        self._mode = "header"

    def _close_call(self, body: str, out: list[Event]) -> None:
        name = self._recipient.removeprefix("functions.")
        try:
            args = json.loads(body) if body.strip() else {}
        except json.JSONDecodeError:
            args = None
        if not isinstance(args, dict) or not name:
            self._kind = "content"
            self._emit(body, out)
            return
        self._call(name, json.dumps(args), out)

    def _emit(self, text: str, out: list[Event]) -> None:
        self._deliver(text, self._kind == "reasoning", out)
