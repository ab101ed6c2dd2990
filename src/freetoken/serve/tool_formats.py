"""Tool-call blocks as the model families write them: an opening tag, a body, a closing tag; the body is
parsed whole once the closing tag arrives, into (name, arguments as JSON text) calls, or None when it is
not a valid block (the parser then shows it as text, verbatim). By opening tag:

* `<tool_call>` (Qwen, GLM-4.5): one call, JSON `{"name", "arguments"}` or GLM's name line followed by
  `<arg_key>k</arg_key>` `<arg_value>v</arg_value>` pairs.
* `<minimax:tool_call>` (MiniMax-M2): one or more `<invoke name="f">` holding
  `<parameter name="k">v</parameter>` each.
* `<｜tool▁calls▁begin｜>` (DeepSeek-V3.x): one or more
  `<｜tool▁call▁begin｜>f<｜tool▁sep｜>{args}<｜tool▁call▁end｜>` (V3.1 on); V3 and R1 write
  `function<｜tool▁sep｜>f` and then the arguments in a json fence.
* `<|tool_calls_section_begin|>` (Kimi-K2, Kimi-Linear): one or more
  `<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{args}<|tool_call_end|>`.
* `[TOOL_CALLS]` (Mistral's instruct models, Mixtral-8x22B): no closing tag, the rest of the generation:
  a JSON list of `{"name", "arguments"}`, or `f[ARGS]{args}` (newer tokenizers).

A parameter value that parses as JSON is taken as such, else as a string; arguments are a JSON object.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

Call = tuple[str, str]  # (name, arguments as JSON text)
Calls = list[Call]


_GLM_ARG = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_FUNCTION_NAME = re.compile(r"[A-Za-z_][\w.\-]*")


def _parse_glm_call(body: str) -> tuple[str, str] | None:
    """GLM-4.5's body: the name on the first line, then key/value pairs; None if it is not one."""
    name, _, rest = body.strip().partition("\n")
    name = name.strip()
    pairs = _whole(_GLM_ARG, rest)
    if not _FUNCTION_NAME.fullmatch(name) or pairs is None:
        return None
    args = {pair.group(1).strip(): _value(pair.group(2)) for pair in pairs}
    return name, json.dumps(args, ensure_ascii=False)


_INVOKE = re.compile(r'\s*<invoke name="([^"]+)">(.*?)</invoke>', re.DOTALL)
_PARAMETER = re.compile(r'\s*<parameter name="([^"]+)">(.*?)</parameter>', re.DOTALL)


def _value(raw: str) -> object:
    """A parameter's value: JSON where it parses, else the text."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return raw


def _whole(pattern: re.Pattern[str], text: str) -> list[re.Match[str]] | None:
    """The matches of `pattern` covering `text` up to whitespace, or None if anything else is there."""
    matches, at = [], 0
    for match in pattern.finditer(text):
        if text[at : match.start()].strip():
            return None
        matches.append(match)
        at = match.end()
    return matches if not text[at:].strip() else None


def _section(
    pattern: re.Pattern[str], body: str, one: Callable[[re.Match[str]], Call | None]
) -> Calls | None:
    """The calls of a block made of `pattern`'s matches (whitespace between), each read by `one`; None if
    the block is empty, holds anything else, or one of its calls is not valid (all or nothing)."""
    return _all_or_none([one(match) for match in _whole(pattern, body) or ()])


def _all_or_none(calls: list[Call | None]) -> Calls | None:
    """The calls when there are some and every one is valid, else None (a block stands or falls whole)."""
    valid = [call for call in calls if call is not None]
    return valid if calls and len(valid) == len(calls) else None


def _minimax_invoke(invoke: re.Match[str]) -> Call | None:
    params = _whole(_PARAMETER, invoke.group(2))
    if params is None or not _FUNCTION_NAME.fullmatch(invoke.group(1)):
        return None
    args = {p.group(1): _value(p.group(2).strip("\n")) for p in params}
    return invoke.group(1), json.dumps(args, ensure_ascii=False)


def _parse_minimax_block(body: str) -> Calls | None:
    """MiniMax-M2's block: its invokes' (name, arguments as JSON text), or None if it is not all calls."""
    return _section(_INVOKE, body, _minimax_invoke)


def _parse_call(body: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a tool-call body, or None if it is not a valid call."""
    if not body.lstrip().startswith(("{", '"')):
        return _parse_glm_call(body)
    try:
        obj = json.loads(body)
        if not isinstance(obj, dict):
            return None
        args = obj.get("arguments", {})
        if isinstance(args, str):
            args = json.loads(args)
    except (ValueError, RecursionError):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name or not isinstance(args, dict):
        return None
    return name, json.dumps(args, ensure_ascii=False)


def _parse_one(body: str) -> Calls | None:
    call = _parse_call(body)
    return None if call is None else [call]


def _arguments(raw: str) -> str | None:
    """A JSON object's text re-serialised, or None."""
    try:
        args = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return json.dumps(args, ensure_ascii=False) if isinstance(args, dict) else None


_DEEPSEEK_CALL = re.compile(r"\s*<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>", re.DOTALL)
_JSON_FENCE = re.compile(r"([^\n]+)\n```json\n(.*)\n```\s*", re.DOTALL)


def _deepseek_call(call: re.Match[str]) -> Call | None:
    name, rest = call.group(1).strip(), call.group(2)
    if name == "function" and (fenced := _JSON_FENCE.fullmatch(rest.strip("\n") + "\n")) is not None:
        name, rest = fenced.group(1).strip(), fenced.group(2)
    args = _arguments(rest)
    return None if args is None or not _FUNCTION_NAME.fullmatch(name) else (name, args)


def _parse_deepseek_block(body: str) -> Calls | None:
    """DeepSeek-V3.x's section: name<｜tool▁sep｜>arguments per call (V3.1 on), or function<｜tool▁sep｜>
    name and a json fence (V3, R1)."""
    return _section(_DEEPSEEK_CALL, body, _deepseek_call)


_KIMI_CALL = re.compile(
    r"\s*<\|tool_call_begin\|>(.*?)<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>", re.DOTALL
)
_KIMI_ID = re.compile(r"(?:functions\.)?([A-Za-z_][\w.\-]*?)(?::\d+)?")


def _kimi_call(call: re.Match[str]) -> Call | None:
    ident, args = _KIMI_ID.fullmatch(call.group(1).strip()), _arguments(call.group(2))
    return None if ident is None or args is None else (ident.group(1), args)


def _parse_kimi_block(body: str) -> Calls | None:
    """Kimi's section: each call's id `functions.NAME:INDEX`, then its arguments."""
    return _section(_KIMI_CALL, body, _kimi_call)


_MISTRAL_ARGS = re.compile(r"\s*([A-Za-z_][\w.\-]*)\[ARGS\](.*)", re.DOTALL)


def _parse_mistral(body: str) -> Calls | None:
    """Mistral's calls: a JSON list of call objects, or one `name[ARGS]{json}`."""
    named = _MISTRAL_ARGS.fullmatch(body)
    if named is not None:
        args = _arguments(named.group(2))
        return None if args is None else [(named.group(1), args)]
    try:
        listed = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(listed, list):
        return None
    return _all_or_none(
        [_parse_call(json.dumps(item)) if isinstance(item, dict) else None for item in listed]
    )


@dataclass(frozen=True)
class ToolFormat:
    close: str  # the block's closing tag ("": the generation's end closes it)
    parse: Callable[[str], Calls | None]  # the body between the tags -> its calls, or None


TOOL_FORMATS: dict[str, ToolFormat] = {  # opening tag -> its format
    "<tool_call>": ToolFormat("</tool_call>", _parse_one),
    "<minimax:tool_call>": ToolFormat("</minimax:tool_call>", _parse_minimax_block),
    "<｜tool▁calls▁begin｜>": ToolFormat("<｜tool▁calls▁end｜>", _parse_deepseek_block),
    "<|tool_calls_section_begin|>": ToolFormat("<|tool_calls_section_end|>", _parse_kimi_block),
    "[TOOL_CALLS]": ToolFormat("", _parse_mistral),
}
