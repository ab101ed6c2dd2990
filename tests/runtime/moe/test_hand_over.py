"""The hand-over kernels (Triton's interpreter runs their bodies on CPU tensors here) against their torch
references: the stage's bytes and flags with and without a CPU pair, and the merge."""

from __future__ import annotations

import pytest
import torch

from freetoken.runtime.moe.kernels import hand_over
from freetoken.runtime.moe.kernels.hand_over import (
    DistinctCount,
    merge_hand_over,
    merge_reference,
    stage_bytes,
    stage_hand_over,
    stage_reference,
)

pytestmark = pytest.mark.skipif(not hand_over._body()[1], reason="Triton's interpreter is not on")


def case(t: int, h: int, k: int, cpu_pairs: bool, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(t * 100 + h + k)
    x = torch.randn(t, h, generator=g).to(dtype)
    ids = torch.randint(0, 7, (t, k), generator=g)
    ids[torch.rand(t, k, generator=g) < 0.5] = -1
    if cpu_pairs:
        ids[-1, -1] = 3
    else:
        ids.fill_(-1)
    w = torch.rand(t, k, generator=g).to(dtype)
    return x, ids, w


@pytest.mark.parametrize("t,h,k", [(1, 64, 3), (3, 130, 8), (5, 2048, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_hand_over_with_cpu_pairs_stages_the_reference_bytes_then_submits(t, h, k, dtype) -> None:
    x, ids, w = case(t, h, k, True, dtype)
    size = -(-stage_bytes(t, h, k) // 8) * 8
    want = torch.full((size,), 0xAB, dtype=torch.uint8)
    assert stage_reference(x, ids, w, want, row=4)
    got = torch.full((size,), 0xAB, dtype=torch.uint8)
    flags = torch.zeros(2, dtype=torch.int32)
    stage_hand_over(x, ids, w, got, flags, row=4)
    assert torch.equal(got, want)
    assert flags.tolist() == [1, 0]


def test_a_hand_over_without_cpu_pairs_answers_itself_and_leaves_the_stage() -> None:
    x, ids, w = case(2, 64, 4, False)
    stage = torch.full((-(-stage_bytes(2, 64, 4) // 8) * 8,), 0xAB, dtype=torch.uint8)
    assert not stage_reference(x, ids, w, stage.clone(), row=1)
    flags = torch.zeros(2, dtype=torch.int32)
    stage_hand_over(x, ids, w, stage, flags, row=1)
    assert flags.tolist() == [0, 1]
    assert bool((stage == 0xAB).all())


@pytest.mark.parametrize("cpu_pairs", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_merge_adds_the_result_only_after_cpu_pairs(cpu_pairs: bool, dtype: torch.dtype) -> None:
    out, ids, _ = case(3, 1500, 4, cpu_pairs, dtype)
    result = torch.randn(8, 1500)  # longer than the hand-over: rows past it are never read
    got = merge_hand_over(out, result, ids)
    want = merge_reference(out, result, ids)
    assert got.dtype == dtype
    # fp32 exact; bf16 within the two roundings (Triton's interpreter rounds fp32 -> bf16 toward zero)
    atol = 0.0 if dtype == torch.float32 else 2 * 2.0**-5  # values of |x| < 8: ulp <= 2**-5
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=atol)
    assert torch.equal(got, out) != cpu_pairs


@pytest.mark.parametrize("t,k", [(1, 8), (3, 8), (8, 8), (40, 8)])  # 40 x 8 pairs: counted by torch
@pytest.mark.parametrize("cpu_pairs", [True, False])
def test_a_hand_over_counts_its_distinct_experts_into_two_counter_words(t, k, cpu_pairs) -> None:
    x, ids, w = case(t, 32, k, cpu_pairs)
    ids[0, :2] = 5  # a repeat within a row; case() also repeats ids across rows
    if not cpu_pairs:
        ids[0, :2] = -1
    want = len({int(i) for i in ids.flatten() if i >= 0})
    stage = torch.zeros(-(-stage_bytes(t, 32, k) // 8) * 8, dtype=torch.uint8)
    for run in (stage_hand_over, stage_reference):
        row = torch.tensor([10, 20, 30, 40, 50], dtype=torch.int64)
        count = DistinctCount(row, (1, 4), num_experts=7)
        if run is stage_hand_over:
            run(x, ids, w, stage, torch.zeros(2, dtype=torch.int32), 0, count)
        else:
            run(x, ids, w, stage.clone(), 0, count)
        assert row.tolist() == [10, 20 + want, 30, 40, 50 + want], run.__name__


@pytest.mark.parametrize("cpu_pairs", [True, False])
def test_a_merge_with_no_device_part_reads_nothing_of_out(cpu_pairs: bool) -> None:
    out, ids, _ = case(2, 300, 4, cpu_pairs)
    garbage = torch.full_like(out, float("nan"))
    result = torch.randn(4, 300)
    got = merge_hand_over(garbage, result, ids, out_is_zero=True)
    want = merge_reference(torch.zeros_like(out), result, ids)
    assert torch.equal(got, want)
    assert torch.equal(merge_reference(garbage, result, ids, out_is_zero=True), want)
