"""Hostile requests at the live server: no 5xx, every 4xx in the protocol's error schema, streams end.

The requests come from hostile/ (valid and malformed bodies of every endpoint, wrong types, methods,
paths and content types). Seeded and bounded: the same examples every run, about a minute on two cores.
"""

from __future__ import annotations

import json
import time
from urllib.parse import urlsplit

from hostile import MINIMAL, HostileRequest, hostile_requests, send, verdict
from hypothesis import HealthCheck, given, settings

from conftest import API_KEY, Server, http

# About 50 s on two cores, most of it in the few requests whose huge max_tokens is accepted and clamped
# to the context (a thousand tokens each); everything else answers in milliseconds.
MAX_EXAMPLES = 1800


@settings(
    max_examples=MAX_EXAMPLES,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)
@given(hostile=hostile_requests())
def test_hostile_requests_get_a_protocol_answer(server: Server, hostile: HostileRequest) -> None:
    url = urlsplit(server.url)
    answer = send(hostile, url.hostname or "127.0.0.1", url.port or 80, API_KEY)
    problem = verdict(hostile, answer)
    assert problem is None, problem


def test_server_still_answers_after_the_fuzz(server: Server) -> None:
    status, doc = http(
        "POST",
        f"{server.url}/v1/chat/completions",
        MINIMAL["/v1/chat/completions"],
        headers={"authorization": f"Bearer {API_KEY}"},
    )
    assert status == 200, doc
    assert doc["choices"][0]["finish_reason"] in ("stop", "length")
    deadline = time.monotonic() + 10
    while True:  # nothing the fuzz sent is still running or queued
        status, health = http("GET", f"{server.url}/health")
        assert status == 200 and health["status"] == "ok", json.dumps(health)
        if health["running"] == 0 and health["queued"] == 0:
            break
        assert time.monotonic() < deadline, f"requests left behind: {health}"
        time.sleep(0.05)
