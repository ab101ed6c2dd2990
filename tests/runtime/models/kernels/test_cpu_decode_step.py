"""The whole-step native CPU decode against its reference, the model's own decode with the CPU ops, for
every grouped-query family it takes (Qwen3-MoE with and without a dense layer; Mixtral's window; OLMoE's
whole-projection q/k norms and clamp; GLM-4.5's biases, partial rope, grouped sigmoid router, shared
expert and dense layer; MiniMax-M2's whole-projection norms, partial rope and sigmoid router)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from freetoken.runtime.engine import Engine, build_engine
from freetoken.runtime.models.kernels.cpu_decode_step import CpuDecodeStep, declined
from freetoken.runtime.models.slot_decode import DecodeOps, DecodeRows
from freetoken.runtime.moe.kernels.loader import load_library
from freetoken.runtime.sampling import SamplingParams
from oracle import build_family_model, rel_err

pytestmark = pytest.mark.skipif(load_library() is None, reason="needs the compiled CPU kernels")

PROMPTS = [[5, 77, 301, 12], [9, 250, 33, 401, 18, 2, 64], [111]]
NEXT = [40, 41, 42]


def bf16_engine(folder: Path, **options: Any) -> Engine:
    return build_engine(folder, device="cpu", dtype="bfloat16", moe_backend="cpu", **options)


def prefilled(folder: Path) -> tuple[Engine, list[int]]:
    """An engine with the prompts prefilled, and each one's KV slot."""
    engine = bf16_engine(folder)
    slots = []
    for prompt in PROMPTS:
        seq = engine.new_sequence()
        engine.prefill(seq, prompt)
        slots.append(seq.kv.slot)
    return engine, slots


def step_rows(slots: list[int]) -> DecodeRows:
    """The three sequences' next tokens in another order than their slots, a padding row among them."""
    order = [2, 0, 1]
    lengths = [len(PROMPTS[i]) for i in order]
    return DecodeRows(
        tokens=torch.tensor([NEXT[order[0]], 0, NEXT[order[1]], NEXT[order[2]]]),
        positions=torch.tensor([lengths[0], 0, lengths[1], lengths[2]]).int(),
        slots=torch.tensor([slots[order[0]], -1, slots[order[1]], slots[order[2]]]).int(),
        lengths=torch.tensor([lengths[0] + 1, 1, lengths[1] + 1, lengths[2] + 1]).int(),
    )


FAMILIES = ["qwen3_moe-dense-layer", "qwen3_moe", "mixtral", "olmoe", "glm4_moe", "minimax_m2"]


@pytest.fixture(params=FAMILIES)
def model_dir(
    request: pytest.FixtureRequest, make_model: Callable[..., tuple[Path, Any]], tmp_path: Path
) -> Path:
    if request.param.startswith("qwen3_moe"):
        return make_model(mlp_only_layers=[1] if request.param.endswith("dense-layer") else [])[0]
    build_family_model(tmp_path / request.param, request.param)
    return tmp_path / request.param


def test_the_engine_takes_the_native_step_for_a_bf16_model_on_the_cpu_backend(model_dir: Path) -> None:
    assert bf16_engine(model_dir).decoder.native is not None
    assert build_engine(model_dir, device="cpu", dtype="float32", moe_backend="cpu").decoder.native is None
    # experts in slots (a cache on the CPU standing in for the device): the Python step computes them
    cached = build_engine(model_dir, device="cpu", dtype="bfloat16", moe_backend="offload", cache_size=4)
    assert cached.decoder.native is None


def test_native_step_matches_the_python_step(model_dir: Path) -> None:
    (native, slots), (python, _) = prefilled(model_dir), prefilled(model_dir)
    rows = step_rows(slots)
    native.moe_counters.reset()
    python.moe_counters.reset()
    with torch.inference_mode():
        got = native.decoder.native(rows)
        want = python.model.decode(rows, python.kv_pool, DecodeOps.for_device(torch.device("cpu")))
    assert got is not None and got.dtype == want.dtype == torch.bfloat16
    for row in (0, 2, 3):  # the padding row's logits are garbage in both
        assert rel_err(got[row], want[row]) < 2e-2, row
        assert got[row].argmax() == want[row].argmax()
    for k_native, k_python, v_native, v_python in zip(
        native.kv_pool.k, python.kv_pool.k, native.kv_pool.v, python.kv_pool.v, strict=True
    ):  # each row wrote its own next position, the same K/V (bf16 rounding of fp32 sums apart)
        assert rel_err(k_native, k_python) < 1e-2 and rel_err(v_native, v_python) < 1e-2
    assert native.moe_counters.totals() == python.moe_counters.totals()
    assert native.moe_counters.totals()["cpu"] > 0


def test_native_decode_gives_the_python_steps_greedy_tokens(model_dir: Path) -> None:
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    native = bf16_engine(model_dir)
    python = bf16_engine(model_dir)
    python.decoder.native = None
    prompt = PROMPTS[1]
    want = [e.token_id for e in python.generate(prompt, params) if e.token_id is not None]
    got = [e.token_id for e in native.generate(prompt, params) if e.token_id is not None]
    assert got == want and len(got) == 24


def test_gpt_oss_experts_stay_with_the_python_step(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Its experts' clamped function and biases are not the native step's: declined, not approximated,
    and -v's log says why."""
    build_family_model(tmp_path / "o", "gpt_oss")
    with caplog.at_level(logging.INFO, logger="freetoken"):
        engine = bf16_engine(tmp_path / "o")
    assert engine.decoder.native is None
    assert (
        declined(engine.model, engine.kv_pool, engine.executor)
        == "the experts' function or biases are not plain SiLU ones"
    )
    assert "run through the model's own decode: the experts' function" in caplog.text


def test_a_routing_recorder_sends_the_step_back_to_python(model_dir: Path) -> None:
    engine, slots = prefilled(model_dir)
    step = engine.decoder.native
    assert isinstance(step, CpuDecodeStep)
    engine.record_routing(object())  # any recorder: the native step never sees the routing
    assert step(step_rows(slots)) is None


def test_a_token_outside_the_vocabulary_is_refused_before_anything_is_written(model_dir: Path) -> None:
    engine, slots = prefilled(model_dir)
    rows = step_rows(slots)
    bad = DecodeRows(rows.tokens.clone(), rows.positions, rows.slots, rows.lengths)
    bad.tokens[2] = engine.config.vocab_size
    before = [k.clone() for k in engine.kv_pool.k]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.decoder.native(bad)
    assert all(torch.equal(k, b) for k, b in zip(engine.kv_pool.k, before, strict=True))


def test_a_batched_step_through_the_decoder_matches_the_python_step(model_dir: Path) -> None:
    """The decoder hands the step strided columns of its staged rows; each row must read its own."""
    (native, slots), (python, _) = prefilled(model_dir), prefilled(model_dir)
    python.decoder.native = None
    positions = [len(p) for p in PROMPTS]
    with torch.inference_mode():
        got = native.decoder.step(NEXT, positions, slots, "greedy")
        want = python.decoder.step(NEXT, positions, slots, "greedy")
    assert got.tokens == want.tokens
    for row in range(len(PROMPTS)):
        assert rel_err(got.logits[row], want.logits[row]) < 2e-2, row
