"""The CPU branch on its native kernel thread and on the Python fallback, against the torch reference."""

from __future__ import annotations

import pytest
import torch

from expert_banks import pool, step
from freetoken.runtime.moe.cpu_branch import CpuBranch
from freetoken.runtime.moe.experts import grouped_experts
from freetoken.runtime.moe.kernels import loader
from freetoken.runtime.moe.kernels.cpu_experts import KernelWorker


@pytest.fixture(autouse=True)
def _fresh_loader():
    loader.load_library.cache_clear()
    yield
    loader.load_library.cache_clear()


@pytest.mark.parametrize("inline", [False, True])
def test_native_branch_equals_reference(inline: bool) -> None:
    p = pool(torch.bfloat16)
    branch = CpuBranch(p, torch.device("cpu"), threads=2)
    try:
        assert branch.native is not None and branch.worker is None
        for layer, seed in ((1, 0), (0, 1), (1, 2)):  # the staging and the worker reused across steps
            x, ids, w = step(seed)
            rows = torch.arange(x.shape[0])
            ref = grouped_experts(x, ids, w, p.gate_up[layer].float(), p.down[layer].float())
            partial = branch.submit(layer, x, rows, ids, w, inline=inline)
            got = branch.merge(torch.zeros_like(x), rows, partial)
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
            assert partial.result() is partial.result()  # waits once
    finally:
        branch.close()


def test_branch_of_selected_rows() -> None:
    p = pool(torch.bfloat16)
    branch = CpuBranch(p, torch.device("cpu"), threads=3)
    try:
        x, ids, w = step(7)
        rows = torch.tensor([0, 3, 4])
        ref = grouped_experts(x[rows], ids[rows], w[rows], p.gate_up[0].float(), p.down[0].float())
        base = torch.randn_like(x)
        got = branch.merge(base, rows, branch.submit(0, x, rows, ids[rows], w[rows]))
        torch.testing.assert_close(got[rows] - base[rows], ref, rtol=1e-4, atol=1e-5)
        assert torch.equal(got[[1, 2]], base[[1, 2]])
    finally:
        branch.close()


def test_python_worker_without_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FREETOKEN_CPU_KERNEL", "torch")
    p = pool(torch.float32)
    branch = CpuBranch(p, torch.device("cpu"), threads=2)
    try:
        assert branch.native is None and branch.worker is not None
        x, ids, w = step(4)
        rows = torch.arange(x.shape[0])
        ref = grouped_experts(x, ids, w, p.gate_up[0], p.down[0])
        got = branch.merge(torch.zeros_like(x), rows, branch.submit(0, x, rows, ids, w))
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    finally:
        branch.close()


def test_worker_takes_one_call_at_a_time() -> None:
    p = pool(torch.bfloat16)
    worker = KernelWorker(loader.load_library())
    x, ids, w = step(5)
    out = torch.empty(x.shape)
    with pytest.raises(RuntimeError, match="no CPU expert call is in flight"):
        worker.wait()
    worker.start(x, ids, w, p.gate_up[0], p.down[0], out, 2)
    with pytest.raises(RuntimeError, match="already in flight"):
        worker.start(x, ids, w, p.gate_up[0], p.down[0], out, 2)
    assert worker.wait() == int((ids >= 0).sum())
    worker.start(x, ids, w, p.gate_up[0], p.down[0], out, 2)
    worker.close()  # waits for the call in flight, then stops the thread
    ref = grouped_experts(x, ids, w, p.gate_up[0].float(), p.down[0].float())
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
