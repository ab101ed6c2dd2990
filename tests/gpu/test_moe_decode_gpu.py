"""The fused MoE decode kernel compiled on CUDA: against the reference, inside a CUDA graph, no sync."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from codec_banks import CODEC_CASES, INT8_CASES, check_codec_banks, check_int8_banks
from freetoken.codecs import get_codec
from freetoken.runtime.moe.expert_fn import ExpertFn
from freetoken.runtime.moe.experts import grouped_experts
from freetoken.runtime.moe.kernels.moe_decode import INT8_WIDE_BLOCKS, DecodeBlocks, fused_moe_decode

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
H, INTER, SLOTS, K = 2048, 768, 48, 8  # Qwen3-30B-A3B expert shapes


def case(t: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, H, device="cuda", generator=g).bfloat16()
    ids = torch.stack([torch.randperm(SLOTS, device="cuda", generator=g)[:K] for _ in range(t)])
    weights = torch.rand(t, K, device="cuda", generator=g)
    gate_up = (torch.randn(SLOTS, 2 * INTER, H, device="cuda", generator=g) / H**0.5).bfloat16()
    down = (torch.randn(SLOTS, H, INTER, device="cuda", generator=g) / INTER**0.5).bfloat16()
    return x, ids, weights, gate_up, down


@pytest.mark.parametrize("t", [1, 3, 8, 16])
def test_matches_the_fp32_reference(t: int) -> None:
    x, ids, weights, gate_up, down = case(t, seed=t)
    ids[0, 2] = -1
    got = fused_moe_decode(x, ids, weights, gate_up, down)
    ref = grouped_experts(x.float(), ids, weights, gate_up.float(), down.float())
    torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kind", ["clamped", "clamped_silu"])
def test_clamped_functions_match_the_fp32_reference(kind: str) -> None:
    """The clamped kinds compiled; the gate and up values spread about 1, so the limit 0.5 is passed."""
    fn = ExpertFn(kind, limit=0.5)
    x, ids, weights, gate_up, down = case(4, seed=fn.code)
    got = fused_moe_decode(x, ids, weights, gate_up, down, fn=fn)
    ref = grouped_experts(x.float(), ids, weights, gate_up.float(), down.float(), fn)
    torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2)


def test_replays_in_a_cuda_graph_without_a_host_sync() -> None:
    x, ids, weights, gate_up, down = case(4, seed=9)
    fused_moe_decode(x, ids, weights, gate_up, down)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            out = fused_moe_decode(x, ids, weights, gate_up, down)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    x2, ids2, weights2, *_ = case(4, seed=10)
    x.copy_(x2)
    ids.copy_(ids2)
    weights.copy_(weights2)
    graph.replay()
    torch.testing.assert_close(out, fused_moe_decode(x, ids, weights, gate_up, down))


@pytest.mark.parametrize(("codecs", "h", "i", "tiles", "kind"), CODEC_CASES)
def test_banks_of_codec_blocks_compiled(
    codecs: tuple[str, str], h: int, i: int, tiles: DecodeBlocks, kind: str
) -> None:
    check_codec_banks(codecs, h, i, tiles, kind, "cuda")


# tiles of a row or two a program: more programs than the interpreter runs in CI's time, so here only
INT8_GPU_CASES = [
    (("Q8_0", "Q8_0"), 192, 128, DecodeBlocks(1, 128, 2, 64, num_warps=1, down_warps=1, split_choices=1)),
    (("Q8_0", "Q8_0"), 256, 192, DecodeBlocks(2, 256, 4, 256, num_warps=1, down_warps=1)),
    (("Q4_K", "Q4_K"), 768, 512, DecodeBlocks(1, 1024, 2, 1024, chunk_tile=2, gate_up_rounds=3)),
    (("Q4_K", "Q4_K"), 512, 768, DecodeBlocks(2, 512, 1, 1024, num_warps=1, down_warps=1, chunk_tile=1)),
    # a program's gate and up rows as one tile, at the sizes the sweep tries
    (("Q8_0", "Q8_0"), 256, 192, DecodeBlocks(1, 256, 4, 256, num_warps=1, down_warps=1, gate_up_joint=1)),
    (("Q4_K", "Q4_K"), 512, 256, DecodeBlocks(4, 512, 8, 512, num_warps=1, down_warps=1, gate_up_joint=1)),
    (
        ("Q4_K", "Q4_K"),
        512,
        256,
        DecodeBlocks(2, 512, 8, 512, 1, down_warps=1, chunk_tile=2, gate_up_joint=1),
    ),
    # the shipped tiles of rows past a chunk: 9 super-blocks, the second chunk's last 7 past H
    (("Q4_K", "Q4_K"), 2304, 256, INT8_WIDE_BLOCKS["Q4_K"]),
]


@pytest.mark.parametrize(("codecs", "h", "i", "tiles"), INT8_CASES + INT8_GPU_CASES)
def test_int8_activation_sides_compiled(codecs: tuple[str, str], h: int, i: int, tiles: DecodeBlocks) -> None:
    check_int8_banks(codecs, h, i, tiles, "cuda")


def test_int8_sides_replay_in_a_cuda_graph() -> None:
    """The quantize launches and the dp4a kernels capture: a replay over new inputs gives the eager call."""
    rng = np.random.default_rng(3)
    q4k = get_codec("Q4_K")
    gate_up = torch.from_numpy(q4k.random_blocks(np.empty((6, 512, q4k.row_bytes(512)), np.uint8), rng, 1e-3))
    down = torch.from_numpy(q4k.random_blocks(np.empty((6, 512, q4k.row_bytes(256)), np.uint8), rng, 1e-3))
    gate_up, down = gate_up.cuda(), down.cuda()
    x, ids, w = (
        torch.randn(2, 512, device="cuda"),
        torch.tensor([[0, 5], [3, 1]], device="cuda"),
        torch.rand(2, 2, device="cuda"),
    )

    def step() -> torch.Tensor:
        return fused_moe_decode(x, ids, w, gate_up, down, codecs=("Q4_K", "Q4_K"), int8_act=True)

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    x.copy_(torch.randn(2, 512, device="cuda"))
    ids.copy_(torch.tensor([[2, 4], [5, 0]], device="cuda"))
    graph.replay()
    torch.testing.assert_close(out, step())


@pytest.mark.parametrize(
    ("codecs", "tiles"),
    [
        (None, DecodeBlocks(split_choices=1)),
        (("Q4_K", "Q4_K"), DecodeBlocks(8, 512, 8, 256, num_warps=1, split_choices=1, down_warps=1)),
        (("Q4_K", "Q4_K"), DecodeBlocks(8, 512, 8, 256, num_warps=2, split_choices=1, chunk_tile=1)),
        (("Q4_K", "Q4_K"), DecodeBlocks(32, 512, 8, 256, num_warps=4, chunk_tile=1)),  # gate_up quantizes
        (("Q4_K", "Q4_K"), DecodeBlocks(8, 512, 8, 256, num_warps=1, split_choices=1, gate_up_splits=2)),
    ],
)
def test_programmatic_dependent_launch_changes_no_bit(
    codecs: tuple[str, str] | None, tiles: DecodeBlocks
) -> None:
    """pdl: each kernel after the step's first starts before the one before it ends and waits for it once
    its weights are asked for; eagerly and replayed in a CUDA graph, the bits of the step without it."""
    rng = np.random.default_rng(4)
    if codecs is None:
        *_, gate_up, down = case(1, seed=4)
        h = gate_up.shape[2]
    else:
        q4k, h, i = get_codec("Q4_K"), 512, 256
        blocks = [np.empty((6, rows, q4k.row_bytes(n)), np.uint8) for rows, n in ((2 * i, h), (h, i))]
        gate_up, down = (torch.from_numpy(q4k.random_blocks(b, rng, 1e-3)).cuda() for b in blocks)
    x = torch.randn(2, h, device="cuda").bfloat16()
    ids = torch.tensor([[0, 5], [3, -1]], device="cuda")
    w = torch.rand(2, 2, device="cuda")
    on = replace(tiles, pdl=1)

    def step(b: DecodeBlocks) -> torch.Tensor:
        return fused_moe_decode(x, ids, w, gate_up, down, b, codecs=codecs, int8_act=codecs is not None)

    assert torch.equal(step(on), step(tiles))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(on)
    x.copy_(torch.randn(2, h, device="cuda").bfloat16())
    ids.copy_(torch.tensor([[2, 4], [-1, 1]], device="cuda"))
    graph.replay()
    assert torch.equal(out, step(tiles))
