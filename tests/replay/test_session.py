"""Agent-session replay: harness edit patterns, session files, and re-prefill measured on the engine."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from freetoken.errors import FreeTokenError
from freetoken.replay.harness import EDITS, omitted_note, requests_for, synthetic_session, tool_schemas
from freetoken.replay.session import (
    TurnReport,
    read_session,
    replay_against_server,
    replay_in_process,
    write_session,
)
from freetoken.runtime.engine import Engine, build_engine
from freetoken.runtime.sampling import SamplingParams

TURNS, WINDOW, MAX_TOKENS = 8, 2, 4
# The tiny model's context is 1024 tokens and the demo tokenizer splits words finely: short outputs.
SESSION = synthetic_session(TURNS, seed=0, output_tokens=8)


def assistants(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m for m in messages if m["role"] == "assistant"]


def outputs(messages: list[dict[str, Any]]) -> list[str]:
    return [m["content"] for m in messages if m["role"] == "tool"]


def as_requests(edit: str) -> list[dict[str, Any]]:
    return [{"messages": m, "max_tokens": MAX_TOKENS} for m in requests_for(SESSION, edit, window=WINDOW)]


# -- sessions and harness edits ------------------------------------------------------------------------------


def test_synthetic_session_is_reproducible_and_shaped() -> None:
    assert synthetic_session(TURNS, seed=0, output_tokens=8) == SESSION
    assert synthetic_session(TURNS, seed=1, output_tokens=8) != SESSION
    assert len(SESSION) == TURNS and SESSION[0].user is not None
    assert any(turn.user is not None for turn in SESSION[1:]) and any(t.user is None for t in SESSION)
    long = synthetic_session(3, seed=0, output_tokens=60)
    for turn in long:
        lines = turn.tool_output.splitlines()
        assert len(lines) == 8  # 60 words, eight to a line
        assert sum(len(line.split()) - 1 for line in lines) == 60  # each line also has its "n:" number
        assert turn.reasoning and turn.tool_name in {t["function"]["name"] for t in tool_schemas()}


def test_request_layout() -> None:
    first, *_, last = requests_for(SESSION, "none")
    assert [m["role"] for m in first] == ["system", "user"] and first[1]["content"] == SESSION[0].user
    assert len(assistants(last)) == TURNS - 1
    for i, (msg, turn) in enumerate(zip(assistants(last), SESSION, strict=False)):
        (call,) = msg["tool_calls"]
        assert msg["content"] == "" and msg["reasoning_content"] == turn.reasoning
        assert call["id"] == f"call_{i}" and call["type"] == "function"
        assert call["function"]["name"] == turn.tool_name
        assert json.loads(call["function"]["arguments"]) == turn.tool_args
    tools = [m for m in last if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tools] == [f"call_{i}" for i in range(TURNS - 1)]
    users = [m["content"] for m in last if m["role"] == "user"]
    assert users == [t.user for t in SESSION if t.user is not None]  # the last turn's user, if any, ends it


@pytest.mark.parametrize("edit", EDITS)
def test_requests_grow_turn_by_turn(edit: str) -> None:
    requests = requests_for(SESSION, edit, window=WINDOW)
    assert len(requests) == TURNS
    for t, messages in enumerate(requests):
        assert len(assistants(messages)) == t and len(outputs(messages)) == t
        if t:
            assert len(messages) > len(requests[t - 1])
        ends_with_user = SESSION[t].user is not None
        assert (messages[-1]["role"] == "user") == ends_with_user


def test_none_extends_the_previous_request() -> None:
    requests = requests_for(SESSION, "none")
    for t in range(1, TURNS):
        assert requests[t][: len(requests[t - 1])] == requests[t - 1]
    assert outputs(requests[-1]) == [turn.tool_output for turn in SESSION[:-1]]


def test_openclaw_keeps_reasoning_of_the_latest_turn_only() -> None:
    requests = requests_for(SESSION, "openclaw", window=WINDOW)
    for t, messages in enumerate(requests):
        reasoning = [m["reasoning_content"] for m in assistants(messages)]
        assert reasoning == ([""] * (t - 1) + [SESSION[t - 1].reasoning] if t else [])
        assert outputs(messages) == [turn.tool_output for turn in SESSION[:t]]
    # Not append-only: the previous latest turn loses its reasoning.
    assert requests[3][: len(requests[2])] != requests[2]


def test_opencode_replaces_outputs_older_than_the_window() -> None:
    requests = requests_for(SESSION, "opencode", window=WINDOW, placeholder="[gone]")
    for t, messages in enumerate(requests):
        old = max(t - WINDOW, 0)
        expected = ["[gone]"] * old + [turn.tool_output for turn in SESSION[old:t]]
        assert outputs(messages) == expected
        assert [m["reasoning_content"] for m in assistants(messages)] == [s.reasoning for s in SESSION[:t]]


def test_swe_agent_keeps_the_last_observations() -> None:
    requests = requests_for(SESSION, "swe-agent", window=WINDOW)
    for t, messages in enumerate(requests):
        kept = [o for o, turn in zip(outputs(messages), SESSION, strict=False) if o == turn.tool_output]
        assert len(kept) == min(t, WINDOW)
        old = max(t - WINDOW, 0)
        assert outputs(messages)[:old] == [omitted_note(turn.tool_output) for turn in SESSION[:old]]
        assert outputs(messages)[old:] == [turn.tool_output for turn in SESSION[old:t]]
    note = omitted_note("a\nb\nc")
    assert note == "Old environment output: (3 lines omitted)" and "\n" not in note


def test_bad_harness_arguments() -> None:
    with pytest.raises(FreeTokenError, match="unknown harness edit 'aider'"):
        requests_for(SESSION, "aider")
    with pytest.raises(FreeTokenError, match="window"):
        requests_for(SESSION, "opencode", window=-1)


# -- session files -------------------------------------------------------------------------------------------


def test_write_read_round_trip(tmp_path: Path) -> None:
    requests = requests_for(SESSION, "opencode", window=WINDOW)
    path = tmp_path / "sub" / "session.jsonl"
    write_session(path, requests, tool_schemas(), max_tokens=7)
    assert len(path.read_text(encoding="utf-8").splitlines()) == TURNS
    docs = read_session(path)
    assert [d["messages"] for d in docs] == requests
    assert all(d["tools"] == tool_schemas() and d["max_tokens"] == 7 for d in docs)
    write_session(path, requests[:2], None, max_tokens=3)
    assert [sorted(d) for d in read_session(path)] == [["max_tokens", "messages"]] * 2


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"messages": [', "not valid JSON"),
        ('{"tools": []}', 'missing "messages"'),
        ('{"messages": []}', 'missing "messages"'),
        ("[1, 2]", "expected a JSON object"),
        ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}', "max_tokens"),
    ],
)
def test_read_session_names_the_bad_line(tmp_path: Path, bad_line: str, message: str) -> None:
    path = tmp_path / "s.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    path.write_text(f"{good}\n\n{bad_line}\n{good}\n", encoding="utf-8")
    with pytest.raises(FreeTokenError) as err:
        read_session(path)
    text = str(err.value)
    assert f"{path}:3:" in text and message in text and "\n" not in text


def test_read_session_missing_or_empty(tmp_path: Path) -> None:
    with pytest.raises(FreeTokenError, match="cannot read session"):
        read_session(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n", encoding="utf-8")
    with pytest.raises(FreeTokenError, match="no requests"):
        read_session(tmp_path / "empty.jsonl")


# -- replay on the engine ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_model: tuple[Path, Any]) -> Engine:
    return build_engine(tiny_model[0], device="cpu", dtype="float32", moe_backend="fused")


@pytest.fixture(scope="module")
def replays(engine: Engine) -> dict[str, list[TurnReport]]:
    return {edit: replay_in_process(engine, as_requests(edit)) for edit in EDITS}


def test_replay_prompts_are_the_chat_prompts(engine: Engine, replays: dict[str, list[TurnReport]]) -> None:
    tok = engine.tokenizer
    for edit, reports in replays.items():
        requests = requests_for(SESSION, edit, window=WINDOW)
        assert [r.turn for r in reports] == list(range(TURNS))
        rendered = [len(tok.encode(tok.apply_chat_template(m))) for m in requests]
        assert [r.prompt_tokens for r in reports] == rendered
        assert all(r.ttft_s > 0 and r.decode_tok_s > 0 for r in reports)
    with_tools = [{**r, "tools": tool_schemas()} for r in as_requests("none")[:2]]
    reports = replay_in_process(engine, with_tools)
    rendered = tok.apply_chat_template(with_tools[0]["messages"], tools=tool_schemas())
    assert reports[0].prompt_tokens == len(tok.encode(rendered)) > replays["none"][0].prompt_tokens


def test_append_only_reprefills_only_new_tokens(replays: dict[str, list[TurnReport]]) -> None:
    reports = replays["none"]
    assert reports[0].cached_tokens == 0 and reports[0].new_tokens == reports[0].prompt_tokens
    for r in reports:
        assert r.reprefilled_tokens == r.prompt_tokens - r.cached_tokens
        assert r.reprefilled_tokens == r.new_tokens  # exactly: the engine reuses every shared token
        assert r.cached_tokens > 0 or r.turn == 0
    assert all(r.cached_tokens > 0 for r in reports[1:])


@pytest.mark.parametrize("edit", ["openclaw", "opencode", "swe-agent"])
def test_history_edits_force_reprefill(replays: dict[str, list[TurnReport]], edit: str) -> None:
    reports, plain = replays[edit], replays["none"]
    # Every harness appends the same turn; without a new user message (which makes the template re-render
    # earlier turns, differently for each harness's history) append-only would prefill the same tokens.
    quiet = [t for t in range(1, TURNS) if SESSION[t].user is None]
    assert [reports[t].new_tokens for t in quiet] == [plain[t].new_tokens for t in quiet]
    assert any(r.reprefilled_tokens > r.new_tokens for r in reports)
    extra = sum(r.reprefilled_tokens - r.new_tokens for r in reports)
    assert extra > 50


def test_a_reply_sent_back_counts_as_seen(engine: Engine) -> None:
    """A request that repeats the previous reply reuses its KV; new_tokens counts the reply as seen, so
    it is one below reprefilled: the reply's last token was sampled but never fed, so it has no KV."""
    first = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello! How are you today?"},
    ]
    engine.reset()
    reply = [e.token_id for e in engine.chat(first, SamplingParams(max_tokens=4, ignore_eos=True))]
    text = engine.tokenizer.decode(reply)
    assert engine.tokenizer.encode(text) == reply  # the reply re-tokenizes to itself
    second = [*first, {"role": "assistant", "content": text}, {"role": "user", "content": "And then?"}]
    a, b = replay_in_process(
        engine, [{"messages": first, "max_tokens": 4}, {"messages": second, "max_tokens": 4}]
    )
    assert b.cached_tokens == a.prompt_tokens + len(reply) - 1
    assert b.new_tokens == b.reprefilled_tokens - 1


# -- replay against a server ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server_url(tiny_model: tuple[Path, Any]) -> Iterator[str]:
    import uvicorn

    from freetoken.runtime.batcher import Batcher
    from freetoken.serve.app import create_app
    from freetoken.serve.state import ServeConfig, ServeState

    served = build_engine(tiny_model[0], device="cpu", dtype="float32", moe_backend="fused")
    batcher = Batcher(served, max_running=2, max_queued=8, prefix_cache_tokens=8192)
    state = ServeState(batcher, ("tiny",), ServeConfig(api_key="k"))
    batcher.start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not uv.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    uv.should_exit = True
    thread.join(timeout=10)
    batcher.stop()


def test_replay_against_server_matches_in_process(
    server_url: str, replays: dict[str, list[TurnReport]]
) -> None:
    reports = replay_against_server(f"{server_url}/v1", as_requests("opencode"), api_key="k", model="tiny")
    local = replays["opencode"]
    assert [r.prompt_tokens for r in reports] == [r.prompt_tokens for r in local]
    assert all(r.new_tokens == -1 and r.ttft_s > 0 and r.decode_tok_s > 0 for r in reports)
    assert reports[0].cached_tokens == 0 and all(r.cached_tokens > 0 for r in reports[1:])
    # The server's prefix cache holds every earlier request, so it reuses at least what the engine does.
    assert all(s.cached_tokens >= e.cached_tokens for s, e in zip(reports, local, strict=True))


def test_replay_against_server_errors(server_url: str) -> None:
    with pytest.raises(FreeTokenError, match="HTTP 401"):
        replay_against_server(server_url, as_requests("none")[:1], api_key="wrong")
    with pytest.raises(FreeTokenError, match="cannot reach"):
        replay_against_server("http://127.0.0.1:9", as_requests("none")[:1])
