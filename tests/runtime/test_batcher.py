"""The batcher's queue limit and per-request failure isolation (no HTTP)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from freetoken.runtime.batcher import Batcher, Overloaded
from freetoken.runtime.engine import build_engine
from freetoken.runtime.sampling import SamplingParams
from freetoken.runtime.sequence import TokenEvent

PARAMS = SamplingParams(max_tokens=5, ignore_eos=True)


def test_full_queue_raises_overloaded(tiny_model: tuple[Path, Any]) -> None:
    engine = build_engine(tiny_model[0], device="cpu", dtype="float32", moe_backend="fused")
    batcher = Batcher(engine, max_running=1, max_queued=2)  # not started: nothing drains the queue
    batcher.submit([1, 2], PARAMS, lambda ev: None)
    batcher.submit([1, 2], PARAMS, lambda ev: None)
    with pytest.raises(Overloaded):
        batcher.submit([1, 2], PARAMS, lambda ev: None)
    assert batcher.stats.rejected == 1 and batcher.queued == 2


def test_a_failing_request_fails_alone(tiny_model: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    engine = build_engine(tiny_model[0], device="cpu", dtype="float32", moe_backend="fused")
    real_prefill = engine.prefill

    def prefill(seq: Any, ids: list[int]) -> Any:
        if ids[0] == 666:
            raise RuntimeError("boom")
        return real_prefill(seq, ids)

    monkeypatch.setattr(engine, "prefill", prefill)
    batcher = Batcher(engine, max_running=4)
    results: dict[int, list[Any]] = {0: [], 1: [], 2: []}
    done = threading.Semaphore(0)

    def collect(key: int) -> Any:
        def on_event(event: TokenEvent | Exception) -> None:
            results[key].append(event)
            if isinstance(event, Exception) or event.finished:
                done.release()

        return on_event

    batcher.start()
    try:
        for key, prompt in ((0, [5, 6, 7]), (1, [666, 1]), (2, [8, 9])):
            batcher.submit(prompt, PARAMS, collect(key))
        for _ in range(3):
            assert done.acquire(timeout=30)
    finally:
        batcher.stop()
    assert isinstance(results[1][-1], RuntimeError)
    for key in (0, 2):
        assert [e.finished for e in results[key]] == [False] * 4 + [True]
    assert batcher.stats.failed == 1 and batcher.running == 0


def test_the_server_shapes_the_engines_one_scheduler(tiny_model: tuple[Path, Any]) -> None:
    """`serve` runs the engine's own scheduler (its batch size and prefix cache set for serving), not a
    second one beside it; reshaping it with requests in flight is refused."""
    from freetoken.errors import FreeTokenError

    engine = build_engine(tiny_model[0], device="cpu", dtype="float32", moe_backend="fused")
    assert len(list(engine.generate([1, 2, 3], PARAMS))) == 5  # the verbs count on the same scheduler
    batcher = Batcher(engine, max_running=3, prefix_cache_tokens=1024)
    assert batcher.scheduler is engine.scheduler
    assert engine.scheduler.max_running == 3 and engine.kv_pool.slots >= 3
    assert batcher.stats.submitted == 0  # the server's counters start at zero
    batcher.submit([1, 2], PARAMS, lambda ev: None)
    with pytest.raises(FreeTokenError, match="in flight"):
        Batcher(engine, max_running=2)
