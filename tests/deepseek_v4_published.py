"""A tiny DeepSeek-V4 saved as DeepSeek publishes it, the form llama.cpp's converter reads: tensor names
without `model.` (`embed`, `norm`, `head`, `hc_head_fn`, `layers.N.attn.wq_a`, ...), each routed expert's
w1/w2/w3 in FP4 (e2m1 codes two to a byte, element 2j in the low nibble) with an e8m0 scale byte per 32
inputs (`.scale`), and the config in its older spelling (per-layer `compress_ratios`, `num_hash_layers`,
a flat `rope_scaling`). The experts are quantized by gguf's MXFP4 quantizer (the same codes and scale
bytes, only arranged apart); with `fp8`, the attention's and shared experts' matrices too are published
as FP8 (e4m3 with an e8m0 scale per 128 x 128 tile). transformers holds the dequantised values of both,
as the reference."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from freetoken.codecs import get_codec
from freetoken.runtime.models.deepseek_v4_config import older_spelling
from freetoken.runtime.models.deepseek_v4_names import published_name
from oracle import build_family_model

SHAPE = dict(hidden_size=64, moe_intermediate_size=64, intermediate_size=64)  # whole 32-weight blocks


def fp4_published(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[R, C] fp32 -> (packed uint8 [R, C / 2], scale uint8 [R, C / 32], the values they hold [R, C])."""
    codec = get_codec("MXFP4")
    rows = codec.quantize(weight.numpy())  # [R, G · 17]: per block the scale byte, then 16 code bytes
    blocks = rows.reshape(weight.shape[0], -1, 17)
    codes = np.concatenate((blocks[..., 1:] & 15, blocks[..., 1:] >> 4), axis=-1)  # [R, G, 32] weight order
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    values = codec.dequantize(rows, weight.shape[1])
    return (
        torch.from_numpy(np.ascontiguousarray(packed.reshape(weight.shape[0], -1))),
        torch.from_numpy(np.ascontiguousarray(blocks[..., 0])),
        torch.from_numpy(values),
    )


def fp8_published(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[R, C] fp32 -> (e4m3 [R, C], e8m0 scale bytes [⌈R/128⌉, ⌈C/128⌉], the values they hold)."""
    rows, cols = weight.shape
    tiles = torch.zeros(-(-rows // 128), -(-cols // 128), dtype=torch.uint8)
    values = torch.empty_like(weight)
    codes = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(tiles.shape[0]):
        for j in range(tiles.shape[1]):
            tile = weight[128 * i : 128 * (i + 1), 128 * j : 128 * (j + 1)]
            exponent = int(torch.ceil(torch.log2(tile.abs().max().clamp(min=1e-30) / 448.0)))
            tiles[i, j] = exponent + 127
            q = (tile / 2.0**exponent).to(torch.float8_e4m3fn)
            codes[128 * i : 128 * (i + 1), 128 * j : 128 * (j + 1)] = q
            values[128 * i : 128 * (i + 1), 128 * j : 128 * (j + 1)] = q.float() * 2.0**exponent
    return codes, tiles, values


FP8_MATRICES = (".attn.wq_a.", ".attn.wq_b.", ".attn.wkv.", ".attn.wo_a.", ".attn.wo_b.", ".shared_experts.")


def write_published(folder: Path, fp8: bool = False, **overrides: Any) -> Any:
    """Build the tiny model in `folder` (the demo tokenizer with it) and rewrite its weights and config in
    the published form -> transformers holding the quantized weights' values."""
    hf = build_family_model(folder, "deepseek_v4", **{**SHAPE, **overrides})
    from safetensors.torch import load_file

    saved = {}
    for path in sorted(folder.glob("*.safetensors")):
        saved.update(load_file(path))
        path.unlink()
    for index in folder.glob("*.safetensors.index.json"):
        index.unlink()
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, tensor in saved.items():
            parts = name.split(".")
            if ".ffn.experts." in name and parts[-1] == "weight":
                layer, expert, proj = int(parts[2]), int(parts[5]), parts[6]
                packed, scale, values = fp4_published(tensor.float())
                base = published_name(name).removesuffix(".weight")
                out[f"{base}.weight"], out[f"{base}.scale"] = packed, scale
                experts = hf.model.layers[layer].mlp.experts
                inter = experts.down_proj.shape[2]
                if proj == "w2":
                    experts.down_proj[expert] = values
                else:
                    rows = slice(0, inter) if proj == "w1" else slice(inter, 2 * inter)
                    experts.gate_up_proj[expert, rows] = values
            elif fp8 and any(part in name for part in FP8_MATRICES) and tensor.dim() == 2:
                codes, tiles, values = fp8_published(tensor.float())
                base = published_name(name).removesuffix(".weight")
                out[f"{base}.weight"], out[f"{base}.scale"] = codes, tiles
                dict(hf.named_parameters())[hf_name(hf, name)].copy_(values)
            else:
                out[published_name(name)] = tensor.contiguous()
    save_file(out, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(older_spelling(config)))
    return hf


def hf_name(hf: Any, saved: str) -> str:
    """transformers' parameter name of a tensor it saved under DeepSeek's names."""
    from freetoken.runtime.models.deepseek_v4_names import DEEPSEEK_V4_EXPERTS

    name = DEEPSEEK_V4_EXPERTS.canonical(saved)
    assert name is not None and name in dict(hf.named_parameters()), saved
    return name
