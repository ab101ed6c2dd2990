"""Recurrent-state checkpoints at semantic anchors on the hybrid model: resuming equals a full
recompute, and under the three harness edit patterns anchors re-prefill less than fixed spacing or none."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from freetoken.replay.checkpoint_compare import compare
from freetoken.runtime.engine import build_engine
from freetoken.runtime.kv.state_checkpoints import StateCheckpoints
from freetoken.runtime.sampling import SamplingParams
from freetoken.runtime.text.anchors import AnchorTable
from oracle import build_hybrid_model, rel_err


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers.models.qwen3_5_moe")
    folder = tmp_path_factory.mktemp("hybrid")
    build_hybrid_model(folder)
    return folder


def test_anchor_table_from_the_tokenizer(hybrid: Path) -> None:
    engine = build_engine(hybrid, device="cpu", dtype="float32", moe_backend="fused")
    tok = engine.tokenizer
    table = AnchorTable.from_tokenizer(tok)
    kinds = ("think", "tool_call", "tool_response", "turn", "message", "call")  # harmony's spelled out
    assert {(k, e) for _, k, e in table.markers} == {(k, e) for k in kinds for e in ("open", "close")}
    ids = tok.encode("<|im_start|>assistant\n<think>\nhm\n</think>\n\nok<|im_end|>\n")
    think = tok.token_to_id("<think>")
    found = table.find(ids)
    assert found[0].position == 0 and found[0].kind == "turn"
    assert any(a.position == ids.index(think) and a.kind == "think" and a.edge == "open" for a in found)
    close = ids.index(tok.token_to_id("</think>")) + 1
    assert any(a.position == close and a.edge == "close" for a in found)


def test_eviction_drops_the_least_covering_oldest_first() -> None:
    from freetoken.runtime.models.delta_net import LinearState

    store = StateCheckpoints(AnchorTable(()), budget=3)
    state = {0: LinearState(torch.zeros(1), torch.zeros(1))}
    for position, kind in ((10, "turn:open"), (20, "think:open"), (30, "turn:open"), (40, "turn:open")):
        store.save(position, kind, state)
    assert sorted(store.saved) == [20, 30, 40]  # equal gaps: the oldest goes
    store.save(50, "turn:open", state)
    assert sorted(store.saved) == [20, 40, 50]  # 20 stays: it alone covers [0, 20)
    store.save(52, "turn:open", state)
    assert sorted(store.saved) == [20, 40, 50]  # 52 went: 50 covers all it would but 2 tokens
    assert store.best(45).position == 40 and store.best(5) is None
    store.drop_after(40)
    assert sorted(store.saved) == [20, 40]


@pytest.fixture(scope="module")
def kimi(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Kimi-Linear's hybrid: delta-attention layers around a latent-attention one."""
    from oracle import build_family_model

    folder = tmp_path_factory.mktemp("kimi")
    build_family_model(folder, "kimi_linear")
    return folder


@pytest.mark.parametrize("model", ["hybrid", "kimi"])
def test_resuming_from_an_anchor_equals_a_full_recompute(model: str, request: pytest.FixtureRequest) -> None:
    """Qwen3.5's and Kimi-Linear's hybrids: an edited conversation resumes from its deepest anchor."""
    folder = request.getfixturevalue(model)
    engine = build_engine(folder, device="cpu", dtype="float32", moe_backend="fused")
    fresh = build_engine(folder, device="cpu", dtype="float32", moe_backend="fused")
    tok = engine.tokenizer
    turn1 = [
        {"role": "user", "content": "What is the weather?"},
        {"role": "assistant", "content": "<think>\nlook it up\n</think>\n\nSunny."},
        {"role": "user", "content": "And tomorrow?"},
    ]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    list(engine.chat(turn1, params))
    # the harness strips the thinking from that assistant turn: the prefix up to <think> survives
    edited = [
        turn1[0],
        {"role": "assistant", "content": "Sunny."},
        turn1[2],
        {"role": "user", "content": "Thanks"},
    ]
    ids = tok.encode(tok.apply_chat_template(edited, add_generation_prompt=True))
    events = list(engine.generate(ids, SamplingParams(max_tokens=1, ignore_eos=True)))
    cached = events[-1].stats.cached_tokens
    assert cached > 0  # resumed from a checkpoint, not from zero
    seq = fresh.new_sequence()
    want = fresh.forward(seq, ids)[-1]
    assert events[-1].token_id == int(want.argmax())
    # and the logits of the resumed sequence equal the recompute: it went into the prefix cache with the
    # state at its end, where a follow-up resumes
    resumed = engine.new_sequence()
    assert engine.scheduler.prefix.load(ids, resumed.kv) == len(ids)
    resumed.token_ids = list(ids)
    assert (
        rel_err(
            engine.forward(resumed, [events[-1].token_id])[-1],
            fresh.forward(seq, [events[-1].token_id])[-1],
        )
        < 1e-4
    )


def test_anchors_re_prefill_least_at_equal_budget(hybrid: Path) -> None:
    """8 checkpoints each (the same bytes for anchors and interval-64): anchors re-prefill no more than
    fixed spacing under every harness, far less than none; with 16, within 5% of the new suffix."""
    rows = {(r["edit"], r["policy"]): r for r in compare(hybrid, budget=8)}
    for edit in ("openclaw", "opencode", "swe-agent"):
        anchors = rows[(edit, "anchors")]
        assert anchors["checkpoint_bytes"] == rows[(edit, "interval-64")]["checkpoint_bytes"]
        assert anchors["total_reprefilled"] <= rows[(edit, "interval-64")]["total_reprefilled"]
        assert anchors["total_reprefilled"] <= rows[(edit, "interval-512")]["total_reprefilled"]
        assert anchors["total_reprefilled"] < rows[(edit, "none")]["total_reprefilled"]
        assert all(r >= s for r, s in zip(anchors["reprefilled"], anchors["suffix"], strict=True))
    wide = {(r["edit"], r["policy"]): r for r in compare(hybrid, budget=16)}
    for edit in ("openclaw", "opencode", "swe-agent"):
        assert wide[(edit, "anchors")]["ratio"] <= 1.05


def test_the_server_resumes_other_conversations_from_the_prefix_tree(hybrid: Path) -> None:
    """Batcher (the server's loop): a conversation retired into the prefix tree resumes an edited
    request from its deepest anchor and an append-only follow-up from its end; tokens equal a recompute."""
    import threading

    from freetoken.runtime.batcher import Batcher

    engine = build_engine(hybrid, device="cpu", dtype="float32", moe_backend="offload", cache_size=4)
    fresh = build_engine(hybrid, device="cpu", dtype="float32", moe_backend="fused")
    tok = engine.tokenizer
    batcher = Batcher(engine, max_running=2)
    params = SamplingParams(max_tokens=5, ignore_eos=True)

    def serve(ids: list[int]) -> tuple[list[int], int]:
        events: list = []
        done = threading.Event()

        def on_event(event: object) -> None:
            assert not isinstance(event, Exception), event
            events.append(event)
            if event.finished:  # type: ignore[attr-defined]
                done.set()

        batcher.submit(ids, params, on_event)
        assert done.wait(60)
        return [e.token_id for e in events], events[-1].stats.cached_tokens

    def chat(messages: list[dict[str, str]]) -> list[int]:
        return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))

    turn1 = [
        {"role": "user", "content": "What is the weather?"},
        {"role": "assistant", "content": "<think>\nlook it up\n</think>\n\nSunny."},
        {"role": "user", "content": "And tomorrow?"},
    ]
    # the harness rewrites the earlier answer (a trimmed tool output would do the same)
    edited = [turn1[0], {"role": "assistant", "content": "Rain."}, turn1[2]]
    batcher.start()
    try:
        first, cached = serve(chat(turn1))
        assert cached == 0
        stored = chat(turn1) + first[:-1]  # the last token was sampled, never computed
        follow = [*stored, first[-1], *tok.encode("more")]
        tokens, cached = serve(chat(edited))
        a, b = chat(turn1), chat(edited)
        diverge = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
        assert 0 < cached <= diverge  # an anchor at or before the edit (the answer's turn opener)
        assert cached == max(x.position for x in engine._anchors.find(a) if 0 < x.position <= diverge)
        assert tokens == greedy_tokens(fresh, chat(edited), 5)
        tokens, cached = serve(follow)
        assert cached == len(stored)  # the state saved at the end of the first conversation
        assert tokens == greedy_tokens(fresh, follow, 5)
        assert batcher.prefix.stats.checkpoints > 0
    finally:
        batcher.stop()
        engine.close()


def greedy_tokens(engine, ids: list[int], n: int) -> list[int]:  # type: ignore[no-untyped-def]
    seq = engine.new_sequence()
    out = [int(engine.forward(seq, ids)[-1].argmax())]
    while len(out) < n:
        out.append(int(engine.forward(seq, [out[-1]])[-1].argmax()))
    return out


def test_prefill_takes_checkpoints_without_extra_passes(
    hybrid: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Anchors inside a prompt are captured by the recurrent layers during its one pass (a split pass
    would stream every expert layer again per piece)."""
    engine = build_engine(hybrid, device="cpu", dtype="float32", moe_backend="fused")
    tok = engine.tokenizer
    messages = [
        {"role": "user", "content": "What is the weather?"},
        {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "And tomorrow?"},
    ]
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
    passes: list[int] = []
    forward = engine.runner.forward  # the passes prefill runs
    monkeypatch.setattr(
        engine.runner, "forward", lambda seq, chunk, *a: passes.append(len(chunk)) or forward(seq, chunk, *a)
    )
    list(engine.generate(ids, SamplingParams(max_tokens=1, ignore_eos=True)))
    assert passes == [len(ids)]
    anchors = [c for c in engine.checkpoints if c.kind != "end"]
    assert len(anchors) >= 4  # the turn anchors inside the prompt
