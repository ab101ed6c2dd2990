"""The one scheduler: continuous batching over the engine, thread-free. `run` is a batch of one over it;
`serve`'s Batcher is a thread, a lock and a watchdog around it.

A turn (`step`, or `schedule` then `run`): drop cancelled requests; admit queued ones up to
`max_running`, each prefilling alone after its KV is loaded from the prefix cache as far as it matches
(the prefill gives its first token); then one decode step for the requests that were already running,
all together (`Engine.decode_tokens`: the experts see the whole batch, so an expert two sequences want
is read once). Requests join and leave at these turn boundaries; with one request, a turn is one
forward pass. A finished or cancelled request's KV goes into the prefix cache, then its sequence is
released. On a hybrid model the cache also takes the sequence's recurrent-state checkpoints (its
anchors, plus one at its end, where an append-only follow-up resumes), and a request resumes from the
deepest one within its cached prefix; so a conversation's next turn prefills only what is new.

Events go to each request's callback as they come. A request that fails (an error inside the engine or
the sampler, detokenising, stop matching, its callback) gets the exception as its last event and its
sequence is released uncached; the other requests go on. A turn cut short by an exception outside any
one request (an interrupt, a defect) propagates it; what was in flight is never cached afterwards.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from freetoken.errors import FreeTokenError
from freetoken.runtime.kv.prefix_cache import PrefixCache
from freetoken.runtime.kv.state_checkpoints import Checkpoint
from freetoken.runtime.request import Request, Sampled, accept_token, new_request
from freetoken.runtime.sampling import SamplingParams
from freetoken.runtime.sequence import DECODE, PREFILL, Sequence, TokenEvent

if TYPE_CHECKING:
    from freetoken.runtime.engine import Engine

Callback = Callable[[TokenEvent | Exception], None]
Entry = tuple[Request, Callback]
log = logging.getLogger("freetoken.scheduler")


@dataclass
class SchedulerStats:
    submitted: int = 0
    finished: int = 0
    cancelled: int = 0
    rejected: int = 0  # refused by the Batcher's queue limit
    failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    decode_steps: int = 0
    batched_rows: int = 0  # sum of batch sizes over decode steps
    ttft_s_sum: float = 0.0
    ttft_count: int = 0


@dataclass
class Turn:
    leaving: list[Entry]  # running requests cancelled since the last turn
    admitted: list[Entry]  # queued requests that prefill this turn


class Scheduler:
    def __init__(self, engine: Engine, prefix: PrefixCache, max_running: int = 1) -> None:
        self.engine, self.prefix, self.max_running = engine, prefix, max_running
        engine.reserve_slots(max_running)  # a KV slot per running request, before any runs
        self.stats = SchedulerStats()
        self.queue: deque[Entry] = deque()
        self.running: list[Entry] = []
        self.admitting: list[Entry] = []  # taken from the queue, prefilling this turn
        self.cancelled: set[int] = set()
        self._suspect: set[int] = set()  # requests in flight when a turn was cut short: never cached
        self._next_id = 0

    def configure(self, prefix: PrefixCache, max_running: int) -> None:
        """At a safe point (nothing queued or running): the prefix cache and batch size a server wants, its
        counters from zero. The engine keeps one scheduler; a server reshapes it rather than adding one."""
        if self.queue or self.running or self.admitting:
            raise FreeTokenError("the scheduler has requests in flight; configure it between them")
        self.prefix, self.max_running = prefix, max_running
        self.engine.reserve_slots(max_running)
        self.stats = SchedulerStats()

    def check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise FreeTokenError("empty prompt")
        size, limit = len(prompt_ids), self.engine.max_seq_len
        if size >= limit:
            raise FreeTokenError(f"prompt of {size} tokens leaves no room in the context of {limit}")

    def add(self, prompt_ids: list[int], params: SamplingParams, on_event: Callback) -> Request:
        """Queue a request; its events go to `on_event`."""
        self.check_prompt(prompt_ids)
        engine = self.engine
        request = new_request(self._next_id, prompt_ids, params, engine.tokenizer, engine.stop_ids)
        self._next_id += 1
        self.queue.append((request, on_event))
        self.stats.submitted += 1
        return request

    def cancel(self, request_id: int) -> None:
        """Drop a request at the next turn (its KV stays reusable as a prefix)."""
        self.cancelled.add(request_id)

    def has_work(self) -> bool:
        return bool(self.queue or self.running or self.cancelled)

    def step(self) -> None:
        self.run(self.schedule())

    def schedule(self) -> Turn:
        """The bookkeeping half of a turn (cheap; the Batcher holds its lock over it)."""
        cancelled, self.cancelled = self.cancelled, set()
        self.queue = deque(entry for entry in self.queue if entry[0].id not in cancelled)
        leaving = [entry for entry in self.running if entry[0].id in cancelled]
        room = self.max_running - len(self.running) + len(leaving)
        admitted = [self.queue.popleft() for _ in range(min(room, len(self.queue)))]
        self.admitting = list(admitted)
        return Turn(leaving, admitted)

    def run(self, turn: Turn) -> None:
        """The passes of a turn: retire the leaving, prefill the admitted, one decode step for the others
        (a request joins the decode batch the turn after its prefill, which gave its first token)."""
        try:
            for entry in turn.leaving:
                self._leave(entry)
            batch = list(self.running)
            for entry in turn.admitted:
                self._guarded(entry, self._prefill)
            self.admitting = []
            if batch:
                self._decode_step(batch)
        except BaseException:  # cut short: a sequence in flight may be half-written
            self._suspect.update(request.id for request, _ in [*self.admitting, *self.running])
            raise
        self.engine.maybe_probe()

    def abort(self, request_id: int) -> None:
        """Drop a request now, wherever it is (callers without a loop thread)."""
        self.queue = deque(entry for entry in self.queue if entry[0].id != request_id)
        for entry in [entry for entry in [*self.admitting, *self.running] if entry[0].id == request_id]:
            self._leave(entry)

    # -- the turn's parts ------------------------------------------------------------------------------------

    def _leave(self, entry: Entry) -> None:
        for group in (self.admitting, self.running):
            if entry in group:
                group.remove(entry)
        self.stats.cancelled += 1
        self._guarded(entry, lambda item: self._retire(item[0]))

    def _guarded(self, entry: Entry, step: Callable[[Entry], None]) -> None:
        try:
            step(entry)
        except Exception as exc:  # the request fails; the others go on
            self.stats.failed += 1
            if entry in self.running:
                self.running.remove(entry)
            self._suspect.discard(entry[0].id)
            seq, entry[0].seq = entry[0].seq, None
            if seq is not None:
                seq.release()
            notify(entry[1], exc)

    def _prefill(self, entry: Entry) -> None:
        request, engine = entry[0], self.engine
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
        self.running.append(entry)  # first: a failure while emitting removes it again
        self._emit(entry, engine.sample_first(request, logits[-1]), first=True)

    def _decode_step(self, batch: list[Entry]) -> None:
        requests = [request for request, _ in batch]
        lengths = [request.seq.kv.length for request in requests]  # type: ignore[union-attr]
        self.engine.routing_context(DECODE, [request.id for request in requests])
        try:
            results = self.engine.decode_tokens(requests)
        except Exception as exc:  # find who: step each alone, so one bad sequence fails only itself
            for entry, length in zip(batch, lengths, strict=True):
                fed = len(batch) == 1 or entry[0].seq is None or entry[0].seq.kv.length != length
                self._guarded(entry, _raiser(exc) if fed else self._decode_alone)
            return
        self.stats.decode_steps += 1
        self.stats.batched_rows += len(batch)
        for entry, result in zip(batch, results, strict=True):
            self._guarded(entry, lambda item, result=result: self._emit(item, result))

    def _decode_alone(self, entry: Entry) -> None:
        self.engine.routing_context(DECODE, [entry[0].id])
        self._emit(entry, self.engine.decode_tokens([entry[0]])[0])

    def _emit(self, entry: Entry, result: Sampled | Exception, first: bool = False) -> None:
        """Accept a sampled token and stream its event; a finished request leaves the batch."""
        if isinstance(result, Exception):
            raise result
        request, on_event = entry
        assert request.seq is not None
        token, logprobs = result
        room = request.seq.kv.length + 1 < self.engine.max_seq_len
        event = accept_token(request, token, first, room, logprobs)
        self.stats.generated_tokens += 1
        if first:
            self.stats.ttft_s_sum += request.t_first - request.t_start
            self.stats.ttft_count += 1
        if event.finished:
            self.stats.finished += 1
            if entry in self.running:
                self.running.remove(entry)
            self._retire(request)
        on_event(event)

    def _retire(self, request: Request) -> None:
        """Keep what the sequence computed for later requests sharing its prefix; release the sequence."""
        seq, request.seq = request.seq, None
        if seq is None:
            return
        try:
            if seq.token_ids and request.id not in self._suspect:
                self.prefix.insert(seq.token_ids, seq.kv, _checkpoints(seq))
        finally:
            self._suspect.discard(request.id)
            seq.release()


def _checkpoints(seq: Sequence) -> dict[int, Checkpoint] | None:
    """A retiring sequence's recurrent-state checkpoints (hybrid models): those at its anchors, and the
    state at its end, where an append-only follow-up resumes (beside the anchors' budget)."""
    store = seq.checkpoints
    if store is None:
        return None
    saved = dict(store.saved)
    if store.budget > 0:
        states = seq.kv.linear  # type: ignore[attr-defined]
        saved[seq.kv.length] = Checkpoint(seq.kv.length, "end", {n: s.clone() for n, s in states.items()})
    return saved


def _raiser(exc: Exception) -> Callable[[Entry], None]:
    def fail(_: Entry) -> None:
        raise exc

    return fail


def notify(on_event: Callback, event: TokenEvent | Exception) -> None:
    """Deliver a failure; a consumer already gone (its event loop closed) is no reason to fail more."""
    try:
        on_event(event)
    except Exception:
        log.debug("request callback failed", exc_info=True)
