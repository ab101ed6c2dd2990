"""Between the HTTP handlers and the batcher: prompts in, parsed output events out.

`stream` submits a request and yields the batcher's token events as they come (the batcher calls back
on its own thread; the events cross into the event loop with call_soon_threadsafe). Leaving the
iteration early — a client that disconnected — cancels the request, which frees its sequence.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import StreamingResponse

from freetoken.errors import FreeTokenError
from freetoken.runtime.batcher import Batcher, Overloaded, Unavailable
from freetoken.runtime.logprobs import TokenLogprobs
from freetoken.runtime.sampling import NonFiniteLogits, SamplingParams
from freetoken.runtime.sequence import TokenEvent
from freetoken.serve import harmony_parser
from freetoken.serve.errors import ApiError, sse_guard
from freetoken.serve.output_parser import Event, OutputParser, ToolCallDelta
from freetoken.serve.state import ServeState

T = TypeVar("T")
DISCONNECT_POLL_S = 0.2


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    in_reasoning: bool  # the template opened a <think> block the model continues
    tools: bool
    harmony: bool = False  # the template ends in harmony's `<|start|>assistant` (gpt-oss): its parser


async def chat_prompt(
    state: ServeState, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, **kwargs: Any
) -> Prompt:
    """The rendered, tokenized prompt; refused first by the cheap context bound, then rendered and
    tokenized on a worker thread (a long prompt must not hold up the event loop).

    The bound counts only what every chat template renders whole: the content of the system, user and
    tool messages (a template may trim earlier assistant turns, e.g. drop their reasoning)."""
    rendered = [m for m in messages if m.get("role") != "assistant"]
    state.check_fits(text_bytes([m.get("content") for m in rendered]), len(rendered))
    return await run_in_threadpool(render_chat, state.batcher, messages, tools, **kwargs)


async def encode(state: ServeState, text: str) -> list[int]:
    state.check_fits(len(text.encode("utf-8")))
    return await run_in_threadpool(state.batcher.engine.tokenizer.encode, text)


def text_bytes(doc: Any) -> int:
    """UTF-8 bytes of all the strings in a JSON-like document."""
    total, stack = 0, [doc]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            total += len(value) if value.isascii() else len(value.encode("utf-8"))
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return total


def render_chat(
    batcher: Batcher, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, **kwargs: Any
) -> Prompt:
    tokenizer = batcher.engine.tokenizer
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=True, **kwargs
        )
    except FreeTokenError as exc:
        raise ApiError(400, str(exc), param="messages") from None
    except Exception as exc:  # a template that raises on these messages
        raise ApiError(400, f"the chat template cannot render these messages: {exc}", "messages") from None
    in_reasoning = text.rstrip().endswith("<think>")
    harmony = text.rstrip().endswith(harmony_parser.GENERATION_PROMPT)
    return Prompt(tokenizer.encode(text), in_reasoning, bool(tools), harmony)


async def stream(
    batcher: Batcher, prompt_ids: list[int], params: SamplingParams
) -> AsyncIterator[TokenEvent]:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[TokenEvent | Exception] = asyncio.Queue()
    try:
        request_id = batcher.submit(
            prompt_ids, params, lambda ev: loop.call_soon_threadsafe(queue.put_nowait, ev)
        )
    except Overloaded as exc:
        raise ApiError(429, f"server busy: {exc}; retry later") from None
    except Unavailable as exc:
        raise ApiError(503, f"unavailable: {exc}") from None
    except FreeTokenError as exc:
        raise ApiError(400, str(exc), param="messages") from None
    finished = False
    try:
        while True:
            event = await queue.get()
            if isinstance(event, Exception):
                finished = True
                raise failure(event)
            finished = event.finished
            yield event
            if finished:
                return
    finally:
        if not finished:
            batcher.cancel(request_id)


def failure(exc: Exception) -> ApiError:
    """The error a request that failed inside the engine answers with."""
    if isinstance(exc, Unavailable):
        return ApiError(503, f"unavailable: {exc}")
    if isinstance(exc, NonFiniteLogits):
        return ApiError(500, f"model error: {exc}")
    return ApiError(500, f"generation failed: {type(exc).__name__}: {exc}")


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and so the generation under it, which frees its sequence) as soon as
    the client disconnects; then 499."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ApiError(499, "client disconnected")
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def event_stream(events: AsyncIterator[str], path: str) -> StreamingResponse:
    """An SSE response started before answering, so a request refused at submission (400, 429, 503) is
    still an HTTP error rather than a broken stream; later failures end it with an error event."""
    first = await events.__anext__()
    return StreamingResponse(sse_guard(path, chain(first, events)), media_type="text/event-stream")


async def chain(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """`first` (already taken from `rest`, to start a stream before answering), then the rest."""
    yield first
    async for item in rest:
        yield item


@dataclass
class Outcome:
    """Everything one generation produced, once it is over."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str = "stop"  # stop | length | tool_calls
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


async def parsed(
    batcher: Batcher, prompt: Prompt, params: SamplingParams, reasoning: bool = True
) -> AsyncIterator[Event | TokenLogprobs | Outcome]:
    """Parsed output events as they come, each token's log-probabilities (when asked for) before the
    events its text produced, then one Outcome."""
    parser: OutputParser | harmony_parser.HarmonyParser = (
        harmony_parser.HarmonyParser(reasoning=reasoning, tools=prompt.tools)
        if prompt.harmony
        else OutputParser(reasoning=reasoning, tools=prompt.tools, starts_in_reasoning=prompt.in_reasoning)
    )
    outcome = Outcome(prompt_tokens=len(prompt.ids))
    async for event in stream(batcher, prompt.ids, params):
        if event.logprobs is not None:
            outcome.logprobs.append(event.logprobs)
            yield event.logprobs
        for item in parser.push(event.text):
            yield item
        if event.finished:
            for item in parser.flush():
                yield item
            assert event.stats is not None
            outcome.cached_tokens = event.stats.cached_tokens
            outcome.completion_tokens = event.stats.completion_tokens
            outcome.finish_reason = event.finish_reason or "stop"
    outcome.content, outcome.reasoning, outcome.tool_calls = (
        parser.content,
        parser.reasoning,
        parser.tool_calls,
    )
    if outcome.tool_calls and outcome.finish_reason == "stop":
        outcome.finish_reason = "tool_calls"
    yield outcome


async def complete(
    batcher: Batcher, prompt: Prompt, params: SamplingParams, reasoning: bool = True
) -> Outcome:
    result = Outcome()
    async for item in parsed(batcher, prompt, params, reasoning):
        if isinstance(item, Outcome):
            result = item
    return result
