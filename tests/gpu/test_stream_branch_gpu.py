"""The CPU branch inside the CUDA graph: hand-overs by stream flag writes and waits replay from a graph
with the C kernel's results; cpu, hybrid and offload with CPU layers decode by graph replay to the CPU
fp32 reference's greedy tokens for cache sizes {none, top-k, 25%, 100%} and batches {1, 3, 8}, with no
host sync inside a step; a branch that dies surfaces as an error within a second and decoding goes on."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from expert_banks import pool, step
from freetoken.runtime.engine import build_engine
from freetoken.runtime.moe.experts import grouped_experts
from freetoken.runtime.moe.kernels.cpu_experts import bf16_act_reference
from freetoken.runtime.moe.stream_branch import StreamBranch
from residency_checks import assert_residency_true
from scheduler_runs import PROMPTS, decode_steps_without_sync, greedy, running_requests

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")
BACKENDS = {
    "cpu": {},
    "hybrid": {"pcie_gbps": 25.0, "host_gbps": 100.0},
    "offload-cpu-layer": {"cpu_layers": "2,"},
}


def test_hand_overs_replay_from_a_graph() -> None:
    p = pool(torch.bfloat16)
    p.pin()
    branch = StreamBranch(p, CUDA, top_k=3, max_rows=8, threads=2)
    try:
        x = torch.zeros(5, 128, device="cuda")
        ids = torch.zeros(5, 3, dtype=torch.int64, device="cuda")
        w = torch.zeros(5, 3, device="cuda")
        base = torch.zeros(5, 128, device="cuda")

        def body() -> torch.Tensor:
            out = base
            for layer in (0, 1):  # two hand-overs in one step, as two MoE layers make
                branch.submit(layer, x, ids, w)
                out = branch.merge(out * 0.5)
            return out

        body()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            result = body()
        for seed in range(6):
            xs, i, ws = step(seed)
            if seed % 3 == 2:  # no CPU pair in the step: both layers answer themselves
                i = torch.full_like(i, -1)
            x.copy_(xs), ids.copy_(i), w.copy_(ws), base.copy_(torch.randn(5, 128))
            want = base.cpu()
            for layer in (0, 1):  # the sum the branch's kernel computes (bf16 activations on bf16-dot CPUs)
                if not bool((i >= 0).any()):
                    part = torch.zeros_like(want)
                elif branch.bf16_act:
                    part = bf16_act_reference(xs, i, ws, p.gate_up[layer], p.down[layer])
                else:
                    part = grouped_experts(xs, i, ws, p.gate_up[layer].float(), p.down[layer].float())
                want = want * 0.5 + part
            graph.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(result.cpu(), want, rtol=1e-4, atol=1e-4)
        # the capture itself ran none; the steps with no CPU pair never reached the coordinator
        assert branch.served() == 2 * (1 + 4) and branch.failure() is None
    finally:
        branch.close()


def cached(folder: Path, backend: str, slots: int, dtype: str = "float32"):
    options = dict(BACKENDS[backend])
    return build_engine(
        folder, device="cuda", dtype=dtype, moe_backend=backend.split("-")[0], cache_size=slots, **options
    )


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("slots", [0, 2, 4, 16], ids=["none", "top-k", "quarter", "whole"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_graph_decode_with_a_cpu_branch_equals_the_cpu_reference(
    tiny_model: tuple[Path, Any], backend: str, slots: int, batch: int
) -> None:
    if slots == 0 and backend != "cpu":
        pytest.skip("only the cpu backend runs with no slot")
    prompts = PROMPTS[:batch]
    want = greedy(build_engine(tiny_model[0], device="cpu", dtype="float32", moe_backend="fused"), prompts)
    engine = cached(tiny_model[0], backend, slots)
    try:
        assert greedy(engine, prompts) == want
        executor = engine.executor
        assert executor.graph_blocker(4 if batch == 3 else batch) is None, executor.stream_off
        assert engine.decoder is not None and engine.decoder.replays > 0
        if engine.moe_counters.totals()["cpu"]:
            assert executor.stream_branch is not None and executor.stream_branch.served() > 0
        if slots:
            assert_residency_true(engine)
    finally:
        engine.close()


@pytest.mark.parametrize("backend", ["cpu", "hybrid"])
def test_a_step_with_a_cpu_branch_issues_no_host_sync(tiny_model: tuple[Path, Any], backend: str) -> None:
    engine = cached(tiny_model[0], backend, 2, dtype="bfloat16")
    try:
        requests = running_requests(engine, PROMPTS[1:3])
        served = engine.executor.stream_branch.served()
        decode_steps_without_sync(engine, requests, 8)
        assert engine.executor.stream_branch.served() >= served + 8 * 2  # two MoE layers a step
        assert engine.decoder is not None and engine.decoder.replays >= 8
    finally:
        engine.close()


def test_with_no_slot_the_hand_over_counts_each_steps_distinct_experts(tiny_model: tuple[Path, Any]) -> None:
    """The stage kernel adds a layer step's distinct experts to misses and cpu: one request, top-2, so
    each decode step of each MoE layer adds exactly 2; three requests (a graph of four rows) 2 to 8."""
    for prompts, low, high in ((PROMPTS[:1], 2, 2), (PROMPTS[:3], 2, 8)):
        engine = cached(tiny_model[0], "cpu", 0, dtype="bfloat16")
        try:
            requests = running_requests(engine, prompts)
            decode_steps_without_sync(engine, requests, 1)  # the graph captured
            engine.moe_counters.reset()
            decode_steps_without_sync(engine, requests, 8)
            by_layer = engine.moe_counters.by_layer
            assert engine.decoder is not None and engine.decoder.replays >= 8
            assert (by_layer["hits"] == 0).all() and (by_layer["fills"] == 0).all()
            assert (by_layer["cpu"] == by_layer["misses"]).all()
            assert ((by_layer["misses"] >= 8 * low) & (by_layer["misses"] <= 8 * high)).all(), by_layer
        finally:
            engine.close()


def test_a_dead_branch_surfaces_within_a_second_and_decoding_goes_on(tiny_model: tuple[Path, Any]) -> None:
    reference = build_engine(tiny_model[0], device="cpu", dtype="float32", moe_backend="fused")
    want = greedy(reference, PROMPTS[:1], 20)
    engine = cached(tiny_model[0], "cpu", 2)
    try:
        requests = running_requests(engine, PROMPTS[:1])
        branch = engine.executor.stream_branch
        branch.lib.ft_branch_stop_coordinator(branch.handle)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="stopped"):
            engine.decode_tokens(requests)
        assert time.monotonic() - t0 < 1.0
        assert engine.executor.graph_blocker(1) is not None  # later steps read routing back
        engine.reset()
        assert greedy(engine, PROMPTS[:1], 20) == want
    finally:
        engine.close()
