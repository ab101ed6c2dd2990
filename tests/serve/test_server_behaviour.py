"""Concurrency, prefix reuse, disconnects, bad inputs and metrics on a live server."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from http.client import HTTPConnection
from typing import Any
from urllib.parse import urlparse

import pytest

from conftest import API_KEY, Server, http
from freetoken.runtime.batcher import Overloaded
from freetoken.runtime.sampling import SamplingParams

HEADERS = {"authorization": f"Bearer {API_KEY}"}


def _ask(openai_client: Any, i: int) -> str:
    chunks = openai_client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": f"Question number {i}: " + "why " * i}],
        max_tokens=16,
        temperature=0,
        stream=True,
    )
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_eight_concurrent_streams_equal_each_alone(openai_client: Any, server: Server) -> None:
    steps_before = server.stats()["decode"]["steps"]
    rows_before = server.state.batcher.stats.batched_rows
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda i: _ask(openai_client, i), range(8)))
    stats = server.stats()
    steps = stats["decode"]["steps"] - steps_before
    rows = server.state.batcher.stats.batched_rows - rows_before
    assert rows / steps > 1.5  # sequences really decoded together (at most 4 at once, the rest queued)
    server.state.batcher.prefix.clear()  # alone = computed from scratch, no reused KV
    alone = [_ask(openai_client, i) for i in range(8)]
    assert together == alone
    assert len(set(together)) > 1


def test_shared_prefix_is_cached_and_first_token_comes_sooner(server: Server) -> None:
    engine = server.state.batcher.engine
    long_prompt = [(13 * i + 5) % 600 + 20 for i in range(900)]

    def ttft(ids: list[int]) -> tuple[float, int]:
        done: list[Any] = []
        server.state.batcher.submit(ids, SamplingParams(max_tokens=2, ignore_eos=True), done.append)
        while not (done and getattr(done[-1], "finished", True)):
            time.sleep(0.001)
        stats = done[-1].stats
        return stats.ttft_s, stats.cached_tokens

    assert engine.max_seq_len > 1000
    cold, cached_cold = ttft(long_prompt)
    warm, cached_warm = ttft([*long_prompt, 7, 8, 9])
    assert cached_cold == 0 and cached_warm >= 900
    assert warm < cold


def test_disconnect_mid_stream_frees_the_sequence(server: Server) -> None:
    cancelled = server.state.batcher.stats.cancelled
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Tell a long story"}],
        "max_tokens": 900,
        "stream": True,
        "ignore_eos": True,
    }
    url = urlparse(server.url)
    conn = HTTPConnection(url.hostname, url.port, timeout=30)
    conn.request(
        "POST", "/v1/chat/completions", json.dumps(body), {**HEADERS, "content-type": "application/json"}
    )
    response = conn.getresponse()
    assert response.status == 200
    for _ in range(6):
        response.readline()
    conn.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 10
    while server.state.batcher.stats.cancelled == cancelled or server.state.batcher.running:
        assert time.monotonic() < deadline, "the abandoned request kept running"
        time.sleep(0.01)
    assert server.stats()["requests"]["running"] == 0


LONG = "word " * 2000  # over the tiny model's 1024-token context
CHAT = "/v1/chat/completions"
MSGS = "/v1/messages"
OK_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
OK_MSGS = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BAD = [
    ("malformed json", CHAT, b"{nope", HEADERS, 400, "body"),
    ("not an object", CHAT, b"[1, 2]", HEADERS, 400, "body"),
    ("no messages", CHAT, {"model": "tiny"}, HEADERS, 400, "messages"),
    ("bad role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, HEADERS, 400, "messages[0].role"),
    ("temperature", CHAT, {**OK_CHAT, "temperature": 7}, HEADERS, 400, "temperature"),
    ("max_tokens type", CHAT, {**OK_CHAT, "max_tokens": "many"}, HEADERS, 400, "max_tokens"),
    ("n > 1", CHAT, {**OK_CHAT, "n": 3}, HEADERS, 400, "n"),
    ("bad tool", CHAT, {**OK_CHAT, "tools": [{"type": "function"}]}, HEADERS, 400, "tools[0]"),
    ("context", CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": LONG}]}, HEADERS, 400, "context"),
    ("no key", CHAT, OK_CHAT, {}, 401, "API key"),
    ("wrong key", CHAT, OK_CHAT, {"authorization": "Bearer nope"}, 401, "API key"),
    ("too large", CHAT, {**OK_CHAT, "pad": "x" * (300 << 10)}, HEADERS, 413, "limit"),
    (
        "anthropic max_tokens",
        MSGS,
        {"model": "tiny", "messages": OK_MSGS["messages"]},
        HEADERS,
        400,
        "max_tokens",
    ),
    (
        "anthropic block",
        MSGS,
        {**OK_MSGS, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
        HEADERS,
        400,
        "messages[0].content[0].type",
    ),
    ("anthropic key", MSGS, OK_MSGS, {"x-api-key": "nope"}, 401, "API key"),
    ("completions prompt", "/v1/completions", {"model": "tiny", "prompt": [1, "x"]}, HEADERS, 400, "prompt"),
]


@pytest.mark.parametrize(
    ("path", "body", "headers", "status", "names"), [b[1:] for b in BAD], ids=[b[0] for b in BAD]
)
def test_bad_inputs_get_their_4xx(
    server: Server, path: str, body: Any, headers: dict, status: int, names: str
) -> None:
    code, doc = http("POST", f"{server.url}{path}", body, headers)
    assert code == status, doc
    if path.startswith(MSGS):
        assert doc["type"] == "error" and names in doc["error"]["message"]
    else:
        assert names in doc["error"]["message"] and doc["error"]["type"]
    assert http("GET", f"{server.url}/health")[1]["status"] == "ok"


def test_context_error_names_both_lengths(server: Server) -> None:
    body = {**OK_CHAT, "messages": [{"role": "user", "content": LONG}]}
    message = http("POST", f"{server.url}{CHAT}", body, HEADERS)[1]["error"]["message"]
    assert "1024" in message and "prompt of" in message


def test_overload_is_429(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(*args: Any, **kwargs: Any) -> int:
        raise Overloaded("64 requests already queued")

    monkeypatch.setattr(server.state.batcher, "submit", full)
    code, doc = http("POST", f"{server.url}{CHAT}", OK_CHAT, HEADERS)
    assert code == 429 and doc["error"]["type"] == "rate_limit_error"
    code, doc = http("POST", f"{server.url}{MSGS}", {**OK_MSGS, "stream": True}, HEADERS)
    assert code == 429 and doc["error"]["type"] == "rate_limit_error"


def test_metrics_and_stats(server: Server, openai_client: Any) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    openai_client.chat.completions.create(model="tiny", messages=OK_CHAT["messages"], max_tokens=3)
    assert http("GET", f"{server.url}/metrics")[0] == 401  # the key guards metrics too
    text = http("GET", f"{server.url}/metrics", headers=HEADERS)[1]
    families = {f.name: f for f in text_string_to_metric_families(text)}
    kinds = {
        "freetoken_tokens_generated_per_s": "gauge",
        "freetoken_ttft_seconds_mean": "gauge",
        "freetoken_requests_queued": "gauge",
        "freetoken_requests_running": "gauge",
        "freetoken_requests_finished": "counter",
        "freetoken_tokens_generated": "counter",
        "freetoken_experts_hits": "counter",
        "freetoken_experts_misses": "counter",
        "freetoken_experts_fills_per_layer_step": "gauge",
        "freetoken_experts_slots_occupied": "gauge",
        "freetoken_memory_expert_pool_bytes": "gauge",
        "freetoken_prefix_cache_hit_tokens": "counter",
    }
    for name, kind in kinds.items():
        assert families[name].type == kind, name
    assert families["freetoken_requests_finished"].samples[0].name == "freetoken_requests_finished_total"
    assert families["freetoken_requests_finished"].samples[0].value >= 1
    stats = server.stats()
    assert stats["requests"]["finished"] >= 1 and stats["tokens"]["generated"] >= 3
    assert stats["experts"]["pool_dtypes"] and stats["memory"]["expert_pool_bytes"] > 0
