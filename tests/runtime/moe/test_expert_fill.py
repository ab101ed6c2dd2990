"""The slot fill kernel against its plain-torch reference under Triton's interpreter on CPU (the kernel body
the GPU compiles): bit-equal slots for live plan rows, every other slot untouched."""

from __future__ import annotations

import pytest
import torch

from freetoken.runtime.moe.kernels import expert_fill
from freetoken.runtime.moe.kernels.expert_fill import (
    FillBlocks,
    _HostWords,
    _word_dtype,
    fill_kernel_available,
    fill_slots,
    fill_slots_reference,
)

pytestmark = pytest.mark.skipif(not fill_kernel_available("cpu"), reason="needs Triton's interpreter")

SMALL = FillBlocks(block=64, iters=2)  # many chunks per expert and a masked tail at these shapes
SENTINEL = 0x5A5A  # the bits every destination word starts with


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Any bit pattern of `dtype` (NaNs and infinities included), so only a bit-exact copy matches."""
    nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).view(dtype).view(shape)


def host_banks(e: int, h: int, i: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [E, 2I, H], down [E, H, I]) of random bits."""
    g = torch.Generator().manual_seed(seed)
    return random_bits((e, 2 * i, h), dtype, g), random_bits((e, h, i), dtype, g)


def slot_banks(s: int, h: int, i: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [S, 2I, H], down [S, H, I]), every byte pair SENTINEL."""
    return sentinel((s, 2 * i, h), dtype), sentinel((s, h, i), dtype)


def sentinel(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    return torch.full((nbytes // 2,), SENTINEL, dtype=torch.int16).view(dtype).view(shape)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def make_plan(rows: list[tuple[int, int]], p: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """plan [p, 2] int32: `rows`, then -1 padding; count [1] int32."""
    plan = torch.full((p, 2), -1, dtype=torch.int32)
    plan[: len(rows)] = torch.tensor(rows, dtype=torch.int32).reshape(-1, 2)
    return plan, torch.tensor([count], dtype=torch.int32)


def assert_filled(
    rows: list[tuple[int, int]],
    src: tuple[torch.Tensor, torch.Tensor],
    dst: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """Slots named by `rows` hold their expert's bits; every other slot still holds the sentinel."""
    filled = {slot: expert for expert, slot in rows}
    for src_bank, dst_bank in zip(src, dst, strict=True):
        for slot in range(dst_bank.shape[0]):
            want = src_bank[filled[slot]] if slot in filled else None
            got = bits(dst_bank[slot])
            if want is None:
                assert bool((got.view(torch.int16) == SENTINEL).all()), f"slot {slot} was written"
            else:
                assert torch.equal(got, bits(want)), f"slot {slot} does not hold expert {filled[slot]}"


def fill_both(
    plan: torch.Tensor,
    count: torch.Tensor,
    src: tuple[torch.Tensor, torch.Tensor],
    s: int,
    blocks: FillBlocks,
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """(kernel's slot banks, reference's slot banks), both from sentinel banks."""
    _, h, i = src[1].shape
    got, want = slot_banks(s, h, i, src[0].dtype), slot_banks(s, h, i, src[0].dtype)
    fill_slots(plan, count, *src, *got, blocks=blocks)
    fill_slots_reference(plan, count, *src, *want)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(bits(g), bits(w))
    return got, want


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(("e", "h", "i"), [(4, 64, 32), (16, 64, 32), (4, 40, 24), (16, 33, 7)])
@pytest.mark.parametrize("live", ["none", "one", "all"])
def test_matches_the_reference(dtype: torch.dtype, e: int, h: int, i: int, live: str) -> None:
    s = e // 2 + 2
    g = torch.Generator().manual_seed(e * 1000 + h * 10 + i)
    experts = torch.randperm(e, generator=g)[: s - 1].tolist()
    slots = torch.randperm(s, generator=g)[: s - 1].tolist()
    rows = list(zip(experts, slots, strict=True))
    p = len(rows) + 2  # two -1 padding rows after the real ones
    n = {"none": 0, "one": 1, "all": p}[live]
    plan, count = make_plan(rows, p, n)
    src = host_banks(e, h, i, dtype, seed=e + h + i)
    for blocks in (FillBlocks(), SMALL):
        got, _ = fill_both(plan, count, src, s, blocks)
        assert_filled(rows[:n], src, got)


def test_word_size_is_the_widest_that_divides_runs_and_addresses() -> None:
    gate_up, _ = host_banks(4, 64, 32, torch.bfloat16, seed=1)
    assert _word_dtype(64 * 64 * 2, 64 * 64 * 2, gate_up) == torch.int64
    assert _word_dtype(2 * 7 * 33 * 2, 2 * 7 * 33 * 2, gate_up) == torch.int32  # 924 bytes
    assert _word_dtype(33 * 7 * 2, 33 * 7 * 2, gate_up) == torch.int16  # 462 bytes
    assert (
        _word_dtype(64 * 64 * 2, 64 * 64 * 2, gate_up.reshape(-1)[2:]) == torch.int32
    )  # the view starts 4 bytes in
    assert _word_dtype(64 * 64 * 2, 64 * 64 * 2, gate_up.reshape(-1)[1:]) == torch.int16
    assert _word_dtype(7, 7, gate_up) == torch.uint8
    assert _word_dtype(64 * 64 * 2, 64 * 64 * 2 + 4, gate_up) == torch.int32  # slots 4 bytes past an int64


def test_views_of_longer_slots_take_the_run_at_each_slot_start() -> None:
    """Flat uint8 slots longer than the layer's experts (slot_bank.py's banks of codec rows, where layers
    differ): the kernel fills the first run bytes of each planned slot, as the reference does, and leaves
    the rest of every slot alone."""
    e, s, two_i, i = 5, 4, 16, 8
    for gu_row, dn_row, gu_slot, dn_slot in (
        (36, 20, 36 * 16 + 40, 20 * 8 + 8),
        (34, 34, 34 * 16 + 6, 34 * 8),
    ):
        g = torch.Generator().manual_seed(gu_row)
        h = i  # rows of the down bank
        src = (random_bits((e, two_i, gu_row), torch.uint8, g), random_bits((e, h, dn_row), torch.uint8, g))
        rows = [(4, 2), (0, 0), (3, 3)]
        plan, count = make_plan(rows, 4, 3)
        outs = []
        for fill in (fill_slots, fill_slots_reference):
            flat = (sentinel((s, gu_slot), torch.uint8), sentinel((s, dn_slot), torch.uint8))
            views = (
                flat[0].as_strided((s, two_i, gu_row), (gu_slot, gu_row, 1)),
                flat[1].as_strided((s, h, dn_row), (dn_slot, dn_row, 1)),
            )
            kwargs = {"blocks": SMALL} if fill is fill_slots else {}
            fill(plan, count, *src, *views, **kwargs)
            assert_filled(rows, src, views)
            for bank, run in zip(flat, (two_i * gu_row, h * dn_row), strict=True):
                assert bool((bank[:, run:].view(torch.int16) == SENTINEL).all()), "past the run was written"
            outs.append(flat)
        assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))


def test_misaligned_banks_fall_back_to_narrower_words() -> None:
    """Banks that are views starting 2 or 4 bytes into their buffer: still bit-exact."""
    e, s, h, i = 6, 4, 64, 32
    buffers = host_banks(e + 1, h, i, torch.bfloat16, seed=2)
    src = tuple(
        buf.reshape(-1)[k : k + buf[1:].numel()].view(buf[1:].shape)
        for buf, k in zip(buffers, (1, 2), strict=True)
    )
    assert (
        _word_dtype(2 * i * h * 2, 2 * i * h * 2, src[0]) == torch.int16
        and _word_dtype(h * i * 2, h * i * 2, src[1]) == torch.int32
    )
    rows = [(5, 0), (0, 3), (2, 1)]
    plan, count = make_plan(rows, 4, 4)
    got, _ = fill_both(plan, count, src, s, SMALL)  # type: ignore[arg-type]
    assert_filled(rows, src, got)  # type: ignore[arg-type]


def test_count_past_the_plan_and_negative_count() -> None:
    src = host_banks(8, 64, 32, torch.bfloat16, seed=3)
    rows = [(7, 2), (1, 0)]
    plan, _ = make_plan(rows, 2, 0)
    for n, filled in ((5, rows), (-3, [])):
        got, _ = fill_both(plan, torch.tensor([n], dtype=torch.int32), src, 4, SMALL)
        assert_filled(filled, src, got)


def test_rows_out_of_the_banks_are_skipped() -> None:
    """A live row naming an expert >= E or a slot >= S (or a negative one) writes nothing."""
    src = host_banks(4, 40, 24, torch.float32, seed=4)
    plan, count = make_plan([(4, 0), (1, 3), (-1, 1), (2, -1), (3, 2)], 5, 5)
    got, _ = fill_both(plan, count, src, 3, SMALL)
    assert_filled([(3, 2)], src, got)


def test_an_empty_plan_writes_nothing() -> None:
    src = host_banks(4, 64, 32, torch.bfloat16, seed=5)
    got, _ = fill_both(
        torch.empty(0, 2, dtype=torch.int32), torch.tensor([3], dtype=torch.int32), src, 3, SMALL
    )
    assert_filled([], src, got)


def test_refuses_arguments_that_do_not_fit() -> None:
    e, s, h, i = 4, 3, 16, 8
    src = host_banks(e, h, i, torch.bfloat16, seed=6)
    dst = slot_banks(s, h, i, torch.bfloat16)
    plan, count = make_plan([(0, 0)], 1, 1)
    good = {
        "plan": plan,
        "count": count,
        "src_gate_up": src[0],
        "src_down": src[1],
        "dst_gate_up": dst[0],
        "dst_down": dst[1],
    }
    bad = [
        ("plan", plan.long()),
        ("plan", plan.reshape(2, 1)),
        ("plan", torch.zeros(2, 1, dtype=torch.int32).expand(2, 2)),
        ("count", count.reshape(1, 1)),
        ("count", count.long()),
        ("src_gate_up", src[0][:, :-1]),
        ("src_gate_up", src[0][0]),
        ("src_down", src[1][:, :, :-1]),
        ("src_down", src[1].float()),
        ("src_down", src[1].transpose(1, 2).contiguous().transpose(1, 2)),
        ("dst_gate_up", dst[0][None]),
        ("dst_gate_up", dst[0].float()),
        ("dst_down", dst[1][:2]),
        ("dst_down", dst[1].to("meta")),
        ("plan", plan.to("meta")),
        ("src_gate_up", src[0].to("meta")),
    ]
    for name, value in bad:
        for fill in (fill_slots, fill_slots_reference):
            with pytest.raises(ValueError, match=f"^{name} "):
                fill(**{**good, name: value})
    for field, value in (("block", 48), ("iters", 0), ("num_warps", 0)):
        with pytest.raises(ValueError, match=field):
            FillBlocks(**{field: value})
    wide = host_banks(1, 512, 256, torch.bfloat16, seed=7)  # 65536 + 32768 int64 words of one expert
    with pytest.raises(ValueError, match="chunks per expert"):
        fill_slots(plan, count, *wide, *slot_banks(1, 512, 256, torch.bfloat16), blocks=FillBlocks(1, 1))


def test_the_kernel_runs_only_where_it_can() -> None:
    assert fill_kernel_available("cpu") and fill_kernel_available(torch.device("cpu"))
    assert not fill_kernel_available("meta")


def test_falls_back_to_the_reference_where_the_kernel_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(expert_fill, "fill_kernel_available", lambda device: False)
    monkeypatch.setattr(expert_fill, "_body", lambda: pytest.fail("the kernel was launched"))
    src = host_banks(4, 40, 24, torch.bfloat16, seed=8)
    rows = [(3, 1), (0, 0)]
    plan, count = make_plan(rows, 3, 3)
    got = slot_banks(3, 40, 24, torch.bfloat16)
    fill_slots(plan, count, *src, *got)
    assert_filled(rows, src, got)


def test_triton_takes_the_host_wrapper_as_a_pointer() -> None:
    """What the compiled launch hands Triton for a host bank: specialised as a typed pointer, with the
    16-byte alignment seen (the launcher then maps the address; that part needs a GPU)."""
    try:
        from triton.backends.compiler import BaseBackend
        from triton.runtime.jit import native_specialize_impl
    except ImportError:
        pytest.skip("this Triton specialises arguments in Python")
    words = torch.zeros(64, dtype=torch.int64)
    assert native_specialize_impl(BaseBackend, _HostWords(words), False, True, True) == ("*i64", "D")
    assert native_specialize_impl(BaseBackend, _HostWords(words[1:]), False, True, True) == ("*i64", "")
