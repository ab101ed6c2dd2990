"""GGUFs written by llama.cpp's own converter (`make llama-cpp-converter`; `make test` fetches it, and
these tests skip where it could not be had) give transformers' logits and greedy tokens under every
backend: the reader follows what the converter writes, not only our own fixture's reading of its rules.
Qwen3.5-MoE, Qwen3-Next, Kimi-Linear, DeepSeek-V3.2 and DeepSeek-V4."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepseek_v4_published import write_published
from freetoken.runtime.engine import build_engine
from freetoken.runtime.sampling import SamplingParams
from oracle import (
    HYBRID_BACKEND_CASES,
    build_family_model,
    build_hybrid_model,
    build_qwen3_next_model,
    rel_err,
)

ROOT = Path(__file__).resolve().parents[2]
CONVERTER = Path(os.environ.get("FREETOKEN_LLAMA_CPP_CONVERTER", ROOT / ".cache" / "llama-cpp-converter"))
PROMPT = [5, 77, 301, 12, 9, 250, 33, 401]

pytestmark = pytest.mark.skipif(
    not (CONVERTER / "convert_hf_to_gguf.py").is_file(), reason="llama.cpp's converter not fetched"
)


def convert(model_dir: Path, out: Path, architecture: str, *options: str) -> Path:
    driver = ROOT / "tests" / "llama_cpp_convert.py"
    args = [sys.executable, str(driver), str(CONVERTER), str(model_dir), str(out), architecture, *options]
    run = subprocess.run(args, capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    return out


def kimi_as_published(folder: Path) -> object:
    """A tiny Kimi-Linear whose config also carries the published spelling llama.cpp's converter reads
    (`linear_attn_config` with 1-based layer lists, `first_k_dense_replace`); every layer MoE and one
    expert group, as llama.cpp's kimi-linear graph has them (the converter writes no group count)."""
    hf = build_family_model(folder, "kimi_linear", mlp_layer_types=["sparse"] * 3, num_expert_group=1)
    config = json.loads((folder / "config.json").read_text())
    kinds = config["layer_types"]
    config["linear_attn_config"] = {
        "full_attn_layers": [i + 1 for i, kind in enumerate(kinds) if kind == "full_attention"],
        "kda_layers": [i + 1 for i, kind in enumerate(kinds) if kind == "linear_attention"],
        "num_heads": config["linear_num_heads"],
        "head_dim": config["linear_head_dim"],
        "short_conv_kernel_size": config["linear_conv_kernel_dim"],
    }
    config["first_k_dense_replace"] = 0
    (folder / "config.json").write_text(json.dumps(config))
    return hf


# HF architecture -> a tiny model of it llama.cpp's arch reads (Qwen3-Next: every layer MoE, top-k
# renormalised, as llama.cpp's qwen3next graph has them)
BUILDS = {
    "Qwen3_5MoeForCausalLM": build_hybrid_model,
    "Qwen3NextForCausalLM": lambda folder: build_qwen3_next_model(
        folder, mlp_only_layers=[], norm_topk_prob=True
    ),
    # its indexer keeping 4 positions, so the choice (and the indexer's weights) matter; 16 index heads
    # keep scores from tying at zero (test_sparse_attention_keeps_the_indexers_choice says why)
    "KimiLinearForCausalLM": kimi_as_published,
    "DeepseekV32ForCausalLM": lambda folder: build_family_model(
        folder, "deepseek_v32", index_topk=4, index_n_heads=16
    ),
    # as DeepSeek publishes it (deepseek_v4_published.py): FP4 experts with e8m0 scales, which the
    # converter repacks into MXFP4 blocks (kept as stored), its token-id table as I32
    "DeepseekV4ForCausalLM": write_published,
}


@pytest.fixture(scope="module", params=sorted(BUILDS))
def converted(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[object, Path]:
    folder = tmp_path_factory.mktemp("model")
    hf = BUILDS[request.param](folder)
    return hf, convert(folder, folder / "llama-cpp.gguf", request.param)


@pytest.mark.parametrize(("backend", "options"), HYBRID_BACKEND_CASES)
def test_a_file_from_llama_cpps_converter_gives_transformers_tokens(
    converted: tuple[object, Path], backend: str, options: dict[str, object]
) -> None:
    hf, path = converted
    engine = build_engine(path, device="cpu", dtype="float32", moe_backend=backend, **options)
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0]  # type: ignore[operator]
        ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False)  # type: ignore[attr-defined]
    assert rel_err(engine.forward(engine.new_sequence(), PROMPT, all_logits=True), want) < 1e-4
    engine.reset()
    got = [e.token_id for e in engine.generate(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True))]
    assert got == ref[0, len(PROMPT) :].tolist()
    engine.close()


def test_fused_gate_up_expert_banks_read_as_the_split_ones(tmp_path: Path) -> None:
    """--fuse-gate-up-exps writes each layer's gate and up banks as one ffn_gate_up_exps [E, 2I, H]."""
    hf = build_hybrid_model(tmp_path)
    split = convert(tmp_path, tmp_path / "split.gguf", "Qwen3_5MoeForCausalLM")
    fused = convert(tmp_path, tmp_path / "fused.gguf", "Qwen3_5MoeForCausalLM", "fuse")
    from gguf import GGUFReader

    assert any(t.name.endswith("ffn_gate_up_exps.weight") for t in GGUFReader(fused).tensors)
    logits = []
    for path in (split, fused):
        engine = build_engine(path, device="cpu", dtype="float32", moe_backend="cpu")
        logits.append(engine.forward(engine.new_sequence(), PROMPT, all_logits=True))
        engine.close()
    assert torch.equal(logits[0], logits[1])
    with torch.no_grad():
        assert rel_err(logits[1], hf(torch.tensor([PROMPT])).logits[0]) < 1e-4
