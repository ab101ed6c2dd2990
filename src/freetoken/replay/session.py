"""Replay an agent session (one chat request per turn) and measure how much of each prompt is re-prefilled.

Session file (JSONL): one request per line, ``{"messages": [...], "tools": [...], "max_tokens": n}``;
"tools" is left out when there are none, and a line may also carry "chat_template_kwargs".

Per turn the replay reports `TurnReport`: the prompt's tokens, those whose KV was reused (`cached`),
those computed again (`reprefilled` = prompt - cached), and `new_tokens`: what an append-only harness
would have had to prefill at this turn. That is the previous request's messages, as they were sent,
followed by the messages this request appends (those past the previous request's message count k),
rendered and compared with the previous prompt + the previous reply: the tokens beyond their longest
common prefix. For an append-only harness (`none`) this request *is* that one, so `new_tokens` is the
prompt beyond its common prefix with the previous prompt + reply and equals `reprefilled`; for a harness
that edits its history, `reprefilled - new_tokens` is what those edits cost (negative when edits shrink
text that had to be recomputed anyway). When the first k messages do not line up with the previous
request (other roles, fewer messages), the request itself is compared instead.

What the chat template itself renders differently counts as new, with every harness: a template that
shows reasoning only after the last user message drops it from earlier turns once a new user message
arrives. The replies are generated (greedy), so the requests' fixed assistant turns never match them:
each turn's assistant message is new text, as is the tool output.

Edge cases where `reprefilled` exceeds `new_tokens` by one with no edit: the engine always computes at
least the prompt's last token, and never holds the KV of the reply's last token (sampled, not fed);
neither happens unless a request repeats the previous prompt or reply in full.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from freetoken.errors import FreeTokenError

if TYPE_CHECKING:
    from freetoken.runtime.engine import Engine

DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class TurnReport:
    turn: int
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV was reused
    reprefilled_tokens: int  # prompt_tokens - cached_tokens: computed again
    new_tokens: int  # what an append-only harness would prefill (module docstring); -1: unknown (server)
    ttft_s: float
    decode_tok_s: float
    # the prompt past its longest common prefix with what the engine holds (the previous prompt and reply):
    # the least any cache can re-prefill; -1: unknown (server)
    suffix_tokens: int = -1


def write_session(
    path: Path | str,
    requests: list[list[dict[str, Any]]],
    tools: list[dict[str, Any]] | None,
    max_tokens: int,
) -> None:
    """Write one JSONL line per request: its messages, the tools (when any) and max_tokens."""
    path = Path(path)
    lines = []
    for messages in requests:
        doc: dict[str, Any] = {"messages": messages}
        if tools is not None:
            doc["tools"] = tools
        doc["max_tokens"] = max_tokens
        lines.append(json.dumps(doc, ensure_ascii=False))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    except OSError as exc:
        raise FreeTokenError(f"cannot write session {path}: {exc.strerror}") from exc


def read_session(path: Path | str) -> list[dict[str, Any]]:
    """The requests of a session file; a bad line is a one-line FreeTokenError naming file and line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise FreeTokenError(f"cannot read session {path}: {reason}") from exc
    requests = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            doc = json.loads(line)
        except json.JSONDecodeError as exc:
            raise FreeTokenError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(doc, dict):
            raise FreeTokenError(f"{where}: expected a JSON object, got {type(doc).__name__}")
        messages = doc.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise FreeTokenError(f'{where}: missing "messages" (a non-empty list of message objects)')
        if doc.get("tools") is not None and not isinstance(doc["tools"], list):
            raise FreeTokenError(f'{where}: "tools" must be a list')
        limit = doc.get("max_tokens", DEFAULT_MAX_TOKENS)
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise FreeTokenError(f'{where}: "max_tokens" must be an integer >= 1, got {limit!r}')
        if not isinstance(doc.get("chat_template_kwargs", {}), dict):
            raise FreeTokenError(f'{where}: "chat_template_kwargs" must be an object')
        requests.append(doc)
    if not requests:
        raise FreeTokenError(f"session {path} holds no requests")
    return requests


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _render(engine: Engine, messages: list[dict[str, Any]], request: dict[str, Any]) -> list[int]:
    """Prompt ids exactly as `engine.chat` makes them."""
    kwargs = request.get("chat_template_kwargs") or {}
    text = engine.tokenizer.apply_chat_template(
        messages, tools=request.get("tools") or None, add_generation_prompt=True, **kwargs
    )
    return engine.tokenizer.encode(text)


def _same_roles(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    return [m.get("role") for m in a] == [m.get("role") for m in b]


def replay_in_process(engine: Engine, requests: list[dict[str, Any]], seed: int = 0) -> list[TurnReport]:
    """Run the requests in order on `engine` (its cache reset first): greedy, with ignore_eos so each
    reply has its request's max_tokens tokens."""
    from freetoken.runtime.sampling import SamplingParams

    engine.reset()
    reports: list[TurnReport] = []
    prev: dict[str, Any] | None = None
    prev_ids: list[int] = []
    prev_out: list[int] = []
    for turn, request in enumerate(requests):
        messages = request["messages"]
        ids = _render(engine, messages, request)
        suffix = len(ids) - min(_common_prefix(ids, prev_ids + prev_out[:-1]), len(ids) - 1)
        if prev is None:
            new = len(ids)
        else:
            k = len(prev["messages"])
            appended = ids
            if len(messages) >= k and _same_roles(messages[:k], prev["messages"]):
                appended = _render(engine, prev["messages"] + messages[k:], request)
            new = len(appended) - _common_prefix(appended, prev_ids + prev_out)
        limit = int(request.get("max_tokens", DEFAULT_MAX_TOKENS))
        params = SamplingParams(temperature=0.0, seed=seed, max_tokens=limit, ignore_eos=True)
        events = list(engine.generate(ids, params))
        stats = events[-1].stats
        assert stats is not None  # the final event always has stats
        reports.append(
            TurnReport(
                turn=turn,
                prompt_tokens=stats.prompt_tokens,
                cached_tokens=stats.cached_tokens,
                reprefilled_tokens=stats.prompt_tokens - stats.cached_tokens,
                new_tokens=new,
                ttft_s=stats.ttft_s,
                decode_tok_s=stats.decode_tok_s,
                suffix_tokens=suffix,
            )
        )
        prev, prev_ids = request, ids
        prev_out = [e.token_id for e in events if e.token_id is not None]
    return reports


def _chat_url(base_url: str) -> str:
    base = base_url.rstrip("/")
    return f"{base}/chat/completions" if base.endswith("/v1") else f"{base}/v1/chat/completions"


def _stream_turn(url: str, body: dict[str, Any], headers: dict[str, str], turn: int) -> TurnReport:
    data = json.dumps(body, ensure_ascii=False).encode()
    req = urllib.request.Request(url, data=data, method="POST", headers=headers)
    usage: dict[str, Any] | None = None
    t_first = t_any = t_last = None
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=600) as resp:
            for raw in resp:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(payload)
                t_any = t_any or now
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
                        t_first = t_first or now
                        t_last = now
                    if choice.get("finish_reason"):
                        t_last = now
    except urllib.error.HTTPError as exc:
        detail = " ".join(exc.read().decode("utf-8", "replace").split())[:300]
        raise FreeTokenError(f"turn {turn}: {url} answered HTTP {exc.code}: {detail}") from None
    except urllib.error.URLError as exc:
        raise FreeTokenError(f"turn {turn}: cannot reach {url}: {exc.reason}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise FreeTokenError(f"turn {turn}: {url} streamed a chunk that is not JSON: {exc}") from None
    if usage is None:
        raise FreeTokenError(f"turn {turn}: {url} sent no usage (stream_options.include_usage unsupported?)")
    prompt = int(usage.get("prompt_tokens", 0))
    completion = int(usage.get("completion_tokens", 0))
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    first = t_first or t_any or time.perf_counter()
    stream_s = (t_last or first) - first
    return TurnReport(
        turn=turn,
        prompt_tokens=prompt,
        cached_tokens=cached,
        reprefilled_tokens=prompt - cached,
        new_tokens=-1,
        ttft_s=first - t0,
        decode_tok_s=max(completion - 1, 0) / stream_s if stream_s > 0 else 0.0,
    )


def replay_against_server(
    base_url: str, requests: list[dict[str, Any]], api_key: str | None = None, model: str = "default"
) -> list[TurnReport]:
    """Send the requests in order to an OpenAI-compatible server (`base_url`, with or without /v1) as
    streamed chat completions: greedy, ignore_eos, usage included.

    `ttft_s` runs from sending the request to the first content, reasoning or tool-call delta (the first
    chunk if none has any); `decode_tok_s` is (completion tokens - 1) over the time from that delta to the
    last one, as the engine counts it. `new_tokens` is -1: the client has no tokenizer to compute it with.
    The server's own cache decides `cached_tokens` (it may hold more than the previous request).
    """
    url = _chat_url(base_url)
    headers = {"content-type": "application/json", "accept": "text/event-stream"}
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    reports = []
    for turn, request in enumerate(requests):
        body: dict[str, Any] = {
            "model": model,
            "messages": request["messages"],
            "max_tokens": int(request.get("max_tokens", DEFAULT_MAX_TOKENS)),
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if request.get("tools"):
            body["tools"] = request["tools"]
        if request.get("chat_template_kwargs"):
            body["chat_template_kwargs"] = request["chat_template_kwargs"]
        reports.append(_stream_turn(url, body, headers, turn))
    return reports
