"""Anthropic-compatible endpoints: /v1/messages (streamed or not) and /v1/messages/count_tokens.

Messages map onto the chat template's OpenAI-style roles: text blocks join into content, thinking
blocks become reasoning_content, tool_use blocks tool_calls, and each tool_result block a `tool` message.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse

from freetoken.runtime.logprobs import TokenLogprobs
from freetoken.runtime.sampling import SamplingParams
from freetoken.serve import fields
from freetoken.serve.body import read_json
from freetoken.serve.errors import bad, get, in_range, join_text_blocks
from freetoken.serve.generation import (
    Outcome,
    Prompt,
    chain,
    chat_prompt,
    complete,
    event_stream,
    parsed,
    unless_disconnected,
)
from freetoken.serve.openai_params import check_schema
from freetoken.serve.output_parser import ReasoningDelta, TextDelta, ToolCallDelta
from freetoken.serve.state import ServeState

router = APIRouter()
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
TOOL_CHOICES = ("auto", "any", "tool", "none")


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(where, "expected a string or an array of blocks")
    return join_text_blocks(content, where, "expected a text block")


def to_chat(body: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": _text_of(system, "system")})
    messages = get(body, "messages", list)
    if not messages:
        raise bad("messages", "at least one message is required")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad(where, "expected an object")
        role = get(message, "role", str, where=f"{where}.")
        if role not in ("user", "assistant"):
            raise bad(f"{where}.role", f"{role!r} is not user or assistant")
        content = get(message, "content", (str, list), where=f"{where}.")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        text, reasoning, calls, results = [], [], [], []
        for j, block in enumerate(blocks):
            at = f"{where}.content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                text.append(get(block, "text", str, where=f"{at}."))
            elif kind == "thinking" and role == "assistant":
                reasoning.append(get(block, "thinking", str, where=f"{at}."))
            elif kind == "redacted_thinking" and role == "assistant":
                continue
            elif kind == "tool_use" and role == "assistant":
                call_input = get(block, "input", dict, default={}, where=f"{at}.")
                name = get(block, "name", str, where=f"{at}.")
                call_id = get(block, "id", str, default=None, where=f"{at}.")
                calls.append({"id": call_id, "function": {"name": name, "arguments": call_input}})
            elif kind == "tool_result" and role == "user":
                result = get(block, "content", (str, list), default="", where=f"{at}.")
                call_id = get(block, "tool_use_id", str, default=None, where=f"{at}.")
                text_result = _text_of(result, f"{at}.content")
                results.append({"role": "tool", "content": text_result, "tool_call_id": call_id})
            else:
                raise bad(f"{at}.type", f"{kind!r} is not supported in a {role} message")
        out.extend(results)
        if role == "user" and (text or not results):
            out.append({"role": "user", "content": "".join(text)})
        if role == "assistant":
            item: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
            if reasoning:
                item["reasoning_content"] = "".join(reasoning)
            if calls:
                item["tool_calls"] = calls
            out.append(item)
    return out


def to_tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = get(body, "tools", list, default=None)
    choice = get(body, "tool_choice", dict, default={})
    if get(choice, "type", str, default="auto", where="tool_choice.") not in TOOL_CHOICES:
        raise bad("tool_choice.type", f"expected one of {', '.join(TOOL_CHOICES)}")
    out = []
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict):
            raise bad(f"tools[{i}]", "expected an object")
        name = get(tool, "name", str, where=f"tools[{i}].")
        schema = get(tool, "input_schema", dict, default={"type": "object"}, where=f"tools[{i}].")
        check_schema(schema, f"tools[{i}].input_schema")
        description = get(tool, "description", str, default="", where=f"tools[{i}].")
        fn = {"name": name, "description": description, "parameters": schema}
        out.append({"type": "function", "function": fn})
    if not out or choice.get("type") == "none":
        return None
    return out


async def prompt_of(state: ServeState, body: dict[str, Any]) -> Prompt:
    thinking = get(body, "thinking", dict, default=None)
    kwargs = {}
    if thinking is not None:
        kind = get(thinking, "type", str, where="thinking.")
        if kind not in ("enabled", "disabled"):
            raise bad("thinking.type", f"{kind!r} is not enabled or disabled")
        kwargs["enable_thinking"] = kind == "enabled"
    return await chat_prompt(state, to_chat(body), to_tools(body), **kwargs)


def sampling(body: dict[str, Any], state: ServeState) -> SamplingParams:
    max_tokens = get(body, "max_tokens", int)
    if max_tokens < 1:
        raise bad("max_tokens", f"{max_tokens} must be >= 1")
    stops = get(body, "stop_sequences", list, default=[])
    if not all(isinstance(s, str) for s in stops):
        raise bad("stop_sequences", "expected an array of strings")
    return SamplingParams(
        temperature=in_range("temperature", get(body, "temperature", float, default=1.0), 0.0, 1.0) or 0.0,
        top_p=in_range("top_p", get(body, "top_p", float, default=1.0), 1e-9, 1.0) or 1.0,
        top_k=int(in_range("top_k", get(body, "top_k", int, default=0), 0, 1 << 30) or 0),
        max_tokens=min(max_tokens, state.engine_context()),
        stop=tuple(stops),
    )


def _usage(outcome: Outcome) -> dict[str, int]:
    return {
        "input_tokens": outcome.prompt_tokens - outcome.cached_tokens,
        "output_tokens": outcome.completion_tokens,
        "cache_read_input_tokens": outcome.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def _tool_block(call: ToolCallDelta) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": "toolu_" + call.id.removeprefix("call_"),
        "name": call.name,
        "input": {},
    }


@router.post("/v1/messages")
async def messages(request: Request) -> Any:
    state: ServeState = request.app.state.serve
    body = await read_json(request, state.config.max_body_bytes)
    fields.MESSAGES.check(body)
    model = state.served_model(get(body, "model", str))
    params = sampling(body, state)
    stream_it = get(body, "stream", bool, default=False)
    prompt = await prompt_of(state, body)
    message_id = f"msg_{secrets.token_hex(12)}"
    if stream_it:
        return await event_stream(_stream(state, prompt, params, message_id, model), "/v1/messages")
    outcome = await unless_disconnected(request, complete(state.batcher, prompt, params))
    content: list[dict[str, Any]] = []
    if outcome.reasoning:
        content.append({"type": "thinking", "thinking": outcome.reasoning, "signature": ""})
    if outcome.content:
        content.append({"type": "text", "text": outcome.content})
    for call in outcome.tool_calls:
        content.append({**_tool_block(call), "input": json.loads(call.arguments)})
    return JSONResponse(
        {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": content,
            "stop_reason": STOP_REASONS.get(outcome.finish_reason, "end_turn"),
            "stop_sequence": None,
            "usage": _usage(outcome),
        }
    )


def _event(kind: str, doc: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **doc}, ensure_ascii=False)}\n\n"


async def _stream(
    state: ServeState, prompt: Prompt, params: SamplingParams, message_id: str, model: str
) -> AsyncIterator[str]:
    items = parsed(state.batcher, prompt, params)
    first = await items.__anext__()
    start = {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": len(prompt.ids), "output_tokens": 0},
    }
    yield _event("message_start", {"message": start})
    index, open_kind = -1, None  # the content block being streamed

    def closing() -> list[str]:
        """Events that end the open block: a thinking block gets its (empty) signature first."""
        events = []
        if open_kind == "thinking":
            signature = {"type": "signature_delta", "signature": ""}
            events.append(_event("content_block_delta", {"index": index, "delta": signature}))
        if open_kind is not None:
            events.append(_event("content_block_stop", {"index": index}))
        return events

    async for item in chain(first, items):
        if isinstance(item, TokenLogprobs):  # not part of this protocol
            continue
        if isinstance(item, Outcome):
            for event in closing():
                yield event
            delta = {"stop_reason": STOP_REASONS.get(item.finish_reason, "end_turn"), "stop_sequence": None}
            yield _event("message_delta", {"delta": delta, "usage": _usage(item)})
            yield _event("message_stop", {})
            return
        kind = (
            "text"
            if isinstance(item, TextDelta)
            else "thinking"
            if isinstance(item, ReasoningDelta)
            else "tool"
        )
        if kind != open_kind or kind == "tool":
            for event in closing():
                yield event
            index += 1
            open_kind = kind
            block: dict[str, Any] = (
                {"type": "text", "text": ""}
                if kind == "text"
                else {"type": "thinking", "thinking": ""}
                if kind == "thinking"
                else _tool_block(item)  # type: ignore[arg-type]
            )
            yield _event("content_block_start", {"index": index, "content_block": block})
        if isinstance(item, TextDelta):
            delta = {"type": "text_delta", "text": item.text}
        elif isinstance(item, ReasoningDelta):
            delta = {"type": "thinking_delta", "thinking": item.text}
        else:
            delta = {"type": "input_json_delta", "partial_json": item.arguments}
        yield _event("content_block_delta", {"index": index, "delta": delta})


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> JSONResponse:
    state: ServeState = request.app.state.serve
    body = await read_json(request, state.config.max_body_bytes)
    fields.COUNT_TOKENS.check(body)
    state.served_model(get(body, "model", str, default=None))
    return JSONResponse({"input_tokens": len((await prompt_of(state, body)).ids)})
