"""Quantized checkpoints made from a saved transformers model, the way they ship: every projection weight
(attention, dense MLP, experts) quantized; norms, embeddings, the router and the LM head as they were.

  fp8             e4m3 with a `weight_scale_inv` grid per 128×128 tile (Qwen3-FP8, DeepSeek-V3)
  nvfp4-modelopt  packed e2m1 `weight`, e4m3 `weight_scale` per 16, `weight_scale_2` (multiplier), input_scale
  nvfp4-ct        compressed-tensors: `weight_packed`, `weight_scale`, `weight_global_scale` (a divisor)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from freetoken.codecs import fp8, nvfp4

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SCHEMES = ("fp8", "nvfp4-modelopt", "nvfp4-ct")
CONFIGS = {
    "fp8": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
    "nvfp4-modelopt": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16},
    "nvfp4-ct": {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"},
}


def _quantized(name: str, value: torch.Tensor, scheme: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(the checkpoint tensors for weight `name`, its dequantised value)."""
    w = value.float().numpy()
    base = name[: -len(".weight")]
    if scheme == "fp8":
        codes, scale = fp8.quantize_tiles(w)
        tensors = {
            name: torch.from_numpy(codes).view(torch.float8_e4m3fn),
            name + "_scale_inv": torch.from_numpy(scale),
        }
        return tensors, torch.from_numpy(fp8.dequantize_tiles(codes, scale))
    packed, scales, multiplier = nvfp4.quantize(w)
    e4m3 = torch.from_numpy(scales).view(torch.float8_e4m3fn)
    if scheme == "nvfp4-modelopt":
        tensors = {
            name: torch.from_numpy(packed),
            f"{base}.weight_scale": e4m3,
            f"{base}.weight_scale_2": torch.tensor(multiplier),
            f"{base}.input_scale": torch.tensor(1.0),
        }
    else:
        tensors = {
            f"{base}.weight_packed": torch.from_numpy(packed),
            f"{base}.weight_scale": e4m3,
            f"{base}.weight_global_scale": torch.tensor([1.0 / multiplier]),
        }
    return tensors, torch.from_numpy(nvfp4.dequantize_packed(packed, scales, multiplier))


def write_quantized_checkpoint(folder: Path, scheme: str) -> dict[str, torch.Tensor]:
    """Rewrite `folder`'s model.safetensors quantized by `scheme`; returns the dequantised weights in the
    checkpoint's names (what the reference model loads)."""
    path = folder / "model.safetensors"
    out: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    for name, value in load_file(str(path)).items():
        if name.endswith(".weight") and name.rsplit(".", 2)[-2] in PROJECTIONS:
            tensors, reference[name] = _quantized(name, value, scheme)
            out.update(tensors)
        else:
            out[name] = reference[name] = value
    save_file(out, str(path), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = CONFIGS[scheme]
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return reference


def reference_model(hf: Any, state: dict[str, torch.Tensor], folder: Path) -> Any:
    """transformers' model of the dequantised weights: saved in the checkpoint's own names into `folder`
    and loaded by from_pretrained (which maps them onto its modules, fused experts included)."""
    folder.mkdir(parents=True, exist_ok=True)
    hf.config.save_pretrained(folder)
    save_file({k: v.float().contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    return type(hf).from_pretrained(folder, dtype=torch.float32).eval()
