"""Continuous batching: one engine loop on its own thread, serving many requests.

Each turn of the loop: drop cancelled requests; admit queued ones up to `max_running` (each prefills
alone, its KV first loaded from the prefix cache as far as it matches); then one decode step for every
running request together (`Engine.decode_batch`: the experts see the whole batch, so an expert two
sequences want is read once). Requests join and leave at these step boundaries. A finished or
cancelled request's KV goes into the prefix cache, then its sequence is dropped. On a hybrid model the
cache also takes the sequence's recurrent-state checkpoints (its anchors, plus one at its end, where an
append-only follow-up resumes), and a request resumes from the deepest one within its cached prefix.

Events go to each request's callback, on the loop's thread. A request that fails (a bad prompt, an
error inside the engine or the sampler, detokenising, stop matching) gets the exception as its last event
and frees its sequence; the loop itself carries on. Should the loop itself fail (a defect outside any one
request) or stall past `watchdog_s` while work waits, `health()` says why, every queued and running
request fails with `Unavailable`, and new submissions are refused until it recovers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from freetoken.errors import FreeTokenError
from freetoken.replay.trace import DECODE, PREFILL
from freetoken.runtime.engine import Engine, reuses_kv_prefixes
from freetoken.runtime.kv.prefix_cache import PrefixCache
from freetoken.runtime.request import Request, accept_token, new_request, sample
from freetoken.runtime.sampling import SamplingParams
from freetoken.runtime.sequence import TokenEvent

Callback = Callable[[TokenEvent | Exception], None]
log = logging.getLogger("freetoken.batcher")


class Overloaded(FreeTokenError):
    """The queue is full: the caller should answer 429."""


class Unavailable(FreeTokenError):
    """The engine cannot serve now (its loop died or stalled, or the server is shutting down): 503."""


@dataclass
class BatcherStats:
    submitted: int = 0
    finished: int = 0
    cancelled: int = 0
    rejected: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    decode_steps: int = 0
    batched_rows: int = 0  # sum of batch sizes over decode steps
    ttft_s_sum: float = 0.0
    ttft_count: int = 0


class Batcher:
    def __init__(
        self,
        engine: Engine,
        max_running: int = 4,
        max_queued: int = 64,
        prefix_cache_tokens: int = 65536,
        prefix_checkpoints: int | None = None,
        watchdog_s: float | None = 600.0,
    ) -> None:
        """`prefix_checkpoints`: recurrent-state checkpoints the prefix cache holds (hybrid models);
        default `state_checkpoints` × max(4, `max_running`), as many conversations' worth.
        `watchdog_s`: this long without a finished loop turn or forward pass while work waits counts as
        a stall (None: never)."""
        self.engine = engine
        self.max_running, self.max_queued = max_running, max_queued
        self.watchdog_s = watchdog_s
        if prefix_checkpoints is None:
            hybrid = not reuses_kv_prefixes(engine)
            prefix_checkpoints = engine.engine_config.state_checkpoints * max(4, max_running) if hybrid else 0
        self.prefix = PrefixCache(prefix_cache_tokens, prefix_checkpoints)
        self.stats = BatcherStats()
        self.started_at = time.monotonic()
        self._cond = threading.Condition()
        self._queue: deque[tuple[Request, Callback]] = deque()
        self._running: list[tuple[Request, Callback]] = []
        self._admitting: list[tuple[Request, Callback]] = []  # taken from the queue, prefilling this turn
        self._cancelled: set[int] = set()
        self._next_id = 0
        self._stop = False
        self._thread: threading.Thread | None = None
        self._watchdog: threading.Thread | None = None
        self._beat = time.monotonic()  # when the loop last finished a turn (or went idle)
        self._died: str | None = None  # why the loop ended, when it did so by failing
        self._refusing: str | None = None  # why new requests are refused (shutting down)
        self._stalled = False
        self._stopping = threading.Event()  # wakes the watchdog at stop()

    # -- called from any thread ------------------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], params: SamplingParams, on_event: Callback) -> int:
        engine = self.engine
        unhealthy = self._refusing or self.health()
        if unhealthy:
            raise Unavailable(unhealthy)
        if not prompt_ids:
            raise FreeTokenError("empty prompt")
        if len(prompt_ids) >= engine.max_seq_len:
            raise FreeTokenError(
                f"prompt of {len(prompt_ids)} tokens leaves no room in the context of {engine.max_seq_len}"
            )
        with self._cond:
            if len(self._queue) >= self.max_queued:
                self.stats.rejected += 1
                raise Overloaded(f"{len(self._queue)} requests already queued")
            request = new_request(self._next_id, prompt_ids, params, engine.tokenizer, engine.stop_ids)
            self._next_id += 1
            self._queue.append((request, on_event))
            self.stats.submitted += 1
            self._cond.notify()
        return request.id

    def cancel(self, request_id: int) -> None:
        with self._cond:
            self._cancelled.add(request_id)
            self._cond.notify()

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        return len(self._running)

    def start(self) -> None:
        self._beat = time.monotonic()
        self._thread = threading.Thread(target=self._run_loop, name="freetoken-batcher", daemon=True)
        self._thread.start()
        if self.watchdog_s is not None:
            self._watchdog = threading.Thread(target=self._watch, name="freetoken-watchdog", daemon=True)
            self._watchdog.start()

    def stop(self, timeout: float | None = None) -> None:
        """End the loop after its current turn; wait at most `timeout` seconds for it (None: no limit)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._stopping.set()
        for thread in (self._thread, self._watchdog):
            if thread is not None:
                thread.join(timeout)

    def health(self) -> str | None:
        """None while the loop serves; else why it cannot (died, or stalled while work waits)."""
        if self._died is not None:
            return self._died
        if self._thread is not None and not self._thread.is_alive() and not self._stop:
            return "engine loop is not running"
        stalled = self._stall_s()
        if stalled is not None:
            return f"engine loop stalled for {stalled:.0f} s with work waiting"
        return None

    def refuse_new(self, reason: str) -> None:
        """Stop admitting: later submissions raise Unavailable(reason); running requests go on."""
        self._refusing = reason

    def fail_all(self, reason: str) -> int:
        """Fail every queued and running request with Unavailable(reason) now (from any thread); the loop
        drops them at its next turn. Returns how many were failed."""
        error = Unavailable(reason)
        with self._cond:
            queued, self._queue = list(self._queue), deque()
            running = [*self._admitting, *self._running]
            self._cancelled.update(request.id for request, _ in running)
            self.stats.failed += len(queued) + len(running)
            self._cond.notify()
        for _, on_event in [*queued, *running]:
            _notify(on_event, error)
        return len(queued) + len(running)

    def _stall_s(self) -> float | None:
        if self.watchdog_s is None or not (self._queue or self._running or self._admitting):
            return None
        # progress is a finished loop turn or a finished forward pass (a long prompt prefills in chunks)
        last = max(self._beat, getattr(self.engine, "heartbeat", self._beat))
        late = time.monotonic() - last
        return late if late > self.watchdog_s else None

    def _watch(self) -> None:
        period = min(1.0, self.watchdog_s / 4) if self.watchdog_s else 1.0
        while not self._stopping.wait(period):
            stalled = self._stall_s()
            if stalled is not None and not self._stalled:
                self._stalled = True
                reason = f"engine loop stalled for {stalled:.0f} s"
                log.error("%s: failing %d request(s)", reason, self.fail_all(reason))
            elif stalled is None:
                self._stalled = False

    # -- the loop's thread -----------------------------------------------------------------------------------

    def _run_loop(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # a defect outside any one request: say so and fail everyone
            self._died = f"engine loop died: {type(exc).__name__}: {exc}"
            log.exception(self._died)
            self.fail_all(self._died)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._beat = time.monotonic()
                while not self._stop and not self._queue and not self._running and not self._cancelled:
                    self._cond.wait()
                    self._beat = time.monotonic()
                if self._stop:
                    return
                cancelled, self._cancelled = self._cancelled, set()
                self._queue = deque(item for item in self._queue if item[0].id not in cancelled)
                room = self.max_running - len(self._running) + len(cancelled & self._running_ids())
                admitted = [self._queue.popleft() for _ in range(min(room, len(self._queue)))]
                self._admitting = list(admitted)
            for item in [item for item in self._running if item[0].id in cancelled]:
                self._running.remove(item)
                self.stats.cancelled += 1
                self._guarded(item, lambda request, _: self._retire(request))
            for item in admitted:
                self._guarded(item, self._prefill)
            with self._cond:
                self._admitting = []
            if self._running:
                self._decode_step()

    def _running_ids(self) -> set[int]:
        return {request.id for request, _ in self._running}

    def _guarded(self, item: tuple[Request, Callback], step: Callable[[Request, Callback], None]) -> None:
        try:
            step(*item)
        except Exception as exc:  # the request fails; the loop and the other requests go on
            self.stats.failed += 1
            if item in self._running:
                self._running.remove(item)
            item[0].seq = None
            _notify(item[1], exc)

    def _prefill(self, request: Request, on_event: Callback) -> None:
        engine = self.engine
        request.t_start = time.perf_counter()
        seq = request.seq = engine.new_sequence()
        prompt = request.prompt_ids
        cached = self.prefix.load(prompt, seq.kv, limit=len(prompt) - 1)  # one token left to compute
        seq.token_ids = list(prompt[:cached])
        request.cached_tokens = cached
        engine.routing_context(PREFILL, [request.id])
        logits = engine.prefill(seq, prompt[cached:])
        self.stats.prompt_tokens += len(prompt)
        self.stats.cached_tokens += cached
        self._running.append((request, on_event))  # first: a failure while emitting removes it again
        self._emit(request, on_event, logits[-1], first=True)

    def _decode_step(self) -> None:
        batch = list(self._running)
        seqs = [request.seq for request, _ in batch]
        tokens = [request.next_token for request, _ in batch]
        self.engine.routing_context(DECODE, [request.id for request, _ in batch])
        try:
            logits = self.engine.decode_batch(seqs, tokens)  # type: ignore[arg-type]
        except Exception:  # find who: step each alone, so one bad sequence fails only itself
            for item in batch:
                self._guarded(item, self._decode_alone)
            return
        self.stats.decode_steps += 1
        self.stats.batched_rows += len(batch)
        for i, item in enumerate(batch):
            self._guarded(item, lambda request, on_event, row=logits[i]: self._emit(request, on_event, row))

    def _decode_alone(self, request: Request, on_event: Callback) -> None:
        assert request.seq is not None and request.next_token is not None
        self.engine.routing_context(DECODE, [request.id])
        logits = self.engine.decode_batch([request.seq], [request.next_token])
        self._emit(request, on_event, logits[-1])

    def _emit(self, request: Request, on_event: Callback, logits: torch.Tensor, first: bool = False) -> None:
        """Sample from last-position logits [V], stream the event; a finished request leaves the batch."""
        assert request.seq is not None
        token, logprobs = sample(request, logits)
        room = request.seq.kv.length + 1 < self.engine.max_seq_len
        event = accept_token(request, token, first, room, logprobs)
        self.stats.generated_tokens += 1
        if first:
            self.stats.ttft_s_sum += request.t_first - request.t_start
            self.stats.ttft_count += 1
        if event.finished:
            self.stats.finished += 1
            if (request, on_event) in self._running:
                self._running.remove((request, on_event))
            self._retire(request)
        on_event(event)

    def _retire(self, request: Request) -> None:
        """Keep what the sequence computed for later requests sharing its prefix; free the sequence."""
        seq, request.seq = request.seq, None
        if seq is None or not seq.token_ids:
            return
        store = seq.checkpoints
        if store is not None and store.policy != "none":  # the state at its end: where a follow-up resumes
            store.save(seq.kv.length, "end", seq.kv.linear)  # type: ignore[attr-defined]
        self.prefix.insert(seq.token_ids, seq.kv, store.saved if store is not None else None)


def _notify(on_event: Callback, event: TokenEvent | Exception) -> None:
    """Deliver a failure; a consumer already gone (its event loop closed) is no reason to fail more."""
    try:
        on_event(event)
    except Exception:
        log.debug("request callback failed", exc_info=True)
