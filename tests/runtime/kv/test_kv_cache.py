"""Decoding with the KV cache equals recomputing the whole sequence."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from freetoken.runtime.engine import build_engine
from oracle import rel_err


def test_decode_equals_full_recompute(tiny_model: tuple[Path, Any]) -> None:
    engine = build_engine(tiny_model[0], device="cpu", dtype="float32")
    ids = [int(i) for i in torch.randint(0, 600, (40,), generator=torch.Generator().manual_seed(1))]
    seq = engine.new_sequence()
    step_logits = [engine.forward(seq, ids[:8], all_logits=True)]
    step_logits += [engine.forward(seq, [t]) for t in ids[8:]]
    full = engine.forward(engine.new_sequence(), ids, all_logits=True)
    assert rel_err(torch.cat(step_logits), full) < 1e-5


def test_chunked_prefill_equals_one_shot_in_fixed_storage(tiny_model: tuple[Path, Any]) -> None:
    engine = build_engine(tiny_model[0], device="cpu", dtype="float32")
    ids = [int(i) for i in torch.randint(0, 600, (600,), generator=torch.Generator().manual_seed(2))]
    seq = engine.new_sequence()
    pointers = [t.data_ptr() for t in (*seq.kv.k, *seq.kv.v)]
    chunks = [engine.forward(seq, ids[a:b], all_logits=True) for a, b in ((0, 100), (100, 333), (333, 600))]
    assert [t.data_ptr() for t in (*seq.kv.k, *seq.kv.v)] == pointers  # nothing was re-allocated
    full = engine.forward(engine.new_sequence(), ids, all_logits=True)
    assert rel_err(torch.cat(chunks), full) < 1e-5


def test_truncate_then_refill(tiny_model: tuple[Path, Any]) -> None:
    engine = build_engine(tiny_model[0], device="cpu", dtype="float32")
    seq = engine.new_sequence()
    engine.forward(seq, [1, 2, 3, 4, 5, 6], all_logits=True)
    seq.truncate(3)
    assert seq.kv.length == 3 and seq.token_ids == [1, 2, 3]
    again = engine.forward(seq, [40, 41], all_logits=True)
    fresh = engine.forward(engine.new_sequence(), [1, 2, 3, 40, 41], all_logits=True)
    assert rel_err(again, fresh[3:]) < 1e-5
