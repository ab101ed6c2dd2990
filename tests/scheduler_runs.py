"""Requests run through the engine's scheduler together (shared by the decode tests)."""

from __future__ import annotations

from typing import Any

from freetoken.runtime.engine import Engine
from freetoken.runtime.kv.prefix_cache import PrefixCache
from freetoken.runtime.request import Request
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


def running_requests(engine: Engine, prompts: list[list[int]]) -> list[Request]:
    """`prompts` admitted together, prefilled and past their first decode steps (the graph captured)."""
    engine.reserve_slots(len(prompts))
    scheduler = Scheduler(engine, PrefixCache(0), max_running=len(prompts))
    for prompt in prompts:
        scheduler.add(prompt, SamplingParams(max_tokens=40, ignore_eos=True), lambda e: None)
    for _ in range(3):  # prefill, then the graph captured
        scheduler.step()
    return [request for request, _ in scheduler.running]


def decode_steps_without_sync(engine: Engine, requests: list[Request], steps: int) -> None:
    """`steps` decode steps of `requests` under CUDA's sync debug mode "error": any host sync inside a
    step (beyond the read-back) raises."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(steps):
            results = engine.decode_tokens(requests)
            for request, (token, _) in zip(requests, results, strict=True):  # type: ignore[misc]
                request.next_token = token
    finally:
        torch.cuda.set_sync_debug_mode("default")
