"""A decode step over several sequences at once equals each sequence stepped alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from freetoken.runtime.engine import build_engine
from oracle import rel_err

PROMPTS = [[5, 77, 301, 12], [9, 250, 33, 401, 18, 2, 64], [111, 7]]


@pytest.mark.parametrize(
    ("backend", "options"),
    [("fused", {}), ("offload", {"cache_size": 3}), ("hybrid", {"cache_size": 4, "pcie_gbps": 25.0})],
)
def test_batched_decode_equals_one_at_a_time(
    tiny_model: tuple[Path, Any], backend: str, options: dict
) -> None:
    batched = build_engine(tiny_model[0], device="cpu", dtype="float32", moe_backend=backend, **options)
    alone = build_engine(tiny_model[0], device="cpu", dtype="float32", moe_backend="fused")
    try:
        seqs = [batched.new_sequence() for _ in PROMPTS]
        refs = [alone.new_sequence() for _ in PROMPTS]
        nxt = []
        for seq, ref, prompt in zip(seqs, refs, PROMPTS, strict=True):
            batched.forward(seq, prompt)
            nxt.append(int(alone.forward(ref, prompt)[-1].argmax()))
        for _ in range(6):
            logits = batched.decode_batch(seqs, nxt)
            assert logits.shape[0] == len(PROMPTS)
            for i, ref in enumerate(refs):
                want = alone.forward(ref, [nxt[i]])[-1]
                assert rel_err(logits[i], want) < 1e-5
            nxt = [int(row.argmax()) for row in logits]
        assert [s.kv.length for s in seqs] == [len(p) + 6 for p in PROMPTS]
        assert [s.token_ids[: len(p)] for s, p in zip(seqs, PROMPTS, strict=True)] == PROMPTS
    finally:
        batched.close()
