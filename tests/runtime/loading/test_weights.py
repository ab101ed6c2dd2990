"""Bad model folders give one-line errors that name what is wrong."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from freetoken.errors import FreeTokenError
from freetoken.runtime.engine import build_engine


def copy_model(src: Path, dst: Path, edit: Any) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def one_line_error(folder: Path) -> str:
    with pytest.raises(FreeTokenError) as info:
        build_engine(folder, device="cpu", dtype="float32")
    message = str(info.value)
    assert "\n" not in message
    return message


def test_missing_dense_tensor(tiny_model: tuple[Path, Any], tmp_path: Path) -> None:
    folder = copy_model(
        tiny_model[0], tmp_path / "m", lambda t: t.pop("model.layers.2.self_attn.k_proj.weight")
    )
    assert "missing tensors: model.layers.2.self_attn.k_proj.weight" in one_line_error(folder)


def test_missing_expert_tensor(tiny_model: tuple[Path, Any], tmp_path: Path) -> None:
    folder = copy_model(
        tiny_model[0], tmp_path / "m", lambda t: t.pop("model.layers.0.mlp.experts.5.up_proj.weight")
    )
    assert "missing expert tensors: layer 0 expert 5 up" in one_line_error(folder)


def test_wrong_shape(tiny_model: tuple[Path, Any], tmp_path: Path) -> None:
    def shrink(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.2.mlp.experts.3.down_proj.weight"] = t[
            "model.layers.2.mlp.experts.3.down_proj.weight"
        ][:, :7].contiguous()

    folder = copy_model(tiny_model[0], tmp_path / "m", shrink)
    message = one_line_error(folder)
    assert "model.layers.2.mlp.experts.3.down_proj.weight has shape [64, 7], expected [64, 32]" in message


def test_unexpected_tensor(tiny_model: tuple[Path, Any], tmp_path: Path) -> None:
    def add(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.self_attn.rotary.inv_freq"] = torch.zeros(4)
        t["model.layers.1.mlp.experts.0.gate_proj.weight"] = torch.zeros(32, 64)  # layer 1 is dense

    message = one_line_error(copy_model(tiny_model[0], tmp_path / "m", add))
    assert "unexpected tensors:" in message
    assert "model.layers.0.self_attn.rotary.inv_freq" in message
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in message


def test_missing_config_and_weights(tiny_model: tuple[Path, Any], tmp_path: Path) -> None:
    folder = tmp_path / "m"
    shutil.copytree(tiny_model[0], folder)
    (folder / "model.safetensors").unlink()
    assert "no *.safetensors files" in one_line_error(folder)
    (folder / "config.json").unlink()
    assert "config.json: file not found" in one_line_error(folder)
    assert "model folder not found" in one_line_error(tmp_path / "nowhere")


def test_corrupt_shard(tiny_model: tuple[Path, Any], tmp_path: Path) -> None:
    folder = tmp_path / "m"
    shutil.copytree(tiny_model[0], folder)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:100])
    assert "model.safetensors: not a readable safetensors file" in one_line_error(folder)
