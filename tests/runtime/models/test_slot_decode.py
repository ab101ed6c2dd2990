"""The decode step over the static KV pool (the function CUDA graphs capture) against the eager forward."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from freetoken.runtime.engine import build_engine
from freetoken.runtime.models.kernels.decode_attention import decode_kernels_available
from freetoken.runtime.models.kernels.latent_attention import latent_decode_attention
from freetoken.runtime.models.slot_decode import DecodeOps, DecodeRows, decode_step, prepare_for_slot_decode
from oracle import build_family_model, rel_err

PROMPTS = [[5, 77, 301, 12], [9, 250, 33, 401, 18, 2, 64], [111]]
NEXT = [40, 41, 42]


def test_batched_slot_step_equals_each_sequence_alone(tiny_model: tuple[Path, Any]) -> None:
    check_batched_step(tiny_model[0], DecodeOps.for_device(torch.device("cpu")))


@pytest.mark.skipif(not decode_kernels_available("cpu"), reason="needs Triton's interpreter")
def test_latent_attention_kernel_in_the_step(tmp_path: Path) -> None:
    """DeepSeek-V3's step with the split latent kernel (what CUDA runs; the interpreter here) over the
    engine's own pool: the eager forward's logits, each row writing only its own position."""
    build_family_model(tmp_path, "deepseek_v3")
    ops = replace(DecodeOps.for_device(torch.device("cpu")), latent_attention=latent_decode_attention)
    check_batched_step(tmp_path, ops)


def check_batched_step(model_dir: Path, ops: DecodeOps) -> None:
    batched = build_engine(model_dir, device="cpu", dtype="float32")
    alone = build_engine(model_dir, device="cpu", dtype="float32")
    prepare_for_slot_decode(batched.model)  # q, k, v as one matrix: the eager forward runs on its views
    seqs = [batched.new_sequence() for _ in PROMPTS]
    for seq, prompt in zip(seqs, PROMPTS, strict=True):
        batched.prefill(seq, prompt)
    pool = batched.kv_pool
    before = [k.clone() for k in pool.k]
    # rows in another order than the slots, with a padding row in the middle
    order = [2, 0, 1]
    slots = [seqs[i].kv.slot for i in order]
    rows = DecodeRows(
        tokens=torch.tensor([NEXT[order[0]], 0, NEXT[order[1]], NEXT[order[2]]]),
        positions=torch.tensor(
            [len(PROMPTS[order[0]]), 0, len(PROMPTS[order[1]]), len(PROMPTS[order[2]])]
        ).int(),
        slots=torch.tensor([slots[0], -1, slots[1], slots[2]]).int(),
        lengths=torch.tensor(
            [len(PROMPTS[order[0]]) + 1, 1, len(PROMPTS[order[1]]) + 1, len(PROMPTS[order[2]]) + 1]
        ).int(),
    )
    with torch.inference_mode():
        logits = decode_step(batched.model, rows, pool, ops)
    for row, i in zip((0, 2, 3), order, strict=True):
        seq = alone.new_sequence()
        alone.prefill(seq, PROMPTS[i])
        want = alone.forward(seq, [NEXT[i]])
        assert rel_err(logits[row : row + 1], want) < 1e-5
        seq.release()
    for layer, k in enumerate(pool.k):  # each row wrote exactly its own next position
        changed = (k != before[layer]).any(dim=(1, 3))  # [S, CAP]
        for seq, prompt in zip(seqs, PROMPTS, strict=True):
            assert changed[seq.kv.slot].nonzero().flatten().tolist() == [len(prompt)]
