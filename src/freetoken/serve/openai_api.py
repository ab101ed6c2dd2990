"""OpenAI-compatible endpoints: /v1/models, /v1/chat/completions, /v1/completions."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse

from freetoken.runtime.logprobs import TokenLogprobs
from freetoken.runtime.sampling import SamplingParams
from freetoken.runtime.sequence import GenerationStats
from freetoken.serve import fields
from freetoken.serve.body import read_json
from freetoken.serve.errors import bad, get
from freetoken.serve.generation import (
    Outcome,
    Prompt,
    chain,
    chat_prompt,
    complete,
    encode,
    event_stream,
    parsed,
    stream,
    unless_disconnected,
)
from freetoken.serve.logprobs_json import chat_entries, chat_logprobs, completion_logprobs
from freetoken.serve.openai_params import (
    chat_logprobs as requested_chat_logprobs,
)
from freetoken.serve.openai_params import (
    chat_messages,
    chat_tools,
    sampling,
    token_ids,
)
from freetoken.serve.openai_params import (
    completion_logprobs as requested_completion_logprobs,
)
from freetoken.serve.output_parser import ReasoningDelta, TextDelta, ToolCallDelta
from freetoken.serve.state import ServeState

router = APIRouter()
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


def _usage(outcome: Outcome) -> dict[str, Any]:
    return {
        "prompt_tokens": outcome.prompt_tokens,
        "completion_tokens": outcome.completion_tokens,
        "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": outcome.cached_tokens},
    }


def _stats_usage(ids: list[int], stats: GenerationStats) -> dict[str, Any]:
    return _usage(
        Outcome(
            prompt_tokens=len(ids),
            cached_tokens=stats.cached_tokens,
            completion_tokens=stats.completion_tokens,
        )
    )


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


@router.post(CHAT_PATH)
async def chat_completions(request: Request) -> Any:
    state: ServeState = request.app.state.serve
    body = await read_json(request, state.config.max_body_bytes)
    fields.CHAT.check(body)
    messages, tools = chat_messages(body), chat_tools(body)
    params = sampling(body, state, state.config.default_max_tokens, requested_chat_logprobs(body))
    kwargs = get(body, "chat_template_kwargs", dict, default={})
    thinking = {k: kwargs[k] for k in ("enable_thinking",) if k in kwargs}
    model = state.served_model(get(body, "model", str, default=None))
    stream_it = get(body, "stream", bool, default=False)
    options = get(body, "stream_options", dict, default={})
    prompt = await chat_prompt(state, messages, tools, **thinking)
    meta = {"id": f"chatcmpl-{secrets.token_hex(12)}", "created": int(time.time()), "model": model}
    if stream_it:
        events = _chat_stream(state, prompt, params, meta, bool(options.get("include_usage")))
        return await event_stream(events, CHAT_PATH)
    outcome = await unless_disconnected(request, complete(state.batcher, prompt, params))
    message: dict[str, Any] = {"role": "assistant", "content": outcome.content or None}
    if outcome.reasoning:
        message["reasoning_content"] = outcome.reasoning
    if outcome.tool_calls:
        message["tool_calls"] = [_tool_json(c) for c in outcome.tool_calls]
    logprobs = chat_logprobs(state.pieces, outcome.logprobs) if params.logprobs is not None else None
    choice = {"index": 0, "message": message, "finish_reason": outcome.finish_reason, "logprobs": logprobs}
    return JSONResponse({**meta, "object": "chat.completion", "choices": [choice], "usage": _usage(outcome)})


def _sse(doc: dict[str, Any]) -> str:
    return f"data: {json.dumps(doc, ensure_ascii=False)}\n\n"


async def _chat_stream(
    state: ServeState, prompt: Prompt, params: SamplingParams, meta: dict[str, Any], usage: bool
) -> AsyncIterator[str]:
    pending: list[TokenLogprobs] = []  # log-probabilities of tokens whose text has not been sent yet

    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        logprobs = None
        if params.logprobs is not None and (pending or finish is None):
            logprobs = {"content": chat_entries(state.pieces, pending), "refusal": None}
            pending.clear()
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        return _sse({**meta, "object": "chat.completion.chunk", "choices": [choice]})

    items = parsed(state.batcher, prompt, params)
    first = await items.__anext__()  # submitted: a refusal is raised before anything is sent
    yield chunk({"role": "assistant", "content": ""})
    async for item in chain(first, items):
        if isinstance(item, TokenLogprobs):
            pending.append(item)
        elif isinstance(item, TextDelta):
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


@router.post(COMPLETIONS_PATH)
async def completions(request: Request) -> Any:
    state: ServeState = request.app.state.serve
    body = await read_json(request, state.config.max_body_bytes)
    fields.COMPLETIONS.check(body)
    prompt = get(body, "prompt", (str, list))
    params = sampling(body, state, 16, requested_completion_logprobs(body))
    model = state.served_model(get(body, "model", str, default=None))
    stream_it = get(body, "stream", bool, default=False)
    usage = bool(get(body, "stream_options", dict, default={}).get("include_usage"))
    if isinstance(prompt, list):
        ids = token_ids(prompt, state.vocab_size())
    else:
        ids = await encode(state, prompt)
    if not ids:
        raise bad("prompt", "empty prompt")
    meta = {"id": f"cmpl-{secrets.token_hex(12)}", "created": int(time.time()), "model": model}
    if stream_it:
        events = _text_stream(state, ids, params, meta, usage)
        return await event_stream(events, COMPLETIONS_PATH)
    return JSONResponse(await unless_disconnected(request, _text_completion(state, ids, params, meta)))


async def _text_completion(
    state: ServeState, ids: list[int], params: SamplingParams, meta: dict[str, Any]
) -> dict[str, Any]:
    text, finish, stats, logprobs = "", "stop", None, []
    async for event in stream(state.batcher, ids, params):
        text += event.text
        if event.logprobs is not None:
            logprobs.append(event.logprobs)
        if event.finished:
            finish, stats = event.finish_reason or "stop", event.stats
    assert stats is not None
    lp = completion_logprobs(state.pieces, logprobs) if params.logprobs is not None else None
    choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": lp}
    return {**meta, "object": "text_completion", "choices": [choice], "usage": _stats_usage(ids, stats)}


async def _text_stream(
    state: ServeState, ids: list[int], params: SamplingParams, meta: dict[str, Any], usage: bool
) -> AsyncIterator[str]:
    offset = 0
    async for event in stream(state.batcher, ids, params):
        lp = None
        if params.logprobs is not None:
            items = [] if event.logprobs is None else [event.logprobs]
            lp = completion_logprobs(state.pieces, items, offset)
        offset += len(event.text)
        choice = {"index": 0, "text": event.text, "finish_reason": event.finish_reason, "logprobs": lp}
        yield _sse({**meta, "object": "text_completion", "choices": [choice]})
        if event.finished and usage and event.stats is not None:
            usage_doc = _stats_usage(ids, event.stats)
            yield _sse({**meta, "object": "text_completion", "choices": [], "usage": usage_doc})
    yield "data: [DONE]\n\n"
