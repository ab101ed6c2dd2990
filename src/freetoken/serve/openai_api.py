"""OpenAI-compatible endpoints: /v1/models, /v1/chat/completions, /v1/completions."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, StreamingResponse

from freetoken.runtime.sampling import SamplingParams
from freetoken.serve.errors import bad, get, in_range, join_text_blocks, sse_guard
from freetoken.serve.generation import Outcome, Prompt, chain, complete, parsed, render_chat, stream
from freetoken.serve.output_parser import ReasoningDelta, TextDelta, ToolCallDelta
from freetoken.serve.state import ServeState, read_json

router = APIRouter()
ROLES = ("system", "developer", "user", "assistant", "tool")


def sampling(body: dict[str, Any], state: ServeState, default_max: int) -> SamplingParams:
    stop = get(body, "stop", (str, list), default=[])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stop) or len(stop) > 4:
        raise bad("stop", "expected a string or an array of at most 4 strings")
    if get(body, "n", int, default=1) != 1:
        raise bad("n", "only n = 1 is supported")
    limit = get(body, "max_completion_tokens", int, default=None) or get(
        body, "max_tokens", int, default=None
    )
    if limit is not None and limit < 1:
        raise bad("max_tokens", f"{limit} must be >= 1")
    return SamplingParams(
        temperature=in_range("temperature", get(body, "temperature", float, default=1.0), 0.0, 2.0) or 0.0,
        top_p=in_range("top_p", get(body, "top_p", float, default=1.0), 1e-9, 1.0) or 1.0,
        top_k=int(in_range("top_k", get(body, "top_k", int, default=0), 0, 1 << 30) or 0),
        seed=get(body, "seed", int, default=None),
        max_tokens=min(limit or default_max, state.engine_context()),
        stop=tuple(stop),
        ignore_eos=get(body, "ignore_eos", bool, default=False),  # an extension, as in vLLM
    )


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = get(body, "messages", list)
    if not messages:
        raise bad("messages", "at least one message is required")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]."
        if not isinstance(message, dict):
            raise bad(f"messages[{i}]", "expected an object")
        role = get(message, "role", str, where=where)
        if role not in ROLES:
            raise bad(f"{where}role", f"{role!r} is not one of {', '.join(ROLES)}")
        content = get(message, "content", (str, list), default="", where=where)
        if isinstance(content, list):
            content = join_text_blocks(content, f"{where}content", "only text parts are supported")
        item: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
        calls = get(message, "tool_calls", list, default=None, where=where)
        if calls:
            item["tool_calls"] = [_tool_call(call, f"{where}tool_calls[{j}]") for j, call in enumerate(calls)]
        if isinstance(message.get("reasoning_content"), str):
            item["reasoning_content"] = message["reasoning_content"]
        out.append(item)
    return out


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise bad(where, "expected {id, type: function, function: {name, arguments}}")
    fn = call["function"]
    name = get(fn, "name", str, where=f"{where}.function.")
    arguments = get(fn, "arguments", (str, dict), default="{}", where=f"{where}.function.")
    return {"id": call.get("id"), "type": "function", "function": {"name": name, "arguments": arguments}}


def chat_tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = get(body, "tools", list, default=None)
    choice = body.get("tool_choice", "auto")
    if choice == "none" or not tools:
        return None
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
            raise bad(f"tools[{i}]", "expected {type: function, function: {name, parameters}}")
        get(tool["function"], "name", str, where=f"tools[{i}].function.")
    return tools


def _usage(outcome: Outcome) -> dict[str, Any]:
    return {
        "prompt_tokens": outcome.prompt_tokens,
        "completion_tokens": outcome.completion_tokens,
        "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": outcome.cached_tokens},
    }


def _tool_json(call: ToolCallDelta) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


@router.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    state: ServeState = request.app.state.serve
    return JSONResponse(
        {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": int(state.started), "owned_by": "freetoken"}
                for name in state.model_names
            ],
        }
    )


CHAT_PATH = "/v1/chat/completions"


@router.post(CHAT_PATH)
async def chat_completions(request: Request) -> Any:
    state: ServeState = request.app.state.serve
    body = await read_json(request)
    messages, tools = chat_messages(body), chat_tools(body)
    params = sampling(body, state, default_max=state.default_max_tokens)
    kwargs = get(body, "chat_template_kwargs", dict, default={})
    thinking = {k: kwargs[k] for k in ("enable_thinking",) if k in kwargs}
    prompt = render_chat(state.batcher, messages, tools, **thinking)
    model = get(body, "model", str, default=state.model_names[0])
    meta = {"id": f"chatcmpl-{secrets.token_hex(12)}", "created": int(time.time()), "model": model}
    if get(body, "stream", bool, default=False):
        options = get(body, "stream_options", dict, default={})
        events = _chat_stream(state, prompt, params, meta, bool(options.get("include_usage")))
        return StreamingResponse(await _primed(events, CHAT_PATH), media_type="text/event-stream")
    outcome = await complete(state.batcher, prompt, params)
    message: dict[str, Any] = {"role": "assistant", "content": outcome.content or None}
    if outcome.reasoning:
        message["reasoning_content"] = outcome.reasoning
    if outcome.tool_calls:
        message["tool_calls"] = [_tool_json(c) for c in outcome.tool_calls]
    return JSONResponse(
        {
            **meta,
            "object": "chat.completion",
            "choices": [
                {"index": 0, "message": message, "finish_reason": outcome.finish_reason, "logprobs": None}
            ],
            "usage": _usage(outcome),
        }
    )


def _sse(doc: dict[str, Any]) -> str:
    return f"data: {json.dumps(doc, ensure_ascii=False)}\n\n"


async def _chat_stream(
    state: ServeState, prompt: Prompt, params: SamplingParams, meta: dict[str, Any], usage: bool
) -> AsyncIterator[str]:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        return _sse({**meta, "object": "chat.completion.chunk", "choices": [choice]})

    items = parsed(state.batcher, prompt, params)
    first = await items.__anext__()  # submitted: a refusal is raised before anything is sent
    yield chunk({"role": "assistant", "content": ""})
    async for item in chain(first, items):
        if isinstance(item, TextDelta):
            yield chunk({"content": item.text})
        elif isinstance(item, ReasoningDelta):
            yield chunk({"reasoning_content": item.text})
        elif isinstance(item, ToolCallDelta):
            yield chunk({"tool_calls": [{"index": item.index, **_tool_json(item)}]})
        else:
            yield chunk({}, item.finish_reason)
            if usage:
                yield _sse({**meta, "object": "chat.completion.chunk", "choices": [], "usage": _usage(item)})
    yield "data: [DONE]\n\n"


async def _primed(events: AsyncIterator[str], path: str) -> AsyncIterator[str]:
    """Start the stream before answering, so a request refused at submission (400, 429) is still an
    HTTP error rather than a broken stream; later failures end it with an error event."""
    return sse_guard(path, chain(await events.__anext__(), events))


@router.post("/v1/completions")
async def completions(request: Request) -> Any:
    state: ServeState = request.app.state.serve
    body = await read_json(request)
    prompt = get(body, "prompt", (str, list))
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise bad("prompt", "expected a string or an array of token ids")
        ids = list(prompt)
    else:
        ids = state.batcher.engine.tokenizer.encode(prompt)
    if not ids:
        raise bad("prompt", "empty prompt")
    params = sampling(body, state, default_max=16)
    model = get(body, "model", str, default=state.model_names[0])
    meta = {"id": f"cmpl-{secrets.token_hex(12)}", "created": int(time.time()), "model": model}
    if get(body, "stream", bool, default=False):
        return StreamingResponse(
            await _primed(_text_stream(state, ids, params, meta), "/v1/completions"),
            media_type="text/event-stream",
        )
    text, finish, stats = "", "stop", None
    async for event in stream(state.batcher, ids, params):
        text += event.text
        if event.finished:
            finish, stats = event.finish_reason or "stop", event.stats
    assert stats is not None
    outcome = Outcome(
        prompt_tokens=len(ids), cached_tokens=stats.cached_tokens, completion_tokens=stats.completion_tokens
    )
    choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    return JSONResponse({**meta, "object": "text_completion", "choices": [choice], "usage": _usage(outcome)})


async def _text_stream(
    state: ServeState, ids: list[int], params: SamplingParams, meta: dict[str, Any]
) -> AsyncIterator[str]:
    async for event in stream(state.batcher, ids, params):
        choice = {"index": 0, "text": event.text, "finish_reason": event.finish_reason, "logprobs": None}
        yield _sse({**meta, "object": "text_completion", "choices": [choice]})
    yield "data: [DONE]\n\n"
