"""Experts kept as stored on CUDA: the compiled decode kernel over Q8_0 / Q4_K / Q6_K / MXFP4 blocks
against the plain sum over gguf's dequantisation, and a Q8_0 GGUF under offload and fused whose slots
hold the blocks, decoding the CPU engine's tokens in CUDA graphs; a file whose layers differ in their
pair (Q4_K_M's Q6_K down projections) likewise, through the gather fill into flat slots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from freetoken.codecs import get_codec
from freetoken.runtime.engine import build_engine
from freetoken.runtime.moe.experts import grouped_experts
from freetoken.runtime.moe.kernels.moe_decode import fused_moe_decode
from gguf_fixture import write_gguf
from scheduler_runs import PROMPTS, greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
SCALE = {"Q8_0": 5e-3, "Q4_K": 1e-3, "Q6_K": 2e-5, "MXFP4": 2**-4}


@pytest.mark.parametrize("codec", ["Q8_0", "Q4_K", "Q6_K", "MXFP4"])
@pytest.mark.parametrize("tokens", [1, 4])
def test_compiled_kernel_reads_blocks_in_place(codec: str, tokens: int) -> None:
    c, h, i, s = get_codec(codec), 512, 256, 6
    rng = np.random.default_rng(tokens)
    gu = c.random_blocks(np.empty((s, 2 * i, c.row_bytes(h)), np.uint8), rng, SCALE[codec])
    dn = c.random_blocks(np.empty((s, h, c.row_bytes(i)), np.uint8), rng, SCALE[codec])
    gate_up, down = (torch.from_numpy(c.dequantize(b, n)).cuda() for b, n in ((gu, h), (dn, i)))
    x = torch.randn(tokens, h, device="cuda")
    ids = torch.stack([torch.randperm(s)[:4] for _ in range(tokens)]).cuda()
    w = torch.rand(tokens, 4, device="cuda")
    want = grouped_experts(x, ids.cpu(), w, gate_up, down)
    got = fused_moe_decode(
        x, ids, w, torch.from_numpy(gu).cuda(), torch.from_numpy(dn).cuda(), codecs=(codec, codec)
    )
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * float(want.abs().max()))


@pytest.mark.parametrize(("backend", "options"), [("offload", {"cache_size": 4}), ("fused", {})])
def test_a_q8_0_gguf_keeps_its_blocks_on_the_device(
    tiny_model: tuple[Path, Any], tmp_path: Path, backend: str, options: dict
) -> None:
    path = write_gguf(tiny_model[1], tiny_model[0], tmp_path / "q8.gguf", "Q8_0")
    want = greedy(build_engine(path, device="cpu", dtype="float32", moe_backend="cpu"), PROMPTS[:3], 10)
    engine = build_engine(path, device="cuda", dtype="float32", moe_backend=backend, **options)
    try:
        assert engine.pool.describe()["dtypes"] == ["Q8_0"]
        assert engine.executor.graph_blocker(3) is None
        assert greedy(engine, PROMPTS[:3], 10) == want
    finally:
        engine.close()


@pytest.mark.parametrize("backend", ["offload", "hybrid"])
def test_layers_of_different_pairs_share_the_slots(make_model: Any, tmp_path: Path, backend: str) -> None:
    """Q4_K/Q6_K and Q4_K/Q4_K layers in one GGUF: the slots hold both as stored (each layer's rows a view
    of the flat slots), the captured step fills them by the gather kernel, and the greedy tokens are the
    CPU engine's on the same blocks."""
    folder, hf = make_model(hidden_size=256, moe_intermediate_size=256, num_experts=8, num_hidden_layers=4)
    types = [("Q4_K", "Q6_K"), ("Q4_K", "Q6_K"), ("Q4_K", "Q4_K")]  # MoE layers 0, 2, 3
    path = write_gguf(hf, folder, tmp_path / "m.gguf", "F32", expert_types=types)
    want = greedy(build_engine(path, device="cpu", dtype="float32", moe_backend="cpu"), PROMPTS[:3], 10)
    extra = {"pcie_gbps": 25.0, "host_gbps": 100.0} if backend == "hybrid" else {}
    engine = build_engine(path, device="cuda", dtype="float32", moe_backend=backend, cache_size=6, **extra)
    try:
        bank = engine.executor.bank
        assert bank.codecs(0) == bank.codecs(3) == ("Q4_K", "Q6_K") and bank.codecs(2) == ("Q4_K", "Q4_K")
        assert engine.executor.graph_blocker(3) is None
        assert greedy(engine, PROMPTS[:3], 10) == want
    finally:
        engine.close()
