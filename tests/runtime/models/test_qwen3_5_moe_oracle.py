"""Qwen3.5-MoE (hybrid DeltaNet + gated attention, shared expert) against transformers' implementation
(its pure-torch path) on a tiny random model: logits, decode through the carried states, every MoE
backend, chunked prefill, batched decode, and conversation reuse that must restart a recurrent state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from freetoken.runtime.engine import build_engine
from freetoken.runtime.sampling import SamplingParams
from oracle import HYBRID_BACKEND_CASES, build_hybrid_model, rel_err

PROMPT = [5, 77, 301, 12, 9, 250, 33, 401, 18, 2, 64, 111]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    pytest.importorskip("transformers.models.qwen3_5_moe")
    folder = tmp_path_factory.mktemp("tiny-qwen3-5-moe")
    return folder, build_hybrid_model(folder)


def reference(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_prompt_and_decode_logits(hybrid: tuple[Path, Any]) -> None:
    folder, model = hybrid
    engine = build_engine(folder, device="cpu", dtype="float32", moe_backend="fused")
    seq = engine.new_sequence()
    ids = list(PROMPT)
    assert rel_err(engine.forward(seq, ids, all_logits=True), reference(model, ids)) < 1e-4
    for _ in range(8):  # each step continues the conv and recurrent states
        ids.append(int(reference(model, ids)[-1].argmax()))
        assert rel_err(engine.forward(seq, ids[-1:])[-1], reference(model, ids)[-1]) < 1e-4


def test_kv_only_for_the_attention_layers(hybrid: tuple[Path, Any]) -> None:
    folder, model = hybrid
    engine = build_engine(folder, device="cpu", dtype="float32", moe_backend="fused")
    kinds = model.config.layer_types
    attention = tuple(i for i, kind in enumerate(kinds) if kind == "full_attention")
    assert 0 < len(attention) < len(kinds)
    kv = engine.new_sequence().kv
    assert kv.layers == attention and len(kv.k) == len(kv.v) == len(attention)
    full = type(kv)(len(kinds), kv.num_kv_heads, kv.head_dim, kv.dtype, kv.device, kv.max_len)
    assert kv.nbytes * len(kinds) == full.nbytes * len(attention)
    from freetoken.runtime.memory import kv_bytes_per_token

    per_token = 2 * len(attention) * kv.num_kv_heads * kv.head_dim * 4
    assert kv_bytes_per_token(engine.config, torch.float32) == per_token  # VRAM planning agrees


def test_recurrent_states_live_in_fixed_slots(hybrid: tuple[Path, Any]) -> None:
    """Each DeltaNet layer's state is a view of the engine's pool, in place through decode, a follow-up
    turn that resumes from a checkpoint, and a new conversation (which starts from zero)."""
    engine = build_engine(hybrid[0], device="cpu", dtype="float32", moe_backend="fused")
    pool = engine.kv_pool
    linear = [i for i, kind in enumerate(hybrid[1].config.layer_types) if kind == "linear_attention"]
    assert sorted(pool.states) == linear
    pointers = [t.data_ptr() for tensors in pool.states.values() for t in tensors]
    first = greedy(engine, PROMPT, 8)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    follow = list(engine.generate([*PROMPT, *first, 7, 8], params))
    assert follow[-1].stats is not None and follow[-1].stats.cached_tokens > 0  # resumed, not re-prefilled
    assert greedy(engine, PROMPT, 8) == first  # a fresh conversation in a reused slot: zero states again
    assert [t.data_ptr() for tensors in pool.states.values() for t in tensors] == pointers


def greedy(engine: Any, prompt: list[int], n: int = 16) -> list[int]:
    engine.reset()
    return [e.token_id for e in engine.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True))]


@pytest.mark.parametrize(("backend", "options"), HYBRID_BACKEND_CASES)
def test_every_backend_gives_the_reference_greedy_tokens(
    hybrid: tuple[Path, Any], backend: str, options: dict
) -> None:
    folder, model = hybrid
    ids = list(PROMPT)
    for _ in range(16):
        ids.append(int(reference(model, ids)[-1].argmax()))
    engine = build_engine(folder, device="cpu", dtype="float32", moe_backend=backend, **options)
    try:
        assert greedy(engine, PROMPT) == ids[len(PROMPT) :]
    finally:
        engine.close()


def test_batched_decode_and_conversation_reuse(hybrid: tuple[Path, Any]) -> None:
    folder, model = hybrid
    engine = build_engine(folder, device="cpu", dtype="float32", moe_backend="fused")
    prompts = [PROMPT[:5], PROMPT, PROMPT[3:9]]
    seqs = [engine.new_sequence() for _ in prompts]
    nxt = [int(engine.forward(s, p)[-1].argmax()) for s, p in zip(seqs, prompts, strict=True)]
    logits = engine.decode_batch(seqs, nxt)
    for i, p in enumerate(prompts):
        assert rel_err(logits[i], reference(model, [*p, nxt[i]])[-1]) < 1e-4
    # an extension of the last conversation continues its states; a divergent one starts over
    first = greedy(engine, PROMPT, 4)
    extended = [*PROMPT, *first[:3], 7, 8]
    events = list(engine.generate(extended, SamplingParams(max_tokens=1, ignore_eos=True)))
    assert events[-1].stats.cached_tokens == len(PROMPT) + 3
    assert events[-1].token_id == int(reference(model, extended)[-1].argmax())
    divergent = [*PROMPT[:6], 99, 98]
    events = list(engine.generate(divergent, SamplingParams(max_tokens=1, ignore_eos=True)))
    assert events[-1].stats.cached_tokens == 0
    assert events[-1].token_id == int(reference(model, divergent)[-1].argmax())


def test_served_together_equals_alone(hybrid: tuple[Path, Any]) -> None:
    """The server's batcher on a hybrid model: states per sequence, batched decode equals alone."""
    import threading

    from freetoken.runtime.batcher import Batcher

    folder, _ = hybrid
    engine = build_engine(folder, device="cpu", dtype="float32", moe_backend="offload", cache_size=4)
    prompts = [PROMPT, PROMPT[:7], [3, 1, 4, 1, 5, 9, 2, 6]]
    alone = [greedy(engine, p, 10) for p in prompts]
    batcher = Batcher(engine, max_running=3)
    assert batcher.prefix.checkpoint_budget > 0
    outputs: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    done = threading.Semaphore(0)

    def collect(i: int) -> Any:
        def on_event(event: Any) -> None:
            assert not isinstance(event, Exception), event
            outputs[i].append(event.token_id)
            if event.finished:
                done.release()

        return on_event

    batcher.start()
    try:
        for i, p in enumerate(prompts):
            batcher.submit(p, SamplingParams(max_tokens=10, ignore_eos=True), collect(i))
        for _ in prompts:
            assert done.acquire(timeout=60)
    finally:
        batcher.stop()
        engine.close()
    assert [outputs[i] for i in range(len(prompts))] == alone
    assert batcher.stats.batched_rows > batcher.stats.decode_steps  # they really ran together


def test_the_published_wrapped_layout_loads_from_hf_and_ftw(tmp_path: Path) -> None:
    """model_type qwen3_5_moe: text_config nested, weights under model.language_model., vision skipped."""
    from freetoken.runtime.loading.convert import convert_to_ftw

    pytest.importorskip("transformers.models.qwen3_5_moe")
    folder = tmp_path / "vl"
    model = build_hybrid_model(folder, wrapped=True)
    with torch.no_grad():
        want = model(input_ids=torch.tensor([PROMPT])).logits[0]
    hf = build_engine(folder, device="cpu", dtype="float32", moe_backend="offload", cache_size=5)
    assert hf.config.architecture == "qwen3_5_moe"
    assert rel_err(hf.forward(hf.new_sequence(), PROMPT, all_logits=True), want) < 1e-4
    ftw = convert_to_ftw(folder, tmp_path / "vl.ftw", dtype="float32").out
    engine = build_engine(ftw, device="cpu", dtype="float32", moe_backend="fused")
    assert rel_err(engine.forward(engine.new_sequence(), PROMPT, all_logits=True), want) < 1e-4
