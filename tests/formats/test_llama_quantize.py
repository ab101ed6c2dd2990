"""Files quantized by llama.cpp's own quantizer (`make llama-quantize` builds it; these tests skip where it
is not built): a Qwen3.5-MoE and a DeepSeek-V4 GGUF written by llama.cpp's converter from tiny
transformers models (rows of 256, so the K-quants and i-quants apply to the experts), then quantized into
Q4_K_M, Q5_K_M and IQ3_S with the quantizer's own per-tensor mix. Each gives the greedy tokens of
transformers holding the file's weights dequantised by gguf's reference, its experts kept as stored in
the file's types."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from test_llama_cpp_converter import CONVERTER, ROOT, convert

from deepseek_v4_published import write_published
from freetoken.codecs import get_codec
from freetoken.formats.gguf_checkpoint import GgufCheckpoint
from freetoken.runtime.engine import build_engine
from freetoken.runtime.sampling import SamplingParams
from oracle import build_hybrid_model

QUANTIZE = Path(
    os.environ.get("FREETOKEN_LLAMA_QUANTIZE", ROOT / ".cache" / "llama-quantize" / "bin" / "llama-quantize")
)
pytestmark = [
    pytest.mark.skipif(not QUANTIZE.is_file(), reason="llama.cpp's quantizer not built: make llama-quantize"),
    pytest.mark.skipif(not (CONVERTER / "convert_hf_to_gguf.py").is_file(), reason="converter not fetched"),
]
PROMPT = [5, 77, 301, 12, 9, 250, 33, 401]
TOKENS = 8
WIDE = dict(hidden_size=256, moe_intermediate_size=256)
BUILDS = {
    "Qwen3_5MoeForCausalLM": lambda folder: build_hybrid_model(folder, **WIDE),
    "DeepseekV4ForCausalLM": lambda folder: write_published(folder, **WIDE, intermediate_size=256),
}
# each mix's main expert types (the quantizer gives some layers' down projections more bits)
EXPERT_TYPES = {"Q4_K_M": ("Q4_K", "Q6_K"), "Q5_K_M": ("Q5_K", "Q6_K"), "IQ3_S": ("IQ3_S",)}
MIXES = tuple(EXPERT_TYPES)


def quantize(source: Path, out: Path, mix: str) -> Path:
    env = {**os.environ, "LD_LIBRARY_PATH": f"{QUANTIZE.parent}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    # --allow-requantize: DeepSeek-V4's experts come from the converter as MXFP4 already
    args = [str(QUANTIZE), "--allow-requantize", str(source), str(out), mix, "2"]
    run = subprocess.run(args, capture_output=True, text=True, env=env, check=False)
    assert run.returncode == 0, run.stdout[-1500:] + run.stderr[-1500:]
    return out


@pytest.fixture(scope="module", params=sorted(BUILDS))
def converted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    folder = tmp_path_factory.mktemp("model")
    hf = BUILDS[request.param](folder)
    return hf, convert(folder, folder / "f32.gguf", request.param)


def reference(hf: Any, engine: Any) -> Any:
    """transformers holding the engine's dense weights (read from the file through gguf's dequantiser)
    and its experts' blocks dequantised by gguf's reference."""
    state = {name: t.detach().float() for name, t in engine.model.state_dict().items()}
    pool = engine.pool
    for layer in pool.layers:
        codecs = [get_codec(c) for c in pool.codec_names(layer)]
        h, i = pool.hidden_size, pool.intermediate_size
        banks = (pool.gate_up[layer], pool.down[layer])
        gate_up, down = (
            torch.from_numpy(codec.dequantize(bank.numpy(), n))
            for codec, bank, n in zip(codecs, banks, (h, i), strict=True)
        )
        state[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = gate_up
        state[f"model.layers.{layer}.mlp.experts.down_proj"] = down
    ref = type(hf)(hf.config).eval()
    missing, _ = ref.load_state_dict(state, strict=False)
    assert not [k for k in missing if "rotary" not in k], missing
    return ref


def file_expert_types(path: Path) -> set[str]:
    with GgufCheckpoint(path) as ckpt:
        return {ckpt.type_name(n) for n in ckpt.names() if ".mlp.experts." in n}


@pytest.mark.parametrize("mix", MIXES)
def test_a_quantized_file_gives_the_dequantised_references_tokens(
    converted: tuple[Any, Path], mix: str, tmp_path: Path
) -> None:
    hf, source = converted
    path = quantize(source, tmp_path / f"{mix}.gguf", mix)
    types = file_expert_types(path)
    assert types & set(EXPERT_TYPES[mix]), types  # the mix reached the experts
    engine = build_engine(path, device="cpu", dtype="float32", moe_backend="cpu")
    try:
        assert set(engine.pool.describe()["dtypes"]) == types  # kept as stored
        ref = reference(hf, engine)
        ids = list(PROMPT)
        with torch.no_grad():
            for _ in range(TOKENS):
                ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
        params = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
        assert [e.token_id for e in engine.generate(PROMPT, params)] == ids[len(PROMPT) :]
    finally:
        engine.close()
    cached = build_engine(path, device="cpu", dtype="float32", moe_backend="offload", cache_size=3)
    try:
        assert [e.token_id for e in cached.generate(PROMPT, params)] == ids[len(PROMPT) :]
    finally:
        cached.close()
