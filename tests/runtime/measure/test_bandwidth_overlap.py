"""`bench bw`'s overlap rows through the stream path: every q splits the same misses between the CPU
branch (handed over in the stream) and the fetched slots, and the merged step is their sum."""

from __future__ import annotations

import pytest
import torch

from freetoken.runtime.measure.bandwidth import Bench, ExpertShape
from freetoken.runtime.moe.experts import routed_experts
from freetoken.runtime.moe.kernels.loader import load_library
from freetoken.runtime.moe.slot_bank import SlotBank
from freetoken.runtime.moe.stream_branch import StreamBranch

pytestmark = pytest.mark.skipif(load_library() is None, reason="the CPU expert kernel is not built")

SHAPE = ExpertShape(hidden=64, intermediate=32, top_k=4, num_experts=16)


@pytest.fixture
def bench() -> Bench:
    return Bench(SHAPE, threads=2, bank_bytes=1, reps=1, pin=False)


def step_experts(plan: torch.Tensor, cpu_ids: torch.Tensor) -> list[int]:
    """The experts a step computes: the CPU's pairs and the fills' experts."""
    fetched = [int(e) for e in plan[:, 0] if e >= 0]
    return [int(e) for e in cpu_ids[0] if e >= 0] + fetched


@pytest.mark.parametrize("misses", [1, 3])
def test_every_split_computes_the_same_misses(bench: Bench, misses: int) -> None:
    bank = SlotBank(bench.pool, SHAPE.top_k, bench.device)
    branch = StreamBranch(bench.pool, bench.device, SHAPE.top_k, 1, 2)
    x = torch.randn(1, SHAPE.hidden, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    try:
        for q in range(misses + 1):
            plan, count, cpu_ids, slot_ids, w = bench.stream_inputs(q, misses)
            experts = step_experts(plan, cpu_ids)
            assert int(count) == q and sorted(experts) == sorted(set(experts)) and len(experts) == misses
            out = bench.stream_layer(branch, bank, x, plan, count, cpu_ids, slot_ids, w)
            ids = torch.tensor([experts])
            want = routed_experts(
                x.float(), ids, torch.full((1, misses), 1.0 / misses),
                bench.pool.gate_up[0].float(), bench.pool.down[0].float(),
            )  # fmt: skip
            torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-3)
            # the fetched experts sit in their slots now
            for row in range(q):
                expert, slot = int(plan[row, 0]), int(plan[row, 1])
                assert torch.equal(bank.banks(0)[0][slot], bench.pool.gate_up[0][expert])
    finally:
        branch.close()


def test_rows_for_every_q(bench: Bench) -> None:
    rows = bench.overlap_in_stream(SlotBank(bench.pool, SHAPE.top_k, bench.device), 2)
    assert [r["q"] for r in rows] == [0, 1, 2] and all(r["seconds"] > 0 for r in rows)
