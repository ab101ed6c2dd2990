"""Decode over the static KV pool on the CPU (the eager side of the graph path): fixed storage, the
same tokens in any batch, batches above the largest graph size, and the context limit."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from freetoken.errors import FreeTokenError
from freetoken.runtime.decode_graph import MAX_ROWS
from freetoken.runtime.engine import Engine, build_engine
from freetoken.runtime.kv.prefix_cache import PrefixCache
from freetoken.runtime.measure.cpu_share import allowed_cores
from freetoken.runtime.sampling import SamplingParams
from freetoken.runtime.scheduler import Scheduler


def together(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    engine.reserve_slots(len(prompts))
    scheduler = Scheduler(engine, PrefixCache(0), max_running=len(prompts))
    out: list[list[Any]] = [[] for _ in prompts]
    for i, prompt in enumerate(prompts):
        scheduler.add(prompt, params, out[i].append)
    while scheduler.has_work():
        scheduler.step()
    for events in out:
        assert not any(isinstance(e, Exception) for e in events), events
    return [[e.token_id for e in events] for events in out]


def test_kv_storage_stays_put_over_1000_steps(tiny_model: tuple[Path, Any]) -> None:
    engine = build_engine(tiny_model[0], device="cpu", dtype="float32")
    pool = engine.kv_pool
    pointers = [t.data_ptr() for t in (*pool.k, *pool.v)]
    events = list(engine.generate([5, 77, 301], SamplingParams(max_tokens=1000, ignore_eos=True)))
    assert len(events) == 1000
    assert [t.data_ptr() for t in (*pool.k, *pool.v)] == pointers and pool.generation == 0
    assert engine.decoder is not None and engine.decoder.steps == 999


def test_a_batch_above_the_largest_step_runs_in_parts_with_the_same_tokens(
    tiny_model: tuple[Path, Any],
) -> None:
    engine = build_engine(tiny_model[0], device="cpu", dtype="float32")
    prompts = [[i + 1, 2 * i + 3, 7] for i in range(MAX_ROWS + 3)]
    greedy = SamplingParams(max_tokens=3, ignore_eos=True)
    batched = together(engine, prompts, greedy)
    alone = [together(engine, [prompt], greedy)[0] for prompt in prompts[:4]]
    assert batched[:4] == alone


def test_sampled_rows_repeat_by_seed_whatever_the_batch(tiny_model: tuple[Path, Any]) -> None:
    engine = build_engine(tiny_model[0], device="cpu", dtype="float32")
    seeded = SamplingParams(temperature=1.3, top_p=0.95, seed=7, max_tokens=8, ignore_eos=True)
    alone = together(engine, [[5, 77, 301]], seeded)[0]
    assert together(engine, [[9, 9], [5, 77, 301], [40]], seeded)[1] == alone
    greedy = together(engine, [[5, 77, 301]], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert alone != greedy  # the draw is really sampled at this temperature
    plain = SamplingParams(temperature=1.3, seed=7, max_tokens=8, ignore_eos=True)  # no filter: no sort
    assert together(engine, [[9, 9], [5, 77, 301]], plain)[1] == together(engine, [[5, 77, 301]], plain)[0]


def test_the_context_limit_is_a_clear_error(tiny_model: tuple[Path, Any]) -> None:
    engine = build_engine(tiny_model[0], device="cpu", dtype="float32")
    seq = engine.new_sequence()
    engine.prefill(seq, [3] * (engine.max_seq_len - 1))
    engine.decode_batch([seq], [4])  # the last position
    with pytest.raises(FreeTokenError, match=f"exceeds the context of {engine.max_seq_len}"):
        engine.decode_batch([seq], [5])


def test_the_decode_wait_sleeps_only_where_the_host_computes_experts_on_every_core(
    tiny_model: tuple[Path, Any],
) -> None:
    # a spinning wait for the step's tokens beside CPU expert threads on every core would hold a core they
    # need; beside a core left over it spins (a sleeping wait costs wake-ups)
    cores = len(allowed_cores())
    engine = build_engine(tiny_model[0], device="cpu", dtype="float32", moe_backend="fused")
    try:
        assert engine.decoder is not None and not engine.decoder.sleep_while_waiting
        cases = [
            ("cpu", {"cpu_threads": cores}, cores, True),
            ("hybrid", {"cache_size": 2, "cpu_threads": cores}, cores, True),
            ("offload", {"cache_size": 2, "cpu_threads": cores}, 0, False),
            ("offload", {"cache_size": 2, "cpu_layers": "0,", "cpu_threads": cores}, cores, True),
        ]
        if cores > 1:
            fewer = {"cpu_threads": cores - 1}
            cases += [
                ("cpu", fewer, cores - 1, False),
                ("offload", {"cache_size": 2, "cpu_layers": "0,", **fewer}, cores - 1, False),
            ]
        for backend, options, threads, sleeps in cases:
            engine.configure_moe(replace(engine.moe, backend=backend, **options))
            assert engine.executor.host_threads() == threads, (backend, options)
            assert engine.decoder.sleep_while_waiting is sleeps, (backend, options)
    finally:
        engine.close()
