"""The batcher under failure: a request whose sampling fails, a loop that dies, a loop that stalls,
and the server's shutdown (refuse new work, fail what is left)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from freetoken.runtime.batcher import Batcher, Unavailable
from freetoken.runtime.decode_graph import StepOutput
from freetoken.runtime.engine import Engine, build_engine
from freetoken.runtime.sampling import NonFiniteLogits, SamplingParams
from freetoken.runtime.sequence import TokenEvent

LONG = SamplingParams(max_tokens=200, ignore_eos=True)


class Collector:
    """Events of one request; `done` once it finished or failed."""

    def __init__(self) -> None:
        self.events: list[TokenEvent | Exception] = []
        self.done = threading.Event()

    def __call__(self, event: TokenEvent | Exception) -> None:
        self.events.append(event)
        if isinstance(event, Exception) or event.finished:
            self.done.set()

    @property
    def error(self) -> Exception | None:
        last = self.events[-1] if self.events else None
        return last if isinstance(last, Exception) else None


@pytest.fixture
def engine(tiny_model: tuple[Path, Any]) -> Engine:
    return build_engine(tiny_model[0], device="cpu", dtype="float32", moe_backend="fused")


def wrap(owner: Any, name: str, hook: Callable[..., Any]) -> None:
    """Route owner.<name> (the engine's or its runner's) through hook(real, *args) (an instance attribute:
    the class is untouched)."""
    real = getattr(owner, name)
    setattr(owner, name, lambda *args: hook(real, *args))


def test_sampling_failure_fails_that_request_alone(engine: Engine) -> None:
    def decode(real: Any, seqs: list[Any], ids: list[int], mode: str) -> StepOutput:
        out = real(seqs, ids, mode)
        bad = [seq.token_ids[:3] == [1, 2, 3] for seq in seqs]  # request a's row turns bad mid-generation
        if not any(bad):
            return out
        logits = out.logits.clone()
        logits[torch.tensor(bad)] = float("nan")
        finite = None if out.finite is None else [f and not b for f, b in zip(out.finite, bad, strict=True)]
        return StepOutput(logits, out.tokens, finite)  # as the device reports a row with NaN logits

    wrap(engine.runner, "slot_step", decode)
    batcher = Batcher(engine, max_running=4)
    a, b = Collector(), Collector()
    batcher.submit([1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.7), a)
    batcher.submit([4, 5, 6], SamplingParams(max_tokens=6, ignore_eos=True), b)
    batcher.start()
    try:
        assert a.done.wait(30) and b.done.wait(30)
        assert isinstance(a.error, NonFiniteLogits)
        assert b.error is None and len(b.events) == 6  # b, decoded in the same batches, finished
        assert batcher.health() is None and batcher.stats.failed == 1
        c = Collector()
        wrap(engine.runner, "slot_step", lambda real, *args: real(*args))
        batcher.submit([7, 8], SamplingParams(max_tokens=3, ignore_eos=True), c)
        assert c.done.wait(30) and c.error is None
    finally:
        batcher.stop()


def test_a_dead_loop_fails_everything_and_says_why(engine: Engine) -> None:
    batcher = Batcher(engine, max_running=1)

    batcher.scheduler._decode_step = lambda batch: (_ for _ in ()).throw(SystemError("bookkeeping defect"))  # type: ignore[method-assign]
    running, queued = Collector(), Collector()
    batcher.submit([1, 2, 3], LONG, running)
    batcher.submit([1, 2, 3], LONG, queued)
    batcher.start()
    assert running.done.wait(30) and queued.done.wait(30)
    assert isinstance(running.error, Unavailable) and isinstance(queued.error, Unavailable)
    reason = batcher.health()
    assert reason is not None and "bookkeeping defect" in reason
    with pytest.raises(Unavailable):
        batcher.submit([1], LONG, Collector())
    batcher.stop()


def test_a_stalled_loop_fails_its_work_and_recovers(engine: Engine) -> None:
    release = threading.Event()

    def slow_prefill(real: Any, seq: Any, ids: list[int]) -> torch.Tensor:
        release.wait(20)
        return real(seq, ids)

    wrap(engine, "prefill", slow_prefill)
    batcher = Batcher(engine, max_running=1, watchdog_s=0.3)
    stuck, waiting = Collector(), Collector()
    batcher.submit([1, 2], LONG, stuck)
    batcher.submit([3, 4], LONG, waiting)
    batcher.start()
    try:
        assert waiting.done.wait(5) and isinstance(waiting.error, Unavailable)
        assert stuck.done.wait(5) and isinstance(stuck.error, Unavailable)
        assert "stalled" in (batcher.health() or "")
        with pytest.raises(Unavailable):
            batcher.submit([1], LONG, Collector())
        release.set()
        deadline = time.monotonic() + 10
        while batcher.health() is not None:
            assert time.monotonic() < deadline, "the loop did not recover"
            time.sleep(0.05)
        after = Collector()
        batcher.submit([5, 6], SamplingParams(max_tokens=2, ignore_eos=True), after)
        assert after.done.wait(30) and after.error is None
    finally:
        release.set()
        batcher.stop()


def test_refuse_new_then_fail_all(engine: Engine) -> None:
    batcher = Batcher(engine, max_running=1)
    running, queued = Collector(), Collector()
    batcher.submit([1, 2, 3], LONG, running)
    batcher.submit([1, 2, 3], LONG, queued)
    batcher.start()
    try:
        deadline = time.monotonic() + 10
        while not batcher.running:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        batcher.refuse_new("shutting down")
        with pytest.raises(Unavailable, match="shutting down"):
            batcher.submit([1], LONG, Collector())
        assert batcher.fail_all("time is up") == 2
        assert running.done.wait(5) and queued.done.wait(5)
        assert str(running.error) == "time is up" and str(queued.error) == "time is up"
        deadline = time.monotonic() + 5
        while batcher.running:  # the loop drops the failed request at its next turn
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        batcher.stop(timeout=5)
