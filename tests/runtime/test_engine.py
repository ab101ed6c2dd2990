"""Engine verbs, stop conditions, prefix reuse and stats."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from freetoken.errors import FreeTokenError
from freetoken.runtime.engine import Engine, build_engine
from freetoken.runtime.sampling import SamplingParams
from oracle import rel_err

PROMPT = [5, 77, 301, 12, 9, 250, 33, 401]


@pytest.fixture(scope="module")
def engine(tiny_model: tuple[Path, Any]) -> Engine:
    return build_engine(tiny_model[0], device="cpu", dtype="float32")


def greedy(engine: Engine, n: int, **kw: Any) -> list[Any]:
    return list(engine.generate(PROMPT, SamplingParams(max_tokens=n, ignore_eos=True, **kw)))


def test_max_tokens_and_stats(engine: Engine) -> None:
    events = greedy(engine, 10)
    assert len(events) == 10 and events[-1].finish_reason == "length"
    assert not any(e.finished for e in events[:-1])
    stats = events[-1].stats
    assert stats is not None and stats.completion_tokens == 10 and stats.prompt_tokens == len(PROMPT)
    assert stats.decode_tok_s > 0 and stats.prefill_s > 0


def test_stop_token_id_ends_without_text(engine: Engine) -> None:
    tokens = [e.token_id for e in greedy(engine, 10)]
    events = greedy(engine, 10, stop_token_ids=(tokens[3],))
    first = tokens.index(tokens[3])
    assert [e.token_id for e in events] == tokens[: first + 1]
    assert events[-1].finish_reason == "stop"
    # The stop token adds no text; what the detokenizer still held is released.
    assert "".join(e.text for e in events) == engine.tokenizer.decode(tokens[:first])


def test_stop_string_truncates_text(engine: Engine) -> None:
    full = "".join(e.text for e in greedy(engine, 24))
    assert len(full) > 8
    stop = full[5:8]
    cut = full.index(stop)
    events = greedy(engine, 24, stop=(stop,))
    assert "".join(e.text for e in events) == full[:cut]
    assert events[-1].finish_reason == "stop"


def test_streamed_text_equals_decode(engine: Engine) -> None:
    events = greedy(engine, 20)
    assert "".join(e.text for e in events) == engine.tokenizer.decode([e.token_id for e in events])


def test_prefix_reuse_counts_cached_tokens_and_keeps_output(engine: Engine) -> None:
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    engine.reset()  # the prefix cache also holds the longer answers of the tests before
    first = list(engine.generate(PROMPT, params))
    again = list(engine.generate(PROMPT, params))
    assert [e.token_id for e in again] == [e.token_id for e in first]
    assert again[-1].stats is not None and again[-1].stats.cached_tokens == len(PROMPT) - 1
    longer = PROMPT + [e.token_id for e in first] + [3, 4]
    cont = list(engine.generate(longer, params))
    assert cont[-1].stats is not None and cont[-1].stats.cached_tokens == len(PROMPT) + 5
    fresh = build_engine(engine.engine_config.model_path, device="cpu", dtype="float32")
    assert [e.token_id for e in fresh.generate(longer, params)] == [e.token_id for e in cont]


def test_abandoned_generation_frees_the_queue(engine: Engine) -> None:
    gen = engine.generate(PROMPT, SamplingParams(max_tokens=50, ignore_eos=True))
    next(gen)
    gen.close()
    assert not engine.has_work()


def test_add_request_and_step(engine: Engine) -> None:
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))
    events = []
    while engine.has_work():
        events += engine.step()
    assert [e.request_id for e in events] == [rid] * 3 and events[-1].finished


def test_chat_uses_the_template(engine: Engine) -> None:
    events = list(
        engine.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2, ignore_eos=True))
    )
    text = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True
    )
    assert events[-1].stats is not None
    assert events[-1].stats.prompt_tokens == len(engine.tokenizer.encode(text))


def test_prompt_limits(engine: Engine) -> None:
    with pytest.raises(FreeTokenError, match="empty prompt"):
        engine.add_request([], SamplingParams())
    with pytest.raises(FreeTokenError, match="leaves no room"):
        engine.add_request([1] * 1024, SamplingParams())


@pytest.mark.parametrize("backend", ["fused", "offload"])
def test_chunked_prefill_equals_unchunked(tiny_model: tuple[Path, Any], backend: str) -> None:
    ids = [int(i) for i in torch.randint(0, 700, (150,), generator=torch.Generator().manual_seed(3))]
    options = {"cache_size": 4} if backend == "offload" else {}
    results = {}
    for chunk in (7, 64, 150, 8192):
        engine = build_engine(
            tiny_model[0],
            device="cpu",
            dtype="float32",
            moe_backend=backend,
            max_prefill_tokens=chunk,
            **options,
        )
        seq = engine.new_sequence()
        last = engine.prefill(seq, ids)
        assert seq.kv.length == len(ids) and last.shape[0] == 1
        seq.release()  # the engine holds one sequence at a time
        tokens = [e.token_id for e in engine.generate(ids, SamplingParams(max_tokens=12, ignore_eos=True))]
        results[chunk] = (last, tokens)
        engine.close()
    ref_last, ref_tokens = results[8192]
    for chunk, (last, tokens) in results.items():
        assert rel_err(last, ref_last) < 1e-5, chunk
        assert tokens == ref_tokens, chunk


def test_max_prefill_tokens_must_be_positive(tiny_model: tuple[Path, Any]) -> None:
    with pytest.raises(FreeTokenError, match="--max-prefill-tokens: expected a positive integer, got 0"):
        build_engine(tiny_model[0], device="cpu", max_prefill_tokens=0)


@pytest.mark.parametrize("backend", ["fused", "hybrid"])
def test_a_closed_engine_frees_its_pool_when_dropped(tiny_model: tuple[Path, Any], backend: str) -> None:
    import gc
    import weakref

    options = {"cache_size": 4} if backend != "fused" else {}
    engine = build_engine(tiny_model[0], device="cpu", dtype="float32", moe_backend=backend, **options)
    list(engine.generate([5, 77, 301], SamplingParams(max_tokens=3, ignore_eos=True)))
    pool, model = weakref.ref(engine.pool), weakref.ref(engine.model)
    engine.close()
    engine.close()  # twice is fine
    gc.disable()  # freed by reference counts alone, as soon as the engine is dropped
    try:
        del engine
        assert pool() is None and model() is None
    finally:
        gc.enable()
