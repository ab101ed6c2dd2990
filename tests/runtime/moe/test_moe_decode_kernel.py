"""The fused MoE decode kernel against the plain-torch reference, run by Triton's interpreter on CPU
(the same kernel bodies the GPU compiles; tests/gpu runs them compiled)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from codec_banks import CODEC_CASES, INT8_CASES, check_codec_banks, check_int8_banks
from freetoken.runtime.moe.expert_fn import SILU, ExpertFn
from freetoken.runtime.moe.experts import grouped_experts
from freetoken.runtime.moe.kernels.moe_decode import (
    INT8_BLOCKS,
    INT8_CODEC_BLOCKS,
    INT8_WIDE_BLOCKS,
    DecodeBlocks,
    fused_moe_decode,
    grid_dependency,
    int8_blocks,
    triton_available,
)

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

# Small tiles so that the loops run several chunks and the masks cut partial ones (H, I not multiples).
SMALL = DecodeBlocks(gate_up_n=16, gate_up_k=32, down_n=16, down_k=32)


def case(t: int, k: int, slots: int = 6, h: int = 72, i: int = 40, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    ids = torch.stack([torch.randperm(slots, generator=g)[:k] for _ in range(t)])  # distinct per token
    weights = torch.rand(t, k, generator=g)
    gate_up = torch.randn(slots, 2 * i, h, generator=g) / h**0.5
    down = torch.randn(slots, h, i, generator=g) / i**0.5
    return x, ids, weights, gate_up, down


SPLIT = replace(SMALL, split_choices=1)  # the down kernel per (token, rows, choice), then the sum


@pytest.mark.parametrize("tiles", [SMALL, SPLIT])
@pytest.mark.parametrize(("t", "k"), [(1, 1), (1, 4), (3, 2), (5, 3)])
def test_matches_the_reference_in_fp32(t: int, k: int, tiles: DecodeBlocks) -> None:
    x, ids, weights, gate_up, down = case(t, k, seed=t * 10 + k)
    got = fused_moe_decode(x, ids, weights, gate_up, down, tiles)
    torch.testing.assert_close(got, grouped_experts(x, ids, weights, gate_up, down), rtol=1e-4, atol=1e-5)


# Every experts' function; the cases' gate and up values spread about 1, so a limit of 0.5 is passed often.
FNS = {
    "silu": SILU,
    "clamped": ExpertFn("clamped", limit=0.5),
    "clamped_silu": ExpertFn("clamped_silu", limit=0.5),
}


@pytest.mark.parametrize("fn", FNS.values(), ids=FNS.keys())
@pytest.mark.parametrize("tiles", [SMALL, SPLIT])
def test_every_function_matches_the_reference(fn: ExpertFn, tiles: DecodeBlocks) -> None:
    x, ids, weights, gate_up, down = case(3, 2, seed=11)
    ids[1, 0] = -1
    want = grouped_experts(x, ids, weights, gate_up, down, fn)
    got = fused_moe_decode(x, ids, weights, gate_up, down, tiles, fn=fn)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    if fn.kind != "silu":  # the clamp is reached: without it the answer differs
        assert not torch.allclose(
            grouped_experts(x, ids, weights, gate_up, down, replace(fn, limit=1e9)), want
        )


@pytest.mark.parametrize("tiles", [SMALL, SPLIT])
def test_skipped_pairs_contribute_nothing(tiles: DecodeBlocks) -> None:
    x, ids, weights, gate_up, down = case(3, 3, seed=7)
    ids[0, 1] = -1
    ids[2] = -1  # a token whose every choice runs elsewhere
    got = fused_moe_decode(x, ids, weights, gate_up, down, tiles)
    torch.testing.assert_close(got, grouped_experts(x, ids, weights, gate_up, down), rtol=1e-4, atol=1e-5)
    assert torch.count_nonzero(got[2]) == 0


def test_bf16_banks_within_bf16_tolerance() -> None:
    x, ids, weights, gate_up, down = case(2, 4, seed=3)
    xb, gub, db = x.bfloat16(), gate_up.bfloat16(), down.bfloat16()
    got = fused_moe_decode(xb, ids, weights, gub, db, SMALL)
    assert got.dtype == torch.bfloat16
    reference = grouped_experts(xb.float(), ids, weights, gub.float(), db.float())
    torch.testing.assert_close(got.float(), reference, rtol=2e-2, atol=2e-2)


def test_reads_slots_in_place_from_a_bank_view() -> None:
    """Banks are often views (a slice of a larger slot pool): strides, not copies."""
    x, ids, weights, gate_up, down = case(2, 2, slots=6, seed=5)
    pool_gate_up = torch.cat([torch.randn(2, *gate_up.shape[1:]), gate_up])  # 2 other slots first
    pool_down = torch.cat([torch.randn(2, *down.shape[1:]), down])
    reference = grouped_experts(x, ids, weights, gate_up, down)
    whole = fused_moe_decode(x, ids + 2, weights, pool_gate_up, pool_down, SMALL)
    view = fused_moe_decode(x, ids, weights, pool_gate_up[2:], pool_down[2:], SMALL)
    torch.testing.assert_close(whole, reference, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(view, reference, rtol=1e-4, atol=1e-5)


def test_refuses_banks_that_do_not_fit() -> None:
    x, ids, weights, gate_up, down = case(1, 2)
    with pytest.raises(ValueError, match="contiguous"):
        fused_moe_decode(x, ids, weights, gate_up.transpose(1, 2), down, SMALL)
    with pytest.raises(ValueError, match="do not fit"):
        fused_moe_decode(x[:, :10], ids, weights, gate_up, down, SMALL)


@pytest.mark.parametrize("t", [2, 16])
def test_tokens_sharing_experts_read_them_once_and_match(t: int) -> None:
    x, ids, weights, gate_up, down = case(t, 3, seed=t)
    ids[:] = torch.tensor([4, 0, 2])  # every token the same experts: groups of t pairs
    ids[0] = torch.tensor([1, 4, -1])  # ... except one, with a skipped choice
    got = fused_moe_decode(x, ids, weights, gate_up, down, SMALL)
    torch.testing.assert_close(got, grouped_experts(x, ids, weights, gate_up, down), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("codecs", "h", "i", "tiles", "kind"), CODEC_CASES)
def test_banks_of_codec_blocks_are_read_in_place(
    codecs: tuple[str, str], h: int, i: int, tiles: DecodeBlocks, kind: str
) -> None:
    check_codec_banks(codecs, h, i, tiles, kind, "cpu")


def test_the_device_codecs_agree() -> None:
    """The codecs the loader keeps for the device (those with a torch dequantiser) are the decode kernel's,
    numbered as the CPU kernel numbers them, each with its block size for the kernel's chunks."""
    from freetoken.codecs.torch_dequant import DEVICE_CODECS
    from freetoken.runtime.moe.kernels.cpu_experts import CODEC_IDS
    from freetoken.runtime.moe.kernels.moe_decode import CODEC_GRANULE, QUANT_CODECS

    assert set(QUANT_CODECS) == set(DEVICE_CODECS)
    assert all(CODEC_IDS[name] == code and code in CODEC_GRANULE for name, code in QUANT_CODECS.items())


def test_tiles_become_launch_options() -> None:
    """Each kernel's warps, the stages, and a register cap only where one is set."""
    tiles = DecodeBlocks(num_warps=4, num_stages=3, down_warps=1, max_registers=168)
    assert tiles.launch() == {"num_warps": 4, "num_stages": 3, "maxnreg": 168}
    assert tiles.launch(down=True) == {"num_warps": 1, "num_stages": 3, "maxnreg": 168}
    assert DecodeBlocks(num_warps=2).launch(down=True) == {"num_warps": 2, "num_stages": 1}


def test_int8_tiles_follow_the_codec_and_the_row_width(monkeypatch: pytest.MonkeyPatch) -> None:
    """Q4_K rows past the 8-row tile's chunk take the wide tiles, Q8_0 keeps its own at any width; tiles set
    in the environment win."""
    monkeypatch.delenv("FREETOKEN_MOE_DECODE_INT8_BLOCKS", raising=False)
    assert int8_blocks("Q4_K", 2048) == INT8_BLOCKS
    assert int8_blocks("Q4_K", 4096) == INT8_WIDE_BLOCKS["Q4_K"] != INT8_BLOCKS
    assert int8_blocks("Q8_0", 4096) == int8_blocks("Q8_0", 2048) == INT8_CODEC_BLOCKS["Q8_0"]
    monkeypatch.setenv("FREETOKEN_MOE_DECODE_INT8_BLOCKS", "8,2048,8,1024,1,1")
    assert int8_blocks("Q4_K", 7168) == INT8_BLOCKS


def test_dependent_launch_is_left_to_devices_that_run_it() -> None:
    """pdl asks for grid dependency control, which the interpreter (and cards before sm_90) cannot run: the
    step takes it only where the device has it, and gives the same sums without it."""
    x, ids, weights, gate_up, down = case(2, 2, seed=3)
    assert not grid_dependency(x.device)
    plain = fused_moe_decode(x, ids, weights, gate_up, down, SPLIT)
    assert torch.equal(fused_moe_decode(x, ids, weights, gate_up, down, replace(SPLIT, pdl=1)), plain)


@pytest.mark.parametrize(("codecs", "h", "i", "tiles"), INT8_CASES)
def test_int8_activation_sides_match_their_reference(
    codecs: tuple[str, str], h: int, i: int, tiles: DecodeBlocks
) -> None:
    check_int8_banks(codecs, h, i, tiles, "cpu")
