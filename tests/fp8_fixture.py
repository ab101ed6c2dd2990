"""Block-scaled FP8 checkpoints made from a saved transformers model, as Qwen3-FP8 ships them: every
projection weight (attention, dense MLP, experts) in e4m3 with a `weight_scale_inv` grid per 128×128 tile,
norms, embeddings, the router and the LM head as they were; `quantization_config` in config.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from freetoken.codecs import fp8

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_fp8_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    """Rewrite `folder`'s model.safetensors in FP8; returns transformers' state dict of the dequantised
    weights (what the reference model loads)."""
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    out: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    for name, value in tensors.items():
        if name.endswith(".weight") and name.rsplit(".", 2)[-2] in PROJECTIONS:
            codes, scale = fp8.quantize_tiles(value.float().numpy())
            out[name] = torch.from_numpy(codes).view(torch.float8_e4m3fn)
            out[name + "_scale_inv"] = torch.from_numpy(scale)
            reference[name] = torch.from_numpy(fp8.dequantize_tiles(codes, scale))
        else:
            out[name] = value
            reference[name] = value.float()
    save_file(out, str(path), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return reference


def reference_model(hf: Any, state: dict[str, torch.Tensor], folder: Path) -> Any:
    """transformers' model of the dequantised weights: saved in the checkpoint's own names into `folder`
    and loaded by from_pretrained (which maps them onto its modules, fused experts included)."""
    folder.mkdir(parents=True, exist_ok=True)
    hf.config.save_pretrained(folder)
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    return type(hf).from_pretrained(folder, dtype=torch.float32).eval()
