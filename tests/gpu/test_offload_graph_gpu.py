"""Offload decode inside the CUDA graph: the residency policy's compiled kernel equals its torch mirror,
fills read the page-locked pool through UVA (also replayed from a graph), and graph-replayed decode with
misses gives the CPU fp32 reference's greedy tokens for cache sizes {top-k, 25%, 100%} and batches
{1, 3, 8}, with no host sync inside a step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from freetoken.runtime.engine import build_engine
from freetoken.runtime.kv.prefix_cache import PrefixCache
from freetoken.runtime.moe.kernels.expert_fill import fill_slots
from freetoken.runtime.moe.kernels.lru_ensure import lru_ensure, lru_ensure_reference
from freetoken.runtime.moe.pool import HostExpertPool
from freetoken.runtime.moe.residency import ExpertResidency
from freetoken.runtime.sampling import SamplingParams
from freetoken.runtime.scheduler import Scheduler
from residency_checks import assert_residency_true
from scheduler_runs import PROMPTS, decode_steps_without_sync, greedy, running_requests

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def state(residency: ExpertResidency) -> list[torch.Tensor]:
    r = residency
    return [r.slot_of, r.owner, r.stamp, r.clock, r.counters]


@pytest.mark.parametrize("t", [1, 3, 8, 16])
def test_the_compiled_policy_equals_its_mirror(t: int) -> None:
    layers, e, k, s = 4, 128, 8, 180
    gpu, cpu = ExpertResidency(range(layers), e, s, "cuda"), ExpertResidency(range(layers), e, s, "cpu")
    for r in (gpu, cpu):
        r.warm_start()
        r.set_fetch([1.0, 0.5, 0.0, 1.0], 3)
    rng = np.random.default_rng(t)
    for step in range(60):
        layer = step % layers
        ids = torch.from_numpy(np.stack([rng.choice(e // 2, k, replace=False) for _ in range(t)]))
        ids[rng.random((t, k)) < 0.1] = -1
        weights = torch.rand(t, k)
        outs = []
        for r, run in ((gpu, lru_ensure), (cpu, lru_ensure_reference)):
            dev = r.device
            out = (torch.empty(t, k, dtype=torch.int64, device=dev), torch.empty(t * k, 2, dtype=torch.int32,
                   device=dev), torch.empty(1, dtype=torch.int32, device=dev))  # fmt: skip
            run(ids.to(dev), weights.to(dev), layer, r.slot_of, r.owner, r.stamp, r.clock, r.fetch,
                r.max_fetch, r.counters, *out)  # fmt: skip
            outs.append(out)
        for got, want in zip([*outs[0], *state(gpu)], [*outs[1], *state(cpu)], strict=True):
            assert torch.equal(got.cpu(), want), step


def test_fills_read_the_registered_pool_and_replay_from_a_graph() -> None:
    e, h, i = 8, 256, 96
    pool = HostExpertPool.allocate((0,), e, h, i, torch.bfloat16)
    pool.gate_up[0].copy_(torch.randn(e, 2 * i, h))
    pool.down[0].copy_(torch.randn(e, h, i))
    pool.mark_filled()
    pool.pin()
    slots_gu = torch.zeros(6, 2 * i, h, dtype=torch.bfloat16, device="cuda")
    slots_dn = torch.zeros(6, h, i, dtype=torch.bfloat16, device="cuda")
    plan = torch.full((4, 2), -1, dtype=torch.int32, device="cuda")
    count = torch.zeros(1, dtype=torch.int32, device="cuda")
    graph = torch.cuda.CUDAGraph()
    fill_slots(plan, count, pool.gate_up[0], pool.down[0], slots_gu, slots_dn)  # compiled before capture
    with torch.cuda.graph(graph):
        fill_slots(plan, count, pool.gate_up[0], pool.down[0], slots_gu, slots_dn)
    for pairs in ([(3, 0), (5, 4)], [(7, 1), (0, 2), (2, 5)]):
        plan.fill_(-1)
        plan[: len(pairs)] = torch.tensor(pairs, dtype=torch.int32)
        count.fill_(len(pairs))
        graph.replay()
        torch.cuda.synchronize()
        for expert, slot in pairs:
            assert torch.equal(slots_gu[slot].cpu(), pool.gate_up[0][expert])
            assert torch.equal(slots_dn[slot].cpu(), pool.down[0][expert])


@pytest.mark.parametrize("prefetch", [0, 2], ids=["demand", "prefetch"])
@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("slots", [2, 4, 16], ids=["top-k", "quarter", "whole"])
def test_offload_graph_decode_with_misses_equals_the_cpu_reference(
    tiny_model: tuple[Path, Any], slots: int, batch: int, prefetch: int
) -> None:
    prompts = PROMPTS[:batch]
    want = greedy(build_engine(tiny_model[0], device="cpu", dtype="float32", moe_backend="fused"), prompts)
    engine = build_engine(
        tiny_model[0], device="cuda", dtype="float32", moe_backend="offload", cache_size=slots,
        prefetch=prefetch,
    )  # fmt: skip
    try:
        assert greedy(engine, prompts) == want
        assert engine.decoder is not None
        if engine.executor.graph_blocker(4 if batch == 3 else batch) is None:
            assert engine.decoder.replays > 0
        totals = engine.moe_counters.totals()
        assert totals["misses"] > 0 if slots < 16 else True
        assert totals["cpu"] == 0 or slots * 1 < batch * 2 * 2
        assert totals["prefetched"] > 0 if prefetch and slots == 2 else prefetch or totals["prefetched"] == 0
        assert_residency_true(engine)
    finally:
        engine.close()


def test_an_offload_step_with_misses_issues_no_host_sync(tiny_model: tuple[Path, Any]) -> None:
    engine = build_engine(tiny_model[0], device="cuda", dtype="bfloat16", moe_backend="offload", cache_size=2)
    try:
        requests = running_requests(engine, PROMPTS[1:2])
        misses = engine.moe_counters.totals()["misses"]
        decode_steps_without_sync(engine, requests, 8)
        assert engine.moe_counters.totals()["misses"] > misses  # the steps did miss, inside the graph
        assert engine.decoder is not None and engine.decoder.replays >= 8
    finally:
        engine.close()


def test_halving_the_budget_mid_generation_recaptures_and_keeps_the_tokens(
    tiny_model: tuple[Path, Any],
) -> None:
    want = greedy(
        build_engine(tiny_model[0], device="cpu", dtype="float32", moe_backend="fused"), PROMPTS[:2], 20
    )
    engine = build_engine(tiny_model[0], device="cuda", dtype="float32", moe_backend="offload", cache_size=16)
    try:
        engine.reserve_slots(2)
        scheduler = Scheduler(engine, PrefixCache(0), max_running=2)
        out: list[list[Any]] = [[], []]
        for n in range(2):
            scheduler.add(PROMPTS[n], SamplingParams(max_tokens=20, ignore_eos=True), out[n].append)
        for turn in range(30):
            if turn == 5:
                held = engine.memory_report()["held_bytes"]
                engine.set_vram_budget(f"{(held + 8 * engine.pool.expert_nbytes) / 2**20!r}MiB")
                assert engine.num_slots == 8
            if turn == 12:
                engine.set_vram_budget(None)
                assert engine.num_slots == 16
            if scheduler.has_work():
                scheduler.step()
        assert [[e.token_id for e in events] for events in out] == want
        assert engine.decoder is not None and engine.decoder.replays > 10
        assert_residency_true(engine)
    finally:
        engine.close()
