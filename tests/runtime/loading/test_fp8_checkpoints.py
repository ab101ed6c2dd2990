"""Block-scaled FP8 safetensors checkpoints: dense FP8 weights dequantised at load, routed experts kept as
the FP8 codec's rows by the cpu backend (computed in place by the CPU kernel) or dequantised for backends
with slots; every way decodes the greedy tokens of transformers given the dequantised weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fp8_fixture import reference_model, write_fp8_checkpoint
from freetoken.errors import FreeTokenError
from freetoken.formats.safetensors_dir import SafetensorsCheckpoint
from freetoken.runtime.engine import build_engine
from freetoken.runtime.moe.kernels.cpu_experts import kernel_available
from scheduler_runs import PROMPTS, greedy

TOKENS = 10


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    from oracle import build_hf_model

    folder = tmp_path_factory.mktemp("fp8")
    hf = build_hf_model(folder, hidden_size=256, moe_intermediate_size=256, num_experts=4)
    ref = reference_model(hf, write_fp8_checkpoint(folder), tmp_path_factory.mktemp("fp8-reference"))
    want = []
    with torch.no_grad():
        for prompt in PROMPTS[:2]:
            ids = list(prompt)
            for _ in range(TOKENS):
                ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
            want.append(ids[len(prompt) :])
    return folder, want


def test_the_checkpoint_lists_weights_not_their_scale_grids(fp8_model: tuple[Path, Any]) -> None:
    with SafetensorsCheckpoint(fp8_model[0]) as ckpt:
        names = ckpt.names()
        assert not any(name.endswith("_scale_inv") for name in names)
        name = "model.layers.0.mlp.experts.1.down_proj.weight"
        assert ckpt.codec(name).name == "FP8" and ckpt.read(name).dtype == torch.float32
        assert tuple(ckpt.read_stored(name).shape) == (256, 2 * 132)
        assert ckpt.codec("model.layers.0.mlp.gate.weight").name == "f32"


@pytest.mark.skipif(not kernel_available(), reason="needs the compiled CPU kernel")
def test_cpu_backend_keeps_fp8_experts_and_decodes_the_reference(fp8_model: tuple[Path, Any]) -> None:
    folder, want = fp8_model
    engine = build_engine(folder, device="cpu", dtype="float32", moe_backend="cpu")
    try:
        pool = engine.pool
        assert all(pool.codec_names(layer) == ("FP8", "FP8") for layer in pool.layers)
        assert pool.describe()["dtypes"] == ["FP8"]
        assert greedy(engine, PROMPTS[:2], TOKENS) == want
    finally:
        engine.close()


@pytest.mark.parametrize("backend", ["fused", "hybrid"])
def test_backends_with_device_banks_dequantise_and_decode_the_reference(
    fp8_model: tuple[Path, Any], backend: str
) -> None:
    folder, want = fp8_model
    options = {"cache_size": 3, "pcie_gbps": 25.0, "host_gbps": 100.0} if backend == "hybrid" else {}
    engine = build_engine(folder, device="cpu", dtype="float32", moe_backend=backend, **options)
    try:
        assert engine.pool.describe()["dtypes"] == ["f32"]
        assert greedy(engine, PROMPTS[:2], TOKENS) == want
    finally:
        engine.close()


def test_fp8_without_a_tile_grid_is_refused_in_one_line(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"w.weight": torch.zeros(4, 4).to(torch.float8_e4m3fn)}, str(tmp_path / "model.safetensors"))
    with SafetensorsCheckpoint(tmp_path) as ckpt, pytest.raises(FreeTokenError, match=r"FP8 without a w\."):
        ckpt.read("w.weight")
