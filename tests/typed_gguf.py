"""GGUFs whose routed experts are random raw blocks of one GGML type each (gate/up in a type, the down
projection in the next type of the list, so each type is read on both sides), for any family of FAMILIES,
and transformers over the reference dequantisation of the same blocks (gguf's): what the every-type tests
on the CPU and on the GPU check the engine against."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from freetoken.codecs import CODECS
from freetoken.formats.gguf_checkpoint import GgufCheckpoint
from gguf_fixture import write_gguf
from gguf_qwen35_fixture import write_qwen35_gguf
from oracle import build_family_model, build_hf_model, build_hybrid_model

TYPES = [c.name for c in CODECS.values() if c.ggml_type is not None and c.block_elements > 1]
FAMILIES = ["qwen3_moe", "olmoe", "glm4_moe", "minimax_m2", "mixtral", "deepseek_v3", "qwen3_5_moe"]
WIDE = dict(hidden_size=256, moe_intermediate_size=256, intermediate_size=256)  # whole super-blocks


def build(family: str, folder: Path) -> Any:
    if family == "qwen3_moe":
        return build_hf_model(folder, **WIDE)
    if family == "qwen3_5_moe":
        return build_hybrid_model(folder, hidden_size=256, moe_intermediate_size=256)
    extra: dict[str, Any] = {
        "olmoe": {"head_dim": 64},  # its q norm is hidden-wide: 4 heads of 64
        "mixtral": {"sliding_window": None},  # as published (llama.cpp's llama arch has no window)
    }.get(family, {})
    return build_family_model(folder, family, **WIDE, **extra)


def reference(hf: Any, path: Path) -> Any:
    """transformers with every routed expert bank replaced by the file's, dequantised by gguf's reference
    (the file's other tensors are hf's own, written as F32)."""
    state = hf.state_dict()
    with GgufCheckpoint(path) as ckpt:
        for key in [k for k in state if k.endswith("mlp.experts.gate_up_proj")]:
            layer = key.removesuffix(".gate_up_proj")
            gate, up = ckpt.read(f"{layer}.gate_proj"), ckpt.read(f"{layer}.up_proj")
            state[key] = torch.cat((gate, up), dim=1).float()
            state[f"{layer}.down_proj"] = ckpt.read(f"{layer}.down_proj").float()
    ref = type(hf)(hf.config).eval()
    ref.load_state_dict(state)
    return ref


def expert_file_bytes(path: Path) -> int:
    with GgufCheckpoint(path) as ckpt:
        return sum(ckpt.nbytes(name) for name in ckpt.names() if ".mlp.experts." in name)


def typed_file(n: int, folder: Path, family: str | None = None) -> tuple[Path, tuple[str, str], Any]:
    """The n-th type's GGUF in `folder` (a family of FAMILIES: `family`, else the n-th in turn) -> (its
    path, its (gate/up, down) types, transformers over its dequantisation)."""
    pair = (TYPES[n], TYPES[(n + 1) % len(TYPES)])
    family = family or FAMILIES[n % len(FAMILIES)]
    hf = build(family, folder)
    path = folder / "experts.gguf"
    if family == "qwen3_5_moe":
        write_qwen35_gguf(hf, folder, path, expert_types=pair)
    else:
        write_gguf(hf, folder, path, "F32", expert_types=pair)
    return path, pair, reference(hf, path)


def reference_run(ref: Any, prompt: list[int], tokens: int) -> tuple[torch.Tensor, list[int]]:
    """(the prompt's logits, `tokens` greedy tokens after it) of transformers."""
    ids = list(prompt)
    with torch.no_grad():
        logits = ref(torch.tensor([prompt])).logits[0]
        for _ in range(tokens):
            ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
    return logits, ids[len(prompt) :]
