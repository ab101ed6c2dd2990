"""Requests run through the engine's scheduler together (shared by the decode tests)."""

from __future__ import annotations

from typing import Any

from freetoken.runtime.engine import Engine
from freetoken.runtime.kv.prefix_cache import PrefixCache
from freetoken.runtime.sampling import SamplingParams
from freetoken.runtime.scheduler import Scheduler

# prompts of different lengths, for batches of up to 8 sequences
PROMPTS = [
    [5, 77, 301, 12],
    [9, 250, 33, 401, 18, 2, 64],
    [111],
    [3] * 20,
    [8, 9],
    [60, 61, 62],
    [7] * 11,
    [400],
]


def greedy(engine: Engine, prompts: list[list[int]], tokens: int = 12) -> list[list[int]]:
    """Greedy tokens of `prompts` decoded together through the scheduler."""
    engine.reserve_slots(len(prompts))
    scheduler = Scheduler(engine, PrefixCache(0), max_running=len(prompts))
    out: list[list[Any]] = [[] for _ in prompts]
    for i, prompt in enumerate(prompts):
        scheduler.add(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True), out[i].append)
    while scheduler.has_work():
        scheduler.step()
    for events in out:
        assert not any(isinstance(e, Exception) for e in events), events
    return [[e.token_id for e in events] for events in out]
