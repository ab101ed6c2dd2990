"""Each model's decode step over the static KV pool (the function CUDA graphs capture) against its eager
forward, for every family."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from freetoken.runtime.engine import build_engine
from freetoken.runtime.models.kernels.decode_attention import decode_kernels_available
from freetoken.runtime.models.kernels.delta_step import (
    causal_conv_step,
    delta_rule_step,
    delta_step_available,
    kda_rule_step,
)
from freetoken.runtime.models.kernels.latent_attention import latent_decode_attention
from freetoken.runtime.models.kernels.norm_rope import add_rms_norm, qk_norm_rope_kv_write
from freetoken.runtime.models.slot_decode import DecodeOps, DecodeRows
from oracle import build_any_model, build_family_model, rel_err

PROMPTS = [[5, 77, 301, 12], [9, 250, 33, 401, 18, 2, 64], [111]]
NEXT = [40, 41, 42]
CPU_OPS = DecodeOps.for_device(torch.device("cpu"))
# families whose layers the step takes, beside Qwen3-MoE (the tiny_model fixture)
STATIC_FAMILIES = [
    "mixtral", "olmoe", "glm4_moe", "minimax_m2", "gpt_oss", "deepseek_v3", "deepseek_v32", "glm_moe_dsa",
    "kimi_linear",
    "deepseek_v4",
]  # fmt: skip


def test_batched_slot_step_equals_each_sequence_alone(tiny_model: tuple[Path, Any]) -> None:
    check_batched_step(tiny_model[0], CPU_OPS)


@pytest.mark.parametrize("family", [*STATIC_FAMILIES, "qwen3_5_moe", "qwen3_next"])
def test_every_family_steps_as_its_eager_forward(tmp_path: Path, family: str) -> None:
    build_any_model(tmp_path, family)
    check_batched_step(tmp_path, CPU_OPS)


@pytest.mark.skipif(not decode_kernels_available("cpu"), reason="needs Triton's interpreter")
def test_latent_attention_kernel_in_the_step(tmp_path: Path) -> None:
    """DeepSeek-V3's step with the split latent kernel (what CUDA runs; the interpreter here) over the
    engine's own pool: the eager forward's logits, each row writing only its own position."""
    build_family_model(tmp_path, "deepseek_v3")
    check_batched_step(tmp_path, replace(CPU_OPS, latent_attention=latent_decode_attention))


@pytest.mark.skipif(not delta_step_available("cpu"), reason="needs Triton's interpreter")
@pytest.mark.parametrize("family", ["qwen3_5_moe", "minimax_m2", "kimi_linear"])
def test_triton_kernels_in_the_step(tmp_path: Path, family: str) -> None:
    """The Triton norms, q/k norm + partial rotary + K/V write and DeltaNet kernels (what CUDA runs; the
    interpreter here) inside a hybrid and a whole-projection-norm family's step."""
    build_any_model(tmp_path, family)
    ops = replace(
        CPU_OPS,
        add_rms_norm=add_rms_norm,
        qk_norm_rope_kv_write=qk_norm_rope_kv_write,
        attention_block=None,
        conv_step=causal_conv_step,
        delta_step=delta_rule_step,
        kda_step=kda_rule_step,
    )
    check_batched_step(tmp_path, ops)


def check_batched_step(model_dir: Path, ops: DecodeOps) -> None:
    batched = build_engine(model_dir, device="cpu", dtype="float32")
    alone = build_engine(model_dir, device="cpu", dtype="float32")
    seqs = [batched.new_sequence() for _ in PROMPTS]
    for seq, prompt in zip(seqs, PROMPTS, strict=True):
        batched.prefill(seq, prompt)
    pool = batched.kv_pool
    before = [k.clone() for k in pool.k]
    states_before = {layer: [t.clone() for t in tensors] for layer, tensors in pool.states.items()}
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
        logits = batched.model.decode(rows, pool, ops)
    for row, i in zip((0, 2, 3), order, strict=True):
        seq = alone.new_sequence()
        alone.prefill(seq, PROMPTS[i])
        want = alone.forward(seq, [NEXT[i]])
        assert rel_err(logits[row : row + 1], want) < 1e-5
        for layer, state in getattr(seq.kv, "linear", {}).items():  # the recurrent states moved alike
            mine = pool.states[layer]
            torch.testing.assert_close(mine[0][seqs[i].kv.slot], state.conv, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(mine[1][seqs[i].kv.slot], state.recurrent, rtol=1e-4, atol=1e-5)
        seq.release()
    for layer, k in enumerate(pool.k):  # each row wrote exactly its own next position
        changed = (k != before[layer]).any(dim=(1, 3))  # [S, CAP]
        for seq, prompt in zip(seqs, PROMPTS, strict=True):
            assert changed[seq.kv.slot].nonzero().flatten().tolist() == [len(prompt)]
    used = {seq.kv.slot for seq in seqs}
    for layer, tensors in pool.states.items():  # slots no row holds keep their states
        for now, then in zip(tensors, states_before[layer], strict=True):
            for slot in set(range(pool.slots)) - used:
                assert torch.equal(now[slot], then[slot])


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_sparse_attention_keeps_fewer_positions_than_are_cached(tmp_path: Path, family: str) -> None:
    """An indexer keeping 3 positions of up to 8: each row's step attends to its own three, as eagerly."""
    build_family_model(tmp_path, family, index_topk=3)
    check_batched_step(tmp_path, CPU_OPS)


def test_deepseek_v4_steps_across_closing_windows(tmp_path: Path) -> None:
    """DeepSeek-V4's step from position 3 to 14 (its rate-3 windows close at 5, 8, 11, 14, the rate-5 ones
    at 4, 9, 14; the indexer keeping 2 entries once more are visible): each step's logits are the eager
    forward's over the same cache."""
    build_family_model(tmp_path, "deepseek_v4", index_topk=2)
    static = build_engine(tmp_path, device="cpu", dtype="float32")
    eager = build_engine(tmp_path, device="cpu", dtype="float32")
    prompt, token = [5, 77, 301], 40
    mine, theirs = static.new_sequence(), eager.new_sequence()
    static.prefill(mine, prompt)
    eager.prefill(theirs, prompt)
    steps = static.decoder.steps
    for _ in range(12):
        got = static.decode_batch([mine], [token])
        want = eager.forward(theirs, [token])
        assert rel_err(got, want) < 1e-5
        token = int(want[-1].argmax())
    assert static.decoder.steps == steps + 12
