"""The compiled CPU expert kernel against the torch reference, and its clean fallback."""

from __future__ import annotations

import pytest
import torch

from freetoken.runtime.moe.experts import grouped_experts
from freetoken.runtime.moe.kernels import loader
from freetoken.runtime.moe.kernels.cpu_experts import (
    cpu_experts,
    kernel_available,
    kernel_takes,
    read_bandwidth,
    run_kernel,
)
from oracle import rel_err


def banks(e: int = 12, h: int = 256, i: int = 96, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(e, 2 * i, h, generator=gen) * 0.1).bfloat16()
    down = (torch.randn(e, h, i, generator=gen) * 0.1).bfloat16()
    return gate_up, down


def routing(t: int, k: int, e: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, 256, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    return x, ids, torch.rand(t, k, generator=gen)


@pytest.fixture(autouse=True)
def _fresh_loader():
    loader.load_library.cache_clear()
    yield
    loader.load_library.cache_clear()


def test_kernel_compiles_here() -> None:
    assert kernel_available(), "CI machines have a C compiler with OpenMP: the fast path must build"


@pytest.mark.parametrize(
    ("t", "k", "threads"), [(1, 8, 2), (3, 4, 2), (5, 2, 2), (1, 8, 3), (2, 5, 7), (1, 3, 1)]
)
def test_kernel_equals_reference(t: int, k: int, threads: int) -> None:
    """Thread counts that split the 256 output rows unevenly (3, 7) as well as evenly."""
    gate_up, down = banks()
    x, ids, w = routing(t, k, 12, seed=t)
    ids[0, 0] = -1  # a pair another branch computes
    ref = grouped_experts(x, ids, w, gate_up.float(), down.float())  # fp32 math on the same bf16 weights
    out = cpu_experts(x, ids, w, gate_up, down, threads=threads)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("t", "k"), [(1, 8), (5, 3)])
def test_f32_banks_equal_reference(t: int, k: int) -> None:
    """fp32 banks (the f32 codec: an fp32 pool, as --dtype float32 keeps) through the kernel, not torch."""
    gate_up, down = (bank.float() for bank in banks(seed=4))
    gate_up = gate_up + torch.randn_like(gate_up) * 1e-3  # values bf16 cannot hold
    x, ids, w = routing(t, k, 12, seed=t)
    ref = grouped_experts(x, ids, w, gate_up, down)
    assert kernel_takes(gate_up, down, ("f32", "f32")) and not kernel_takes(gate_up, down)
    out = torch.empty_like(x)
    assert run_kernel(loader.load_library(), x, ids, w, gate_up, down, out, 2, codecs=("f32", "f32")) == t * k
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("h", "i", "unit_bytes", "threads"),
    [(256, 96, 1, 3), (200, 72, 3000, 4), (256, 96, 20_000, 7), (96, 40, 500, 16)],
)
def test_units_and_waits_equal_reference(h: int, i: int, unit_bytes: int, threads: int) -> None:
    """Units of one row up to a few: many G units per expert, D units that wait for them, more threads
    than some experts have units; sizes no multiple of the accumulator width; an expert shared by
    several tokens, a token with no pair of this branch. The output starts poisoned."""
    gen = torch.Generator().manual_seed(h + i + threads)
    e = 9
    gate_up = (torch.randn(e, 2 * i, h, generator=gen) * 0.1).bfloat16()
    down = (torch.randn(e, h, i, generator=gen) * 0.1).bfloat16()
    x = torch.randn(4, h, generator=gen)
    ids = torch.tensor([[3, 0, 8], [3, 5, -1], [-1, -1, -1], [8, 3, 1]])
    w = torch.rand(4, 3, generator=gen)
    ref = grouped_experts(x, ids, w, gate_up.float(), down.float())
    out = torch.full((4, h), float("nan"))
    trace = torch.full((threads + 1, 4), -7.0, dtype=torch.float64)
    lib = loader.load_library()
    assert run_kernel(lib, x, ids, w, gate_up, down, out, threads, unit_bytes, trace) == 8
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    assert torch.equal(out[2], torch.zeros(h))
    g_rows = max(1, unit_bytes // (4 * h))
    d_rows = max(1, unit_bytes // (2 * i))
    units = 5 * (-(-i // g_rows) + -(-h // d_rows))  # five distinct experts
    assert int(trace[:threads, 3].sum()) == units
    assert (trace[:threads, 1] >= 0).all() and (trace[:threads, 2] >= 0).all()
    joined, end, *zeros = trace[threads].tolist()  # the call's phases
    assert trace[:threads, 1].max() <= joined <= end and zeros == [0.0, 0.0]


@pytest.mark.parametrize(("t", "h", "i", "threads"), [(37, 203, 45, 3), (21, 256, 96, 2), (6, 64, 33, 4)])
def test_batches_equal_reference(t: int, h: int, i: int, threads: int) -> None:
    """Many pairs per expert (groups of four and of GROUP, with remainders), odd lengths (the last
    element outside the even/odd split), a few skipped pairs."""
    gen = torch.Generator().manual_seed(t)
    e, k = 5, 3
    gate_up = (torch.randn(e, 2 * i, h, generator=gen) * 0.1).bfloat16()
    down = (torch.randn(e, h, i, generator=gen) * 0.1).bfloat16()
    x = torch.randn(t, h, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    ids[::4, 1] = -1
    w = torch.rand(t, k, generator=gen)
    ref = grouped_experts(x, ids, w, gate_up.float(), down.float())
    out = torch.full((t, h), float("nan"))
    run_kernel(loader.load_library(), x, ids, w, gate_up, down, out, threads, 6000)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_all_pairs_skipped_gives_zeros() -> None:
    gate_up, down = banks()
    x, ids, w = routing(2, 3, 12, seed=9)
    out = cpu_experts(x, torch.full_like(ids, -1), w, gate_up, down, out=torch.full((2, 256), 5.0))
    assert torch.equal(out, torch.zeros_like(out))


def test_torch_path_when_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FREETOKEN_CPU_KERNEL", "torch")
    assert not kernel_available()
    gate_up, down = banks()
    x, ids, w = routing(3, 4, 12, seed=3)
    want = grouped_experts(x.bfloat16(), ids, w.bfloat16(), gate_up, down).float()
    torch.testing.assert_close(cpu_experts(x, ids, w, gate_up, down), want)


def test_missing_compiler_warns_once_and_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader, "find_compiler", lambda: None)
    with pytest.warns(UserWarning, match="no C compiler"):
        assert loader.load_library() is None
    gate_up, down = banks()
    x, ids, w = routing(1, 8, 12, seed=1)
    ref = grouped_experts(x, ids, w, gate_up.float(), down.float())
    assert rel_err(cpu_experts(x, ids, w, gate_up, down), ref) < 2e-2  # the torch path computes in bf16


def test_broken_build_warns(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("FREETOKEN_HOME", str(tmp_path))
    monkeypatch.setattr(loader, "FLAGS", ("-fno-such-flag-anywhere",))
    with pytest.warns(UserWarning, match="CPU expert kernel unavailable"):
        assert loader.load_library() is None


def test_read_bandwidth_is_positive() -> None:
    assert read_bandwidth(8 << 20, threads=1, reps=2) > 1e8


def test_many_cores_or_avx512_build_without_software_prefetch(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """Prefetch stays where at most 4 cores are allowed on a CPU without AVX-512; AVX-512 drops it; 16 cores
    drop it but for the Q8_0 dots', and that variant still builds and computes the reference (every dot
    header honours PREFETCH 0)."""
    from freetoken.runtime.measure import cpu_share

    avx2, avx512 = frozenset({"avx2", "fma"}), frozenset({"avx2", "avx512f"})
    assert loader.prefetch_defines(2, avx2) == ()
    many = ("-DPREFETCH=0", "-DQ8_PREFETCH=2048", "-DQ8_PREFETCH_HINT=2")
    assert loader.prefetch_defines(2, avx512) == ("-DPREFETCH=0",)
    assert loader.prefetch_defines(16, avx2) == loader.prefetch_defines(16, avx512) == many
    monkeypatch.setattr(cpu_share, "allowed_cores", lambda: tuple(range(16)))
    assert loader.machine_defines() == many
    monkeypatch.setenv("FREETOKEN_HOME", str(tmp_path))
    lib = loader.load_library()
    assert lib is not None
    gate_up, down = banks()
    x, ids, w = routing(3, 2, gate_up.shape[0], seed=5)
    want = grouped_experts(x, ids, w, gate_up.float(), down.float())
    out = torch.empty(3, 256)
    run_kernel(lib, x, ids, w, gate_up, down, out, threads=2)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)


def test_many_bf16_rows_take_the_matrix_units_where_the_cpu_has_them() -> None:
    """From MATRIX_ROWS bf16 rows over bf16 banks, a CPU with bf16 dot units computes through torch's bf16
    products (gate/up rounded to bf16, as a bf16 model's experts do): within bf16 of the fp32 reference;
    fewer rows, fp32 rows, quantized banks or int8 activations stay with the kernel."""
    from freetoken.runtime.moe.kernels.cpu_experts import BF16, MATRIX_ROWS, matrix_units_take

    many = torch.zeros(MATRIX_ROWS, 8, dtype=torch.bfloat16)
    assert matrix_units_take(many, BF16, False) == loader.bf16_dot_units()
    assert not matrix_units_take(many[:-1], BF16, False)
    assert not matrix_units_take(many.float(), BF16, False)
    assert not matrix_units_take(many, ("Q8_0", "Q8_0"), False)
    assert not matrix_units_take(many, BF16, True)
    gate_up, down = banks()
    x, ids, w = routing(MATRIX_ROWS + 5, 2, gate_up.shape[0], seed=11)
    got = cpu_experts(x.bfloat16(), ids, w, gate_up, down, 2)
    want = grouped_experts(x.bfloat16().float(), ids, w, gate_up.float(), down.float())
    assert got.dtype == torch.float32
    assert float((got - want).norm() / want.norm()) < 2e-2


@pytest.mark.parametrize(("t", "h", "i", "threads"), [(1, 256, 96, 2), (9, 203, 45, 3), (70, 1024, 512, 2)])
def test_bf16_activations_equal_their_reference(t: int, h: int, i: int, threads: int) -> None:
    """bf16 banks against bf16 activations (the bf16 dot instructions where the CPU has them, widened
    dots elsewhere) equal the plain sum that rounds x and the activation to bf16 (bf16_act_reference),
    tails of 32 and 64 included; the fp32-activation sum is measurably farther (the test can tell them
    apart). A bf16 model on such a CPU takes this path by default; an fp32 one never does."""
    from freetoken.runtime.moe.kernels.cpu_experts import bf16_act_reference, bf16_activations

    gen = torch.Generator().manual_seed(t)
    e, k = 6, 4
    gate_up = (torch.randn(e, 2 * i, h, generator=gen) * 0.1).bfloat16()
    down = (torch.randn(e, h, i, generator=gen) * 0.1).bfloat16()
    x = torch.randn(t, h, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    ids[::3, 2] = -1
    w = torch.rand(t, k, generator=gen)
    want = bf16_act_reference(x, ids, w, gate_up, down)
    got = cpu_experts(x.float(), ids, w, gate_up, down, threads, bf16_act=True)
    scale = float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * scale)
    fp32_act = grouped_experts(x.float(), ids, w, gate_up.float(), down.float())
    assert float((fp32_act - want).abs().max()) > 3e-4 * scale
    assert bf16_activations(torch.bfloat16) == loader.bf16_dot_units() and not bf16_activations(torch.float32)


def test_every_header_a_source_includes_is_in_the_build_key() -> None:
    """The library is rebuilt when a source or header changes (its cache key hashes them): a header that a
    source includes but HEADERS does not name would leave a stale build in place after an edit."""
    import re

    named = {h.name for h in loader.HEADERS}
    todo, seen = [s for s in loader.SOURCES], set()
    while todo:
        text = todo.pop().read_text()
        for name in re.findall(r'#include "([^"]+)"', text):
            if name not in seen:
                seen.add(name)
                todo.append(loader.HERE / name)
    assert seen <= named, f"headers missing from loader.HEADERS: {sorted(seen - named)}"
