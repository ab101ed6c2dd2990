"""Quantized safetensors checkpoints (FP8 block-scaled; NVFP4 as ModelOpt and compressed-tensors write it):
dense quantized weights dequantised at load, routed experts kept as the codec's rows by the cpu backend
(computed in place by the CPU kernel) or dequantised for backends with device banks; every way decodes
the greedy tokens of transformers given the dequantised weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from freetoken.errors import FreeTokenError
from freetoken.formats.safetensors_dir import SafetensorsCheckpoint
from freetoken.runtime.engine import build_engine
from freetoken.runtime.moe.kernels.cpu_experts import kernel_available
from quantized_checkpoints import SCHEMES, reference_model, write_quantized_checkpoint
from scheduler_runs import PROMPTS, greedy

TOKENS = 10
CODEC = {"fp8": "FP8", "nvfp4-modelopt": "NVFP4", "nvfp4-ct": "NVFP4"}
ROW_BYTES = {"FP8": 2 * 132, "NVFP4": 2 * 76}  # a 256-weight row


@pytest.fixture(scope="module", params=SCHEMES)
def quantized_model(
    request: Any, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, str, list[list[int]]]:
    from oracle import build_hf_model

    scheme = request.param
    folder = tmp_path_factory.mktemp(scheme)
    hf = build_hf_model(folder, hidden_size=256, moe_intermediate_size=256, num_experts=4)
    state = write_quantized_checkpoint(folder, scheme)
    ref = reference_model(hf, state, tmp_path_factory.mktemp(f"{scheme}-reference"))
    want = []
    with torch.no_grad():
        for prompt in PROMPTS[:2]:
            ids = list(prompt)
            for _ in range(TOKENS):
                ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
            want.append(ids[len(prompt) :])
    return folder, scheme, want


def test_the_checkpoint_lists_logical_weights_not_their_parts(quantized_model: tuple[Path, str, Any]) -> None:
    folder, scheme, _ = quantized_model
    with SafetensorsCheckpoint(folder) as ckpt:
        names = ckpt.names()
        assert not any(name.endswith(("_scale_inv", "_scale", "_scale_2", "_packed")) for name in names)
        name = "model.layers.0.mlp.experts.1.down_proj.weight"
        assert name in names and ckpt.shape(name) == (256, 256)
        assert ckpt.codec(name).name == CODEC[scheme] and ckpt.read(name).dtype == torch.float32
        assert tuple(ckpt.read_stored(name).shape) == (256, ROW_BYTES[CODEC[scheme]])
        assert ckpt.codec("model.layers.0.mlp.gate.weight").name == "f32"


@pytest.mark.skipif(not kernel_available(), reason="needs the compiled CPU kernel")
def test_cpu_backend_keeps_quantized_experts_and_decodes_the_reference(
    quantized_model: tuple[Path, str, Any],
) -> None:
    folder, scheme, want = quantized_model
    engine = build_engine(folder, device="cpu", dtype="float32", moe_backend="cpu")
    try:
        pool = engine.pool
        assert all(pool.codec_names(layer) == (CODEC[scheme],) * 2 for layer in pool.layers)
        assert pool.describe()["dtypes"] == [CODEC[scheme]]
        assert greedy(engine, PROMPTS[:2], TOKENS) == want
    finally:
        engine.close()


@pytest.mark.parametrize("backend", ["fused", "offload", "hybrid"])
def test_backends_with_device_banks_keep_the_blocks_and_decode_the_reference(
    quantized_model: tuple[Path, str, Any], backend: str
) -> None:
    """FP8 and NVFP4 experts stay as stored in device banks and slots too (the device reads them in place:
    torch's dequantisers on a cpu device, the Triton kernels on CUDA)."""
    folder, scheme, want = quantized_model
    options = {"cache_size": 3, "pcie_gbps": 25.0, "host_gbps": 100.0} if backend != "fused" else {}
    engine = build_engine(folder, device="cpu", dtype="float32", moe_backend=backend, **options)
    try:
        assert engine.pool.describe()["dtypes"] == [CODEC[scheme]]
        assert greedy(engine, PROMPTS[:2], TOKENS) == want
    finally:
        engine.close()


def test_fp8_without_a_tile_grid_is_refused_in_one_line(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"w.weight": torch.zeros(4, 4).to(torch.float8_e4m3fn)}, str(tmp_path / "model.safetensors"))
    with SafetensorsCheckpoint(tmp_path) as ckpt, pytest.raises(FreeTokenError, match=r"FP8 without a w\."):
        ckpt.read("w.weight")


@pytest.mark.skipif(not kernel_available(), reason="needs the compiled CPU kernel")
@pytest.mark.parametrize(("backend", "options"), [("cpu", {}), ("offload", {"cache_size": 3})])
def test_a_qwen35_fp8_checkpoint_keeps_its_experts(
    tmp_path_factory: pytest.TempPathFactory, backend: str, options: dict[str, Any]
) -> None:
    """Qwen3.5/3.6-MoE as its FP8 releases ship (every expert's projections block-scaled e4m3, one by one):
    the experts stay FP8 on the CPU and in the slots, and the greedy tokens are transformers' over the same
    dequantised weights."""
    from oracle import build_hybrid_model

    folder = tmp_path_factory.mktemp("qwen35-fp8")
    hf = build_hybrid_model(folder, hidden_size=256, moe_intermediate_size=256)
    state = write_quantized_checkpoint(folder, "fp8")
    ref = reference_model(hf, state, tmp_path_factory.mktemp("qwen35-fp8-reference"))
    want = []
    with torch.no_grad():
        for prompt in PROMPTS[:2]:
            ids = list(prompt)
            for _ in range(8):
                ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
            want.append(ids[len(prompt) :])
    engine = build_engine(folder, device="cpu", dtype="float32", moe_backend=backend, **options)
    try:
        assert engine.pool.describe()["dtypes"] == ["FP8"]
        assert greedy(engine, PROMPTS[:2], 8) == want
    finally:
        engine.close()
