"""Each family on CUDA in bf16 (Mixtral, OLMoE, GLM-4.5, MiniMax-M2; Qwen3-MoE has its own GPU tests):
the greedy tokens of the CPU fp32 engine, under fused, offload and hybrid, with batches of one and three."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from freetoken.runtime.engine import Engine, build_engine
from oracle import FAMILY_TINY, build_family_model
from scheduler_runs import PROMPTS, greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
BACKENDS = [
    ("fused", {}),
    ("offload", {"cache_size": 3}),
    ("hybrid", {"cache_size": 4, "pcie_gbps": 25.0, "host_gbps": 100.0}),
]


@pytest.fixture(scope="module", params=list(FAMILY_TINY))
def family_model(request: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    folder = tmp_path_factory.mktemp(f"gpu-{request.param}")
    build_family_model(folder, request.param)
    return request.param, folder


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize(("backend", "options"), BACKENDS)
def test_cuda_gives_the_cpu_references_tokens(
    family_model: tuple[str, Path], backend: str, options: dict, batch: int, dtype: str
) -> None:
    """fp32: the same tokens; bf16: the same tokens up to a first difference, and there the reference
    ranks both tokens as a near-tie (bf16 may break a tie either way; after it the sequences differ)."""
    _, folder = family_model
    prompts = PROMPTS[:batch]
    reference = build_engine(folder, device="cpu", dtype="float32", moe_backend="fused")
    want = greedy(reference, prompts, 12)
    engine = build_engine(folder, device="cuda", dtype=dtype, moe_backend=backend, **options)
    try:
        got = greedy(engine, prompts, 12)
        if dtype == "float32":
            assert got == want
        for prompt, g, w in zip(prompts, got, want, strict=True):
            assert_same_up_to_a_near_tie(reference, prompt, w, g)
    finally:
        engine.close()


def assert_same_up_to_a_near_tie(
    reference: Engine, prompt: list[int], want: list[int], got: list[int], tolerance: float = 0.02
) -> None:
    """`got` equals `want` up to its first difference; there the reference's logits of the two tokens lie
    within `tolerance` of the logits' largest magnitude (bf16 noise on a tiny random model is ~1e-2)."""
    step = next((i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b), None)
    if step is None:
        return
    logits = reference.forward(reference.new_sequence(), prompt + want[:step], all_logits=True)[-1]
    gap = float(logits[want[step]] - logits[got[step]])
    scale = float(logits.abs().max())
    note = f"step {step}: {got[step]} instead of {want[step]}, logit gap {gap:.4g} of {scale:.4g}"
    assert gap <= tolerance * scale, note
