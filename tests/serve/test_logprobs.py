"""logprobs / top_logprobs against the model's own distribution, streamed and not, on both OpenAI APIs."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from conftest import API_KEY, Server, http

HEADERS = {"authorization": f"Bearer {API_KEY}"}
PROMPT = [11, 42, 97, 5, 300, 8]


def reference(server: Server, ids: list[int], steps: int) -> list[torch.Tensor]:
    """Log-softmax of each greedy step's logits, computed directly on the engine (the oracle)."""
    engine = server.state.batcher.engine._engine  # the real engine under the scripted wrapper
    seq = engine.new_sequence()
    out = []
    logits = engine.prefill(seq, list(ids))[-1]
    for _ in range(steps):
        logp = torch.log_softmax(logits.float(), -1)
        out.append(logp)
        logits = engine.decode_batch([seq], [int(logp.argmax())])[-1]
    return out


def sse(text: str) -> list[dict[str, Any]]:
    lines = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


@pytest.mark.parametrize("streamed", [False, True])
def test_completions_logprobs_match_the_model(server: Server, streamed: bool) -> None:
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logprobs": 3, "ignore_eos": True}
    code, doc = http("POST", f"{server.url}/v1/completions", {**body, "stream": streamed}, HEADERS)
    assert code == 200, doc
    if streamed:
        parts = [c["choices"][0]["logprobs"] for c in sse(doc) if c["choices"]]
        logprobs = {k: [v for p in parts for v in p[k]] for k in ("token_logprobs", "top_logprobs", "tokens")}
    else:
        logprobs = doc["choices"][0]["logprobs"]
    expected = reference(server, PROMPT, 3)
    assert len(logprobs["token_logprobs"]) == 3
    for step, logp in enumerate(expected):
        assert logprobs["token_logprobs"][step] == pytest.approx(float(logp.max()), abs=1e-4)
        top = sorted(logprobs["top_logprobs"][step].values(), reverse=True)
        assert top == pytest.approx(logp.topk(3).values.tolist(), abs=1e-4)


@pytest.mark.parametrize("streamed", [False, True])
def test_chat_logprobs_cover_every_token_once(server: Server, streamed: bool) -> None:
    body = {
        "messages": [{"role": "user", "content": "count"}],
        "max_tokens": 5,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "ignore_eos": True,
        "stream": streamed,
    }
    code, doc = http("POST", f"{server.url}/v1/chat/completions", body, HEADERS)
    assert code == 200, doc
    if streamed:
        chunks = [c["choices"][0] for c in sse(doc) if c["choices"]]
        entries = [e for c in chunks if c["logprobs"] for e in c["logprobs"]["content"]]
    else:
        entries = doc["choices"][0]["logprobs"]["content"]
    assert len(entries) == 5
    for entry in entries:
        assert len(entry["top_logprobs"]) == 2
        best = entry["top_logprobs"][0]
        assert entry["logprob"] == pytest.approx(best["logprob"], abs=1e-5)  # greedy: the top token
        assert bytes(entry["bytes"]).decode("utf-8", "replace") == entry["token"] or entry[
            "token"
        ].startswith("bytes:")


def test_no_logprobs_unless_asked(server: Server) -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    doc = http("POST", f"{server.url}/v1/chat/completions", body, HEADERS)[1]
    assert doc["choices"][0]["logprobs"] is None
