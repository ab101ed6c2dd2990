"""Prefill layer streaming (two full-layer buffers from the slot pool) equals `fused`, and leaves the
residency table true to the slots' contents. The cpu device stands in for the accelerator."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from freetoken.runtime.engine import Engine, build_engine
from freetoken.runtime.moe.residency import EMPTY
from freetoken.runtime.sampling import SamplingParams
from oracle import build_hf_model, rel_err
from residency_checks import assert_residency_true

PROMPT = [(37 * i + 11) % 700 for i in range(150)]
LAYERS = dict(num_hidden_layers=5, mlp_only_layers=[1])  # MoE layers 0, 2, 3, 4; 8 experts each


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("stream-model")
    build_hf_model(folder, **LAYERS)
    return folder


@pytest.fixture(scope="module")
def reference(model: Path) -> tuple[torch.Tensor, list[int]]:
    fused = build_engine(model, device="cpu", dtype="float32", moe_backend="fused")
    logits = fused.forward(fused.new_sequence(), PROMPT, all_logits=True)
    fused.reset()
    tokens = [e.token_id for e in fused.generate(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))]
    return logits[-1:], tokens


def streaming(model: Path, chunk: int, backend: str = "offload", slots: int = 20, **moe: Any) -> Engine:
    extra = {"pcie_gbps": 25.0, "host_gbps": 100.0} if backend == "hybrid" else {}
    return build_engine(
        model,
        device="cpu",
        dtype="float32",
        moe_backend=backend,
        cache_size=slots,
        max_prefill_tokens=chunk,
        prefill_stream="on",
        **extra,
        **moe,
    )


@pytest.mark.parametrize("hit_d2d", [False, True], ids=["pcie", "hit-d2d"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
@pytest.mark.parametrize("chunk", [7, 64, len(PROMPT)], ids=["7", "64", "whole"])
def test_streamed_prefill_equals_fused(
    model: Path, reference: tuple[torch.Tensor, list[int]], chunk: int, overlap: bool, hit_d2d: bool
) -> None:
    engine = streaming(model, chunk, prefill_overlap=overlap, prefill_hit_d2d=hit_d2d)
    try:
        seq = engine.new_sequence()
        assert rel_err(engine.prefill(seq, PROMPT), reference[0]) < 1e-4
        totals = engine.moe_counters.totals()
        chunks = -(-len(PROMPT) // chunk)
        assert totals["streamed"] + totals["d2d"] == chunks * 4 * 8  # every expert of every layer, per chunk
        assert totals["misses"] == 0  # no on-demand step ran
        if hit_d2d and chunks > 1:
            assert totals["d2d"] > 0
        assert_residency_true(engine)
        # the last two layers streamed stay resident: decode finds them
        ex = engine.executor
        assert (ex.residency.table()[-2:] != EMPTY).all()
        engine.reset()
        tokens = [e.token_id for e in engine.generate(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))]
        assert tokens == reference[1]
        assert_residency_true(engine)
    finally:
        engine.close()


@pytest.mark.parametrize("backend", ["cpu", "hybrid"])
def test_streaming_under_other_cached_backends(
    model: Path, reference: tuple[torch.Tensor, list[int]], backend: str
) -> None:
    engine = streaming(model, 64, backend=backend, slots=16)  # exactly the two buffers
    try:
        assert rel_err(engine.prefill(engine.new_sequence(), PROMPT), reference[0]) < 1e-4
        assert_residency_true(engine)
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("backend", "slots"), [("cpu", 0), ("offload", 15), ("hybrid", 4)], ids=["cpu", "offload-15", "hybrid-4"]
)
def test_a_cache_below_two_layers_streams_through_a_scratch_bank(
    model: Path, reference: tuple[torch.Tensor, list[int]], backend: str, slots: int
) -> None:
    engine = streaming(model, 64, backend=backend, slots=slots)
    try:
        seq = engine.new_sequence()
        engine.forward(seq, PROMPT[:3])  # a decode-sized pass first: the cache holds what it routed
        before = engine.executor.residency.table().copy()
        engine.reset()
        assert rel_err(engine.prefill(engine.new_sequence(), PROMPT), reference[0]) < 1e-4
        executor = engine.executor
        assert executor.scratch is not None and executor.scratch.gate_up.shape[0] == 16  # two layers of 8
        streamed = engine.moe_counters.totals()["streamed"]
        assert streamed >= 3 * 4 * 8  # every layer of every chunk of 64 went through the buffers
        assert np.array_equal(executor.residency.table(), before)  # the cache was neither read nor changed
        assert_residency_true(engine)
        engine.reset()
        tokens = [e.token_id for e in engine.generate(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))]
        assert tokens == reference[1]
    finally:
        engine.close()


def test_no_scratch_bank_beside_slots_sized_to_a_vram_budget(model: Path) -> None:
    engine = streaming(model, 64, slots=15, vram_budget="64GiB")
    try:
        assert engine.num_slots == 15
        engine.prefill(engine.new_sequence(), PROMPT)
        assert engine.moe_counters.totals()["streamed"] == 0 and engine.executor.scratch is None
    finally:
        engine.close()
    engine = streaming(model, 64, slots=15)
    try:
        engine.prefill(engine.new_sequence(), PROMPT)
        assert engine.executor.scratch is not None
        engine.set_vram_budget("64GiB")  # a budget set later: the scratch bank goes at the next pass
        engine.moe_counters.reset()
        engine.reset()
        engine.prefill(engine.new_sequence(), PROMPT)
        assert engine.moe_counters.totals()["streamed"] == 0 and engine.executor.scratch is None
    finally:
        engine.close()


def test_off_means_on_demand(model: Path, reference: tuple[torch.Tensor, list[int]]) -> None:
    for slots in (0, 15, 20):
        engine = build_engine(
            model, device="cpu", dtype="float32", moe_backend="cpu" if slots == 0 else "offload",
            cache_size=slots, prefill_stream="off",
        )  # fmt: skip
        try:
            assert rel_err(engine.prefill(engine.new_sequence(), PROMPT), reference[0]) < 1e-4
            totals = engine.moe_counters.totals()
            assert totals["streamed"] == 0 and totals["misses"] > 0
            assert engine.executor.scratch is None
        finally:
            engine.close()


def test_auto_without_a_link_does_not_stream(model: Path) -> None:
    """The cpu device has no B_P: streaming cannot win, the plan says on demand."""
    for backend, slots in (("offload", 20), ("cpu", 0)):
        engine = build_engine(model, device="cpu", dtype="float32", moe_backend=backend, cache_size=slots)
        try:
            engine.prefill(engine.new_sequence(), PROMPT)
            assert engine.moe_counters.totals()["streamed"] == 0
        finally:
            engine.close()


def test_buffers_come_from_the_least_recent_slots(model: Path) -> None:
    engine = streaming(model, len(PROMPT))
    try:
        residency = engine.executor.residency
        oldest = set(np.argsort(residency.stamp.numpy(), kind="stable")[:16].tolist())
        engine.executor.begin_pass(len(PROMPT), len(PROMPT))
        streamer = engine.executor.streamer
        assert streamer is not None
        assert set(np.concatenate(streamer.slots).tolist()) == oldest
        engine.executor.end_pass()
    finally:
        engine.close()
