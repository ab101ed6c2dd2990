"""Continuous batching for the server: the engine's one Scheduler (runtime/scheduler.py), shaped for
serving (its batch size and prefix cache), on its own thread.

Submissions come from any thread; the loop's thread runs the scheduler's turns (admit, prefill, one
batched decode step; the prefix cache; per-request failures: see scheduler.py), holding the lock only
over each turn's bookkeeping, and sleeps on a condition variable while there is no work. Events go to
each request's callback, on the loop's thread.

Should the loop itself fail (a defect outside any one request) or stall past `watchdog_s` while work
waits, `health()` says why, every queued and running request fails with `Unavailable`, and new
submissions are refused until it recovers.
"""

from __future__ import annotations

import logging
import threading
import time

from freetoken.errors import FreeTokenError
from freetoken.runtime.engine import Engine, reuses_kv_prefixes
from freetoken.runtime.kv.prefix_cache import PrefixCache
from freetoken.runtime.sampling import SamplingParams
from freetoken.runtime.scheduler import Callback, Scheduler, SchedulerStats, notify

log = logging.getLogger("freetoken.batcher")


class Overloaded(FreeTokenError):
    """The queue is full: the caller should answer 429."""


class Unavailable(FreeTokenError):
    """The engine cannot serve now (its loop died or stalled, or the server is shutting down): 503."""


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
        self.scheduler: Scheduler = engine.scheduler  # the engine's one scheduler, shaped for serving
        self.scheduler.configure(PrefixCache(prefix_cache_tokens, prefix_checkpoints), max_running)
        self.started_at = time.monotonic()
        self._cond = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._watchdog: threading.Thread | None = None
        self._beat = time.monotonic()  # when the loop last finished a turn (or went idle)
        self._died: str | None = None  # why the loop ended, when it did so by failing
        self._refusing: str | None = None  # why new requests are refused (shutting down)
        self._stalled = False
        self._stopping = threading.Event()  # wakes the watchdog at stop()

    @property
    def prefix(self) -> PrefixCache:
        return self.scheduler.prefix

    @property
    def stats(self) -> SchedulerStats:
        return self.scheduler.stats

    # -- called from any thread ------------------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], params: SamplingParams, on_event: Callback) -> int:
        unhealthy = self._refusing or self.health()
        if unhealthy:
            raise Unavailable(unhealthy)
        self.scheduler.check_prompt(prompt_ids)  # a bad prompt is refused as such, even with a full queue
        with self._cond:
            if len(self.scheduler.queue) >= self.max_queued:
                self.stats.rejected += 1
                raise Overloaded(f"{len(self.scheduler.queue)} requests already queued")
            request = self.scheduler.add(prompt_ids, params, on_event)
            self._cond.notify()
        return request.id

    def cancel(self, request_id: int) -> None:
        with self._cond:
            self.scheduler.cancel(request_id)
            self._cond.notify()

    @property
    def queued(self) -> int:
        return len(self.scheduler.queue)

    @property
    def running(self) -> int:
        return len(self.scheduler.running)

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
        scheduler = self.scheduler
        with self._cond:
            queued = list(scheduler.queue)
            scheduler.queue.clear()
            # one that just finished prefilling may be in both lists for a moment
            both = [*scheduler.admitting, *scheduler.running]
            running = list({id(request): (request, on_event) for request, on_event in both}.values())
            for request, _ in running:
                scheduler.cancel(request.id)
            self.stats.failed += len(queued) + len(running)
            self._cond.notify()
        for _, on_event in [*queued, *running]:
            notify(on_event, error)
        return len(queued) + len(running)

    def _stall_s(self) -> float | None:
        s = self.scheduler
        if self.watchdog_s is None or not (s.queue or s.running or s.admitting):
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
        scheduler = self.scheduler
        while True:
            with self._cond:
                self._beat = time.monotonic()
                while not self._stop and not scheduler.has_work():
                    self._cond.wait()
                    self._beat = time.monotonic()
                if self._stop:
                    return
                turn = scheduler.schedule()
            scheduler.run(turn)
