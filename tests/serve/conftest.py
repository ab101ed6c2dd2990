"""A real uvicorn server on 127.0.0.1 over a tiny model, for the SDK-driven tests.

`ScriptedEngine` wraps the real engine and forces the output tokens of prompts that contain a marker
(a random-weight model never writes a tool call or a think block by itself), or NaN logits for `[nan]`
(a broken checkpoint); everything else — the
batcher, the template, the tokenizer, the parser, the HTTP layers — is the real path.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import uvicorn

from freetoken.runtime.batcher import Batcher
from freetoken.runtime.engine import Engine, build_engine
from freetoken.runtime.request import Request, Sampled, sample_each
from freetoken.runtime.sequence import Sequence
from freetoken.serve.app import create_app
from freetoken.serve.state import ServeConfig, ServeState

API_KEY = "test-key"
SCRIPTS = {
    "[tool]": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "[think]": "<think>\nFirst add, then check.\n</think>\n\nIt is 4.",
    "[both]": '<think>\nNeed the weather.\n</think>\n\nLet me look.\n<tool_call>\n{"name": "get_weather", '
    '"arguments": {"city": "Oslo"}}\n</tool_call>',
    "[bad-tool]": "<tool_call>\n{not json}\n</tool_call>",
}


POISON: list[int] = []


class ScriptedEngine:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.prompts: list[str] = []
        eos = sorted(engine.stop_ids)[0]
        self._scripts = {m: [*engine.tokenizer.encode(t), eos] for m, t in SCRIPTS.items()}
        self._state: dict[int, list[Any]] = {}  # id(seq) of a live sequence -> [script tokens, next index]
        engine.scheduler.engine = self  # the engine's one scheduler drives the scripted passes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def _force(self, seq: Sequence, row: torch.Tensor) -> torch.Tensor:
        state = self._state.get(id(seq))
        if state is None:
            return row
        if state[0] is POISON:
            return torch.full_like(row, float("nan"))
        tokens, i = state
        state[1] += 1
        forced = torch.full_like(row, -1e9)
        forced[..., tokens[min(i, len(tokens) - 1)]] = 0.0
        return forced

    def prefill(self, seq: Sequence, ids: list[int]) -> torch.Tensor:
        logits = self._engine.prefill(seq, ids)
        self._state.pop(id(seq), None)  # ids of dead sequences are reused: never inherit a script
        text = self._engine.tokenizer.decode(seq.token_ids)
        self.prompts.append(text)
        latest = text.split("<|im_start|>user")[-1]  # the markers of the latest user turn
        for marker, tokens in self._scripts.items():
            if marker in latest:
                self._state[id(seq)] = [tokens, 0]
        if "[nan]" in latest:  # a broken checkpoint: every logit NaN
            self._state[id(seq)] = [POISON, 0]
        return self._force(seq, logits[-1:])

    def decode_batch(self, seqs: list[Sequence], ids: list[int]) -> torch.Tensor:
        logits = self._engine.decode_batch(seqs, ids)
        return torch.stack([self._force(seq, logits[i]) for i, seq in enumerate(seqs)])

    def decode_tokens(self, requests: list[Request]) -> list[Sampled | Exception]:
        """The scheduler's decode step, eager, over the forced logits."""
        logits = self.decode_batch([r.seq for r in requests], [r.next_token for r in requests])  # type: ignore[misc]
        return sample_each(requests, logits)


@dataclass
class Server:
    url: str
    state: ServeState
    scripted: ScriptedEngine

    def stats(self) -> dict[str, Any]:
        return http("GET", f"{self.url}/v1/stats", headers={"x-api-key": API_KEY})[1]


def http(method: str, url: str, body: Any = None, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """(status, parsed JSON or text) of one plain request; `body` bytes go as they are, else as JSON."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    for key, value in (headers or {}).items():
        req.add_header(key, value)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_app(state: ServeState) -> Iterator[str]:
    """uvicorn serving `state` on a free loopback port, on a thread; yields its base URL."""
    port = _free_port()
    config = uvicorn.Config(create_app(state), host="127.0.0.1", port=port, log_level="warning")
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not uv.started:
        if time.monotonic() > deadline:
            raise RuntimeError("server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="session")
def server(tiny_model: tuple[Path, Any]) -> Iterator[Server]:
    engine = build_engine(tiny_model[0], device="cpu", dtype="float32", moe_backend="fused")
    scripted = ScriptedEngine(engine)
    batcher = Batcher(scripted, max_running=4, max_queued=64, prefix_cache_tokens=8192)  # type: ignore[arg-type]
    state = ServeState(batcher, ("tiny",), ServeConfig(api_key=API_KEY, max_body_bytes=256 << 10))
    batcher.start()
    with running_app(state) as url:
        yield Server(url, state, scripted)
    batcher.stop()


@pytest.fixture
def openai_client(server: Server) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture
def anthropic_client(server: Server) -> Any:
    import anthropic

    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)
