"""Every GGML type of the codec registry, kept as stored under every backend: a GGUF whose routed experts
are random raw blocks of the type (gate/up; the down projection in the next type of the list, so each
type is read on both sides), for a family each in turn. The engine's logits are transformers' given the
reference dequantisation of the same blocks (gguf's) within 1e-3, its greedy tokens the same; the pool
reports the file's expert types and holds no more than the file's expert bytes (2%)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from freetoken.codecs import CODECS
from freetoken.formats.gguf_checkpoint import GgufCheckpoint
from freetoken.runtime.engine import build_engine
from freetoken.runtime.moe.kernels.cpu_experts import kernel_available
from freetoken.runtime.sampling import SamplingParams
from gguf_fixture import write_gguf
from gguf_qwen35_fixture import write_qwen35_gguf
from oracle import build_family_model, build_hf_model, build_hybrid_model, rel_err

pytestmark = pytest.mark.skipif(not kernel_available(), reason="needs the compiled CPU kernel")

TYPES = [c.name for c in CODECS.values() if c.ggml_type is not None and c.block_elements > 1]
FAMILIES = ["qwen3_moe", "olmoe", "glm4_moe", "minimax_m2", "mixtral", "deepseek_v3", "qwen3_5_moe"]
BACKENDS = [
    ("cpu", {}),
    ("fused", {}),
    ("offload", {"cache_size": 3}),
    ("hybrid", {"cache_size": 3, "pcie_gbps": 25.0, "host_gbps": 100.0}),
]
PROMPT = [5, 77, 301, 12, 9, 250, 33, 401]
TOKENS = 6
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


@pytest.fixture(scope="module", params=range(len(TYPES)), ids=TYPES)
def typed_file(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, ...]:
    """(GGUF path, its (gate/up, down) types, transformers over its dequantisation, its logits and greedy
    tokens)."""
    n = request.param
    pair = (TYPES[n], TYPES[(n + 1) % len(TYPES)])
    family = FAMILIES[n % len(FAMILIES)]
    folder = tmp_path_factory.mktemp(f"{family}-{pair[0]}")
    hf = build(family, folder)
    path = folder / "experts.gguf"
    if family == "qwen3_5_moe":
        write_qwen35_gguf(hf, folder, path, expert_types=pair)
    else:
        write_gguf(hf, folder, path, "F32", expert_types=pair)
    ref = reference(hf, path)
    ids = list(PROMPT)
    with torch.no_grad():
        logits = ref(torch.tensor([PROMPT])).logits[0]
        for _ in range(TOKENS):
            ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
    return path, pair, logits, ids[len(PROMPT) :]


@pytest.mark.parametrize(("backend", "options"), BACKENDS, ids=[b for b, _ in BACKENDS])
def test_each_type_is_kept_and_gives_the_references_logits_and_tokens(
    typed_file: tuple[Any, ...], backend: str, options: dict[str, Any]
) -> None:
    path, pair, want_logits, want_tokens = typed_file
    engine = build_engine(path, device="cpu", dtype="float32", moe_backend=backend, **options)
    try:
        pool = engine.pool
        assert all(pool.codec_names(layer) == pair for layer in pool.layers), backend
        info = pool.describe()
        assert sorted(info["dtypes"]) == sorted(set(pair))
        assert expert_file_bytes(path) <= info["bytes"] <= 1.02 * expert_file_bytes(path)
        logits = engine.forward(engine.new_sequence(), PROMPT, all_logits=True)
        assert rel_err(logits, want_logits) < 1e-3
        engine.reset()
        params = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
        assert [e.token_id for e in engine.generate(PROMPT, params)] == want_tokens
    finally:
        engine.close()
