"""offload / cpu / hybrid over the slot cache equal `fused`, for every cache size and batch shape.

The cpu device stands in for the accelerator: the slots are a separate CPU bank, fills are copies.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from freetoken.runtime.engine import Engine, build_engine
from freetoken.runtime.sampling import SamplingParams
from oracle import rel_err
from residency_checks import assert_residency_true

PROMPT = [5, 77, 301, 12, 9, 250, 33, 401, 18, 2, 64, 111]
POOL = 16  # the tiny model: MoE layers 0 and 2, 8 experts each, top-2
BACKENDS = {
    "offload": {},
    "offload-cpu-layer": {"cpu_layers": "2,"},
    "cpu": {},
    "hybrid": {"pcie_gbps": 25.0, "host_gbps": 100.0},
    "hybrid-capped": {"pcie_gbps": 90.0, "host_gbps": 100.0, "hybrid_max_fetch": 1},
    "offload-prefetch": {"prefetch": 2},  # router-lookahead prefetch: the same tokens, fewer or more fills
    "hybrid-prefetch": {"pcie_gbps": 25.0, "host_gbps": 100.0, "prefetch": 3},
}
SIZES = {"top-k": 2, "quarter": 4, "whole": POOL}


@pytest.fixture(scope="module")
def fused(tiny_model: tuple[Path, Any]) -> Engine:
    return build_engine(tiny_model[0], device="cpu", dtype="float32", moe_backend="fused")


def cached(folder: Path, backend: str, size: int) -> Engine:
    options = dict(BACKENDS[backend])
    return build_engine(
        folder, device="cpu", dtype="float32", moe_backend=backend.split("-")[0], cache_size=size, **options
    )


def greedy(engine: Engine, n: int = 32) -> list[int]:
    engine.reset()
    return [e.token_id for e in engine.generate(PROMPT, SamplingParams(max_tokens=n, ignore_eos=True))]


@pytest.mark.parametrize("size", SIZES.values(), ids=SIZES.keys())
@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_of_one_matches_fused(
    tiny_model: tuple[Path, Any], fused: Engine, backend: str, size: int
) -> None:
    engine = cached(tiny_model[0], backend, size)
    try:
        assert greedy(engine) == greedy(fused)
        if backend not in ("offload", "offload-prefetch"):  # CPU pairs handed over inside the step
            branch = engine.executor.stream_branch
            assert branch is not None and branch.served() > 0 and engine.executor.stream_off is None
        seq, ref_seq = engine.new_sequence(), fused.new_sequence()
        assert (
            rel_err(
                engine.forward(seq, PROMPT, all_logits=True), fused.forward(ref_seq, PROMPT, all_logits=True)
            )
            < 1e-4
        )
        assert_residency_true(engine)
    finally:
        engine.close()


@pytest.mark.parametrize("size", SIZES.values(), ids=SIZES.keys())
@pytest.mark.parametrize("backend", BACKENDS)
def test_batches_of_three_tokens_match_fused(
    tiny_model: tuple[Path, Any], fused: Engine, backend: str, size: int
) -> None:
    """Three tokens per forward: experts are deduplicated across them, and a step can need more
    distinct experts of one layer than there are slots."""
    engine = cached(tiny_model[0], backend, size)
    ids = [int(i) for i in torch.randint(0, 700, (36,), generator=torch.Generator().manual_seed(7))]
    try:
        seq, ref_seq = engine.new_sequence(), fused.new_sequence()
        engine.forward(seq, ids[:3], all_logits=True)
        fused.forward(ref_seq, ids[:3], all_logits=True)
        for start in range(3, len(ids), 3):
            ours = engine.forward(seq, ids[start : start + 3], all_logits=True)
            ref = fused.forward(ref_seq, ids[start : start + 3], all_logits=True)
            assert rel_err(ours, ref) < 1e-4
            assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    finally:
        engine.close()


@pytest.mark.parametrize("backend", ["offload", "cpu", "hybrid", "offload-prefetch", "hybrid-prefetch"])
def test_counters_add_up(tiny_model: tuple[Path, Any], backend: str) -> None:
    engine = cached(tiny_model[0], backend, 4)
    try:
        seq = engine.new_sequence()
        engine.forward(seq, PROMPT)
        engine.moe_counters.reset()
        steps, fetched_when_missed = 20, []
        for t in range(steps):
            before = engine.moe_counters.by_layer
            engine.forward(seq, [(37 * t) % 700])
            after = engine.moe_counters.by_layer
            missed = after["misses"] > before["misses"]
            fetched_when_missed.append(bool((after["fills"] > before["fills"])[missed].all()))
        c = engine.moe_counters
        totals = c.totals()
        assert c.tokens == steps and c.steps == steps
        assert totals["hits"] + totals["misses"] == steps * 2 * 2  # top-2 in each of 2 MoE layers
        assert totals["fills"] + totals["cpu"] == totals["misses"]
        assert totals["evictions"] <= totals["fills"]
        if backend == "cpu":
            assert totals["fills"] == 0 and totals["cpu"] == totals["misses"]
        if backend.startswith("offload"):
            assert totals["cpu"] == 0
        if backend.startswith("hybrid"):  # q >= 1 whenever there is a miss: no step leaves all to the CPU
            assert all(fetched_when_missed) and totals["fills"] > 0
        assert 0 < c.miss_rate() < 1
        if backend.endswith("prefetch"):  # counted apart: the sums above are the demand's alone
            prefetched = c.by_layer["prefetched"]
            assert prefetched[1] > 0 and prefetched[0] == 0  # layer 0 predicts layer 2; nothing layer 0
            follow = engine.executor.prefetcher.co.follow  # [1, 8, 8]: learned from every pass
            assert int(follow.sum()) == (len(PROMPT) + steps) * 2 * 2
        else:
            assert totals["prefetched"] == 0
    finally:
        engine.close()


def test_cpu_layers_compute_their_misses_on_the_cpu(tiny_model: tuple[Path, Any]) -> None:
    engine = cached(tiny_model[0], "offload-cpu-layer", 4)
    try:
        seq = engine.new_sequence()
        engine.forward(seq, PROMPT)  # a prefill step may need more experts than slots: those go to the CPU
        engine.moe_counters.reset()
        for t in range(12):
            engine.forward(seq, [(53 * t) % 700])
        by_layer = engine.moe_counters.by_layer
        assert by_layer["fills"][1] == 0 and by_layer["cpu"][1] == by_layer["misses"][1] > 0  # layer 2
        assert by_layer["cpu"][0] == 0  # layer 0 fetches
    finally:
        engine.close()
