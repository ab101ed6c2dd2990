"""FreeToken's Qwen3-MoE against transformers' implementation on tiny random models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from freetoken.runtime.engine import build_engine
from freetoken.runtime.sampling import SamplingParams
from oracle import rel_err

PROMPT = [5, 77, 301, 12, 9, 250, 33, 401, 18, 2, 64, 111]


def hf_logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]  # [T, V]


def hf_greedy(model: Any, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("backend", ["fused", "cpu"])
def test_prompt_and_decode_logits_match_fp32(tiny_model: tuple[Path, Any], backend: str) -> None:
    folder, hf = tiny_model
    engine = build_engine(folder, device="cpu", dtype="float32", moe_backend=backend)
    seq = engine.new_sequence()
    ours = engine.forward(seq, PROMPT, all_logits=True)
    ref = hf_logits(hf, PROMPT)
    assert ours.shape == ref.shape
    assert rel_err(ours, ref) < 1e-4
    ids = list(PROMPT)
    for _ in range(16):  # each decode step against a full transformers recomputation
        nxt = int(ours[-1].argmax())
        ids.append(nxt)
        ours = engine.forward(seq, [nxt])
        assert rel_err(ours[-1], hf_logits(hf, ids)[-1]) < 1e-4


@pytest.mark.parametrize("backend", ["fused", "cpu"])
def test_greedy_tokens_match(tiny_model: tuple[Path, Any], backend: str) -> None:
    folder, hf = tiny_model
    engine = build_engine(folder, device="cpu", dtype="float32", moe_backend=backend)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    events = list(engine.generate(PROMPT, params))
    ours = [e.token_id for e in events]
    expected = hf_greedy(hf, PROMPT, 32)
    assert len(set(expected)) > 4, "the oracle should not be degenerate"
    assert ours == expected


def test_bf16_logits_close(tiny_model: tuple[Path, Any]) -> None:
    folder, hf = tiny_model
    ref_model = type(hf).from_pretrained(folder, dtype=torch.bfloat16).eval()
    engine = build_engine(folder, device="cpu", dtype="bfloat16", moe_backend="fused")
    ours = engine.forward(engine.new_sequence(), PROMPT, all_logits=True)
    assert ours.dtype == torch.bfloat16
    assert rel_err(ours, hf_logits(ref_model, PROMPT)) < 2e-2


def test_fused_and_cpu_executors_agree_bf16(tiny_model: tuple[Path, Any]) -> None:
    """In bf16 the cpu backend runs the compiled kernel (fp32 accumulation) and fused runs torch in bf16:
    both must sit within the bf16 tolerance of the bf16 oracle, and near each other."""
    folder, hf = tiny_model
    ref = hf_logits(type(hf).from_pretrained(folder, dtype=torch.bfloat16).eval(), PROMPT)
    logits = {}
    for backend in ("fused", "cpu"):
        engine = build_engine(folder, device="cpu", dtype="bfloat16", moe_backend=backend)
        logits[backend] = engine.forward(engine.new_sequence(), PROMPT, all_logits=True)
        assert rel_err(logits[backend], ref) < 2e-2
    assert rel_err(logits["cpu"], logits["fused"]) < 2e-2


@pytest.mark.parametrize(
    "overrides",
    [
        {"norm_topk_prob": False, "tie_word_embeddings": True},
        {"mlp_only_layers": [], "decoder_sparse_step": 2, "num_experts_per_tok": 3},
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 5000.0, "factor": 2.0}},
    ],
    ids=["tied-unnormalised", "sparse-step", "yarn", "linear-rope"],
)
def test_config_variants_match(make_model: Any, overrides: dict[str, Any]) -> None:
    folder, hf = make_model(**overrides)
    engine = build_engine(folder, device="cpu", dtype="float32")
    prompt = PROMPT * 8  # long enough for the rope scaling to matter
    ours = engine.forward(engine.new_sequence(), prompt, all_logits=True)
    assert rel_err(ours, hf_logits(hf, prompt)) < 1e-4


def test_sharded_checkpoint_loads(tmp_path: Path, tiny_model: tuple[Path, Any]) -> None:
    _, hf = tiny_model
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="200KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (sharded / name).write_bytes((tiny_model[0] / name).read_bytes())
    engine = build_engine(sharded, device="cpu", dtype="float32")
    ours = engine.forward(engine.new_sequence(), PROMPT, all_logits=True)
    assert rel_err(ours, hf_logits(hf, PROMPT)) < 1e-4
