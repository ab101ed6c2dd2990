"""--vram-budget: the expert slots get what the weights and the KV pool leave, and are re-split at safe
points — halving the budget mid-generation shrinks them (the most recent experts stay) with the same
greedy tokens; restoring it grows them back; a growing KV pool takes room from them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from freetoken.errors import FreeTokenError
from freetoken.runtime.config import MoeConfig, vram_budget_form
from freetoken.runtime.engine import Engine, build_engine
from freetoken.runtime.kv.prefix_cache import PrefixCache
from freetoken.runtime.sampling import SamplingParams
from freetoken.runtime.scheduler import Scheduler
from residency_checks import assert_residency_true
from scheduler_runs import PROMPTS, greedy

POOL = 16  # the tiny model: 2 MoE layers of 8 experts


def offload(folder: Path, **options: Any) -> Engine:
    return build_engine(folder, device="cpu", dtype="float32", moe_backend="offload", **options)


def mib(n_bytes: int) -> str:
    return f"{n_bytes / 2**20!r}MiB"


def budget_for(engine: Engine, slots: int) -> str:
    """A budget leaving room for exactly `slots` expert slots beside what the engine holds now."""
    return mib(engine.memory_report()["held_bytes"] + slots * engine.pool.expert_nbytes)


def test_budget_forms() -> None:
    assert vram_budget_form(None) is None
    assert vram_budget_form("0.5") == ("share", 0.5)
    assert vram_budget_form("50%") == ("share", 0.5)
    assert vram_budget_form("20") == ("bytes", 20 * 2**30)
    assert vram_budget_form("20GiB") == ("bytes", 20 * 2**30)
    assert vram_budget_form("512 MiB") == ("bytes", 512 * 2**20)
    for bad in ("0", "-3", "lots", "20TB", "150%"):
        with pytest.raises(FreeTokenError, match="--vram-budget"):
            MoeConfig(vram_budget=bad)


@pytest.mark.parametrize("backend", ["offload", "hybrid"])
def test_halving_the_budget_mid_generation_keeps_the_tokens(
    tiny_model: tuple[Path, Any], backend: str
) -> None:
    reference = greedy(
        build_engine(tiny_model[0], device="cpu", dtype="float32", moe_backend="fused"), PROMPTS[:3], 24
    )
    options = {"pcie_gbps": 25.0, "host_gbps": 100.0} if backend == "hybrid" else {}
    engine = build_engine(
        tiny_model[0], device="cpu", dtype="float32", moe_backend=backend, cache_size=POOL, **options
    )
    try:
        engine.reserve_slots(3)
        scheduler = Scheduler(engine, PrefixCache(0), max_running=3)
        out: list[list[Any]] = [[] for _ in range(3)]
        for n in range(3):
            scheduler.add(PROMPTS[n], SamplingParams(max_tokens=24, ignore_eos=True), out[n].append)
        sizes = []
        for turn in range(40):
            if turn == 6:
                engine.set_vram_budget(budget_for(engine, POOL // 2))
            if turn == 14:
                engine.set_vram_budget(None)
            if scheduler.has_work():
                scheduler.step()
            sizes.append(engine.num_slots)
            assert_residency_true(engine)
        assert [[e.token_id for e in events] for events in out] == reference
        assert sizes[5] == POOL and sizes[6] == POOL // 2 and sizes[14] == POOL  # shrank, then grew back
        report = engine.memory_report()
        assert report["resplits"] == 2 and report["expert_slots"] == POOL
        assert engine.moe_counters.totals()["evictions"] > 0  # the shrink evicted the least recent
    finally:
        engine.close()


def test_shrinking_keeps_the_most_recently_used(tiny_model: tuple[Path, Any]) -> None:
    engine = offload(tiny_model[0], cache_size=POOL)
    try:
        list(engine.generate(PROMPTS[1], SamplingParams(max_tokens=6, ignore_eos=True)))
        residency = engine.executor.residency
        stamps = residency.stamp.numpy()
        owners = residency.owner.numpy()
        newest = {int(owners[s]) for s in stamps.argsort()[-5:]}
        engine.set_vram_budget(budget_for(engine, 5))
        assert engine.num_slots == 5
        assert set(engine.executor.residency.owner.numpy().tolist()) == newest
        assert_residency_true(engine)
    finally:
        engine.close()


def test_a_growing_kv_pool_takes_room_from_the_slots(tiny_model: tuple[Path, Any]) -> None:
    engine = offload(tiny_model[0], cache_size=POOL, max_seq_len=32)
    try:
        per_sequence = engine.kv_pool.nbytes  # one sequence slot's K/V
        expert = engine.pool.expert_nbytes
        assert 0 < per_sequence <= 4 * expert
        room = 12
        engine.set_vram_budget(budget_for(engine, room))
        assert engine.num_slots == room
        engine.reserve_slots(2)  # one more sequence: its K/V comes out of the slots
        assert engine.num_slots == room - -(-per_sequence // expert)
        assert engine.memory_report()["kv_sequences"] == 2
    finally:
        engine.close()


def test_a_budget_too_small_for_top_k_is_one_clear_error(tiny_model: tuple[Path, Any]) -> None:
    engine = offload(tiny_model[0], cache_size=POOL)
    try:
        with pytest.raises(FreeTokenError, match=r"--vram-budget .* leaves room for 1 expert slots"):
            engine.set_vram_budget(budget_for(engine, 1))
    finally:
        engine.close()


def test_a_budget_alone_sizes_the_slots_on_the_cpu_device(tiny_model: tuple[Path, Any]) -> None:
    engine = build_engine(
        tiny_model[0], device="cpu", dtype="float32", moe_backend="offload", vram_budget="64GiB"
    )
    try:
        assert engine.num_slots == POOL  # the whole pool fits
        assert engine.memory_report()["vram_budget"] == "64GiB"
    finally:
        engine.close()
