"""DeepSeek-V4 as DeepSeek publishes it (deepseek_v4_published.py): FP4 routed experts with e8m0 scales
read as MXFP4 blocks kept as stored, FP8 matrices with e8m0 tile scales dequantised; transformers' logits
over the same values and its greedy tokens under every backend; `ft convert` keeps the experts' blocks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from deepseek_v4_published import write_published
from freetoken.runtime.engine import build_engine
from freetoken.runtime.loading.convert import convert_to_ftw
from freetoken.runtime.moe.kernels.cpu_experts import kernel_available
from freetoken.runtime.sampling import SamplingParams
from oracle import rel_err

pytestmark = pytest.mark.skipif(not kernel_available(), reason="needs the compiled CPU kernel")
PROMPT = [5, 77, 301, 12, 9, 250, 33, 401]
TOKENS = 8
BACKENDS = [
    ("cpu", {}),
    ("fused", {}),
    ("offload", {"cache_size": 3}),
    ("hybrid", {"cache_size": 3, "pcie_gbps": 25.0, "host_gbps": 100.0}),
]


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor, list[int]]:
    folder = tmp_path_factory.mktemp("v4")
    hf = write_published(folder, fp8=True, hidden_size=256, moe_intermediate_size=256, intermediate_size=256)
    ids = list(PROMPT)
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT])).logits[0]
        for _ in range(TOKENS):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return folder, logits, ids[len(PROMPT) :]


def expert_bytes(folder: Path) -> int:
    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", "pt") as f:
        names = [k for k in f.keys() if ".ffn.experts." in k]  # noqa: SIM118 - a safetensors handle
        return sum(f.get_tensor(k).numel() for k in names)  # uint8 parts


@pytest.mark.parametrize(("backend", "options"), BACKENDS, ids=[b for b, _ in BACKENDS])
def test_fp4_experts_stay_mxfp4_and_give_the_references_tokens(
    published: tuple[Path, torch.Tensor, list[int]], backend: str, options: dict[str, Any]
) -> None:
    folder, want_logits, want_tokens = published
    engine = build_engine(folder, device="cpu", dtype="float32", moe_backend=backend, **options)
    try:
        assert engine.pool.describe()["dtypes"] == ["MXFP4"]
        assert engine.pool.describe()["bytes"] <= 1.02 * expert_bytes(folder)
        assert rel_err(engine.forward(engine.new_sequence(), PROMPT, all_logits=True), want_logits) < 1e-4
        engine.reset()
        params = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
        assert [e.token_id for e in engine.generate(PROMPT, params)] == want_tokens
    finally:
        engine.close()


def test_convert_keeps_the_mxfp4_blocks(
    published: tuple[Path, torch.Tensor, list[int]], tmp_path: Path
) -> None:
    folder, _, want_tokens = published
    result = convert_to_ftw(folder, tmp_path / "ftw", dtype="float32")
    assert result.expert_dtypes == ("MXFP4",)
    engine = build_engine(tmp_path / "ftw", device="cpu", dtype="float32", moe_backend="cpu")
    try:
        params = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
        assert [e.token_id for e in engine.generate(PROMPT, params)] == want_tokens
    finally:
        engine.close()
