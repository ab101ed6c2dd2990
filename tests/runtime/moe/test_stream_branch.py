"""The CPU branch handed over through flags (the cpu device standing in for the stream): results against
the torch reference, the coordinator across layers and row counts, and failures that surface, never hang."""

from __future__ import annotations

import time

import pytest
import torch

from expert_banks import pool, step
from freetoken.runtime.moe import stream_branch
from freetoken.runtime.moe.experts import grouped_experts
from freetoken.runtime.moe.kernels import loader
from freetoken.runtime.moe.kernels.cpu_experts import bf16_act_reference
from freetoken.runtime.moe.kernels.hand_over import stage_bytes
from freetoken.runtime.moe.stream_branch import StreamBranch

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _fresh_loader():
    loader.load_library.cache_clear()
    yield
    loader.load_library.cache_clear()


def reference(branch: StreamBranch, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor):
    """The plain sum the branch's kernel computes: fp32 activations, or bf16 ones where the CPU's bf16 dot
    instructions take a bf16 pool's experts."""
    p = branch.pool
    if branch.bf16_act:
        return bf16_act_reference(x, ids, w, p.gate_up[layer], p.down[layer])
    return grouped_experts(x, ids, w, p.gate_up[layer].float(), p.down[layer].float())


def hand_over(branch: StreamBranch, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor):
    base = torch.randn_like(x)
    branch.submit(layer, x, ids, w)
    return base, branch.merge(base)


def test_hand_overs_equal_the_reference() -> None:
    p = pool(torch.bfloat16)
    branch = StreamBranch(p, CPU, top_k=3, max_rows=8, threads=2)
    try:
        for layer, seed, t in ((1, 0, 5), (0, 1, 1), (1, 2, 8), (0, 3, 2)):  # sizes shrink and grow
            x, ids, w = step(seed, t=t)
            ref = reference(branch, layer, x, ids, w)
            base, got = hand_over(branch, layer, x, ids, w)
            torch.testing.assert_close(got - base, ref, rtol=1e-4, atol=1e-5)
        assert branch.served() == 4 and branch.failure() is None
    finally:
        branch.close()


def test_pairs_left_to_the_gpu_are_skipped() -> None:
    p = pool(torch.bfloat16)
    branch = StreamBranch(p, CPU, top_k=3, max_rows=8, threads=1)
    try:
        x, ids, w = step(9)
        mine = ids.clone()
        mine[::2] = -1  # even rows: every pair elsewhere
        ref = reference(branch, 0, x, mine, w)
        base, got = hand_over(branch, 0, x, mine, w)
        torch.testing.assert_close(got - base, ref, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got[::2], base[::2], rtol=0, atol=0)
    finally:
        branch.close()


def test_a_layer_with_no_cpu_pair_answers_itself() -> None:
    branch = StreamBranch(pool(torch.bfloat16), CPU, top_k=3, max_rows=8, threads=1)
    try:
        x, ids, w = step(4)
        base, got = hand_over(branch, 1, x, torch.full_like(ids, -1), w)
        assert torch.equal(got, base) and branch.served() == 0  # the coordinator never heard of it
        ref = reference(branch, 0, x, ids, w)
        base, got = hand_over(branch, 0, x, ids, w)  # the next one with pairs is served as ever
        torch.testing.assert_close(got - base, ref, rtol=1e-4, atol=1e-5)
        assert branch.served() == 1 and branch.failure() is None
    finally:
        branch.close()


def test_stage_layout_bytes() -> None:
    assert stage_bytes(1, 128, 3) == 16 + 128 * 4 + 3 * 8 + 3 * 4
    assert stage_bytes(4, 64, 8) == 16 + 4 * (64 * 4 + 8 * 12)


def test_a_kernel_error_surfaces_and_later_hand_overs_still_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stream_branch, "codec_ids", lambda names, *act: (99, 99))  # a codec no build knows
    branch = StreamBranch(pool(torch.bfloat16), CPU, top_k=3, max_rows=8, threads=1)
    try:
        t0 = time.monotonic()
        hand_over(branch, 0, *step(1))
        assert "kernel failed (code -2)" in (branch.failure() or "")
        hand_over(branch, 1, *step(2))  # answered at once by the watchdog
        assert time.monotonic() - t0 < 1.0
        assert branch.served() == 2
    finally:
        branch.close()


def test_a_stuck_branch_is_answered_within_its_stall_time() -> None:
    p = pool(torch.bfloat16)
    branch = StreamBranch(p, CPU, top_k=3, max_rows=8, threads=1, stall_s=0.2)
    try:
        branch.lib.ft_branch_hold(branch.handle, 1.5)
        t0 = time.monotonic()
        hand_over(branch, 0, *step(1))
        elapsed = time.monotonic() - t0
        assert 0.15 < elapsed < 1.0, elapsed
        assert "stuck" in (branch.failure() or "")
        hand_over(branch, 1, *step(2))  # the dead branch answers at once
        assert time.monotonic() - t0 < 1.2
    finally:
        branch.close()


def test_a_stopped_coordinator_is_answered_by_the_watchdog() -> None:
    p = pool(torch.bfloat16)
    branch = StreamBranch(p, CPU, top_k=3, max_rows=8, threads=1)
    try:
        branch.lib.ft_branch_stop_coordinator(branch.handle)
        t0 = time.monotonic()
        hand_over(branch, 0, *step(1))
        assert time.monotonic() - t0 < 1.0
        assert "stopped" in (branch.failure() or "")
    finally:
        branch.close()


def test_a_branch_that_fails_its_check_is_not_used(tiny_model, monkeypatch: pytest.MonkeyPatch) -> None:
    """The executor runs one hand-over before trusting the branch; a wrong result keeps the read-back path,
    which still decodes the reference's tokens."""
    from freetoken.runtime.engine import build_engine
    from freetoken.runtime.sampling import SamplingParams

    def greedy(engine) -> list[int]:
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        return [e.token_id for e in engine.generate([5, 77, 301, 12], params)]

    want = greedy(build_engine(tiny_model[0], device="cpu", dtype="float32", moe_backend="fused"))
    monkeypatch.setattr(StreamBranch, "merge", lambda self, out: out)  # the CPU's result never added
    engine = build_engine(tiny_model[0], device="cpu", dtype="float32", moe_backend="cpu", cache_size=2)
    try:
        assert engine.executor.stream_branch is None
        assert "an eager hand-over gave" in (engine.executor.stream_off or "")
        assert "cannot run inside the step" in (engine.executor.graph_blocker(1) or "")
        assert greedy(engine) == want
    finally:
        engine.close()


def test_timings_account_for_the_layers_served() -> None:
    branch = StreamBranch(pool(torch.bfloat16), CPU, top_k=3, max_rows=8, threads=2)
    try:
        hand_over(branch, 0, *step(1))
        hold = 0.03
        branch.lib.ft_branch_hold(branch.handle, hold)  # inside the take, before the kernel's call
        hand_over(branch, 1, *step(2))
        got = branch.timings(reset=True)
        assert got["layers"] == 2
        assert 0 < got["team_start"] <= got["work_end"] <= got["joined"] <= got["call"] < got["busy"]
        assert got["busy"] - got["call"] >= 0.9 * hold * 1e6 / 2  # the held layer's half of the mean
        assert got["gap"] >= 0
        assert set(branch.timings().values()) == {0.0}
        hand_over(branch, 0, *step(3))
        assert branch.timings()["layers"] == 1
    finally:
        branch.close()
