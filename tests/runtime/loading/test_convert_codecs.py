"""FTW folders with expert banks in codec blocks: a GGUF's quantized experts kept as stored, bf16 experts
quantized to Q8_0 by `--expert-dtype q8_0`. The cpu backend keeps the blocks in its pool; backends with slots
dequantise them at load; both decode transformers' greedy tokens given the same weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf.quants as gq
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from freetoken.errors import FreeTokenError
from freetoken.formats.ftw_reader import FtwCheckpoint
from freetoken.runtime.engine import build_engine
from freetoken.runtime.loading.convert import convert_to_ftw
from freetoken.runtime.moe.kernels.cpu_experts import kernel_available
from gguf_fixture import dequantised_state_dict, write_gguf
from scheduler_runs import PROMPTS, greedy

pytestmark = pytest.mark.skipif(not kernel_available(), reason="needs the compiled CPU kernel")
TOKENS = 8


def reference_greedy(ref: Any, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(TOKENS):
                ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
            out.append(ids[len(prompt) :])
    return out


def bank_codecs(folder: Path) -> set[str | None]:
    return {e.codec for e in FtwCheckpoint(folder).entries if e.kind in ("gate_up", "down")}


def q8_round_trip(hf: Any) -> Any:
    """transformers with every routed expert replaced by gguf's Q8_0 quantize-then-dequantize of it."""
    ref = type(hf)(hf.config).eval()
    sd = {k: v.clone() for k, v in hf.state_dict().items()}
    for key in [k for k in sd if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        raw = gq.quantize(sd[key].float().numpy(), Q.Q8_0)
        sd[key] = torch.from_numpy(np.array(gq.dequantize(raw, Q.Q8_0), dtype=np.float32)).reshape(
            sd[key].shape
        )
    ref.load_state_dict(sd)
    return ref


def test_a_gguf_converts_with_its_blocks_and_loads_them(tiny_model: tuple[Path, Any], tmp_path: Path) -> None:
    hf = tiny_model[1]
    path = write_gguf(hf, tiny_model[0], tmp_path / "q8.gguf", "Q8_0")
    result = convert_to_ftw(path, tmp_path / "ftw")
    assert result.expert_dtypes == ("Q8_0",) and bank_codecs(tmp_path / "ftw") == {"Q8_0"}
    assert json.loads((tmp_path / "ftw" / "ftw.json").read_text())["version"] == 2
    ref = type(hf)(hf.config).eval()
    ref.load_state_dict(dequantised_state_dict(path, hf))
    want = reference_greedy(ref, PROMPTS[:2])
    engine = build_engine(tmp_path / "ftw", device="cpu", dtype="float32", moe_backend="cpu")
    assert engine.pool.describe()["dtypes"] == ["Q8_0"]
    assert greedy(engine, PROMPTS[:2], TOKENS) == want
    cached = build_engine(
        tmp_path / "ftw", device="cpu", dtype="float32", moe_backend="offload", cache_size=4
    )
    bank = cached.executor.bank  # the slots hold the FTW's blocks too
    assert all(bank.codecs(layer) == ("Q8_0", "Q8_0") for layer in cached.pool.layers)
    assert greedy(cached, PROMPTS[:2], TOKENS) == want
    fused = build_engine(tmp_path / "ftw", device="cpu", dtype="float32", moe_backend="fused")
    assert set(fused.pool.stored) == set(fused.pool.layers)  # the cpu device dequantises the used experts
    assert greedy(fused, PROMPTS[:2], TOKENS) == want
    plain = convert_to_ftw(path, tmp_path / "plain", expert_dtype="dtype")
    assert plain.expert_dtypes == ("bfloat16",) and bank_codecs(tmp_path / "plain") == {None}


@pytest.mark.parametrize("types", [("Q4_K", "Q6_K"), ("IQ2_XXS", "Q3_K"), ("Q5_1", "IQ4_NL")])
def test_quantized_experts_stay_in_their_types(
    make_model: Any, tmp_path: Path, types: tuple[str, str]
) -> None:
    folder, hf = make_model(hidden_size=256, moe_intermediate_size=256, num_experts=4)
    path = write_gguf(hf, folder, tmp_path / "k.gguf", "F32", expert_types=types)
    result = convert_to_ftw(path, tmp_path / "ftw", dtype="float32")
    assert result.expert_dtypes == tuple(sorted(types))
    ref = type(hf)(hf.config).eval()
    ref.load_state_dict(dequantised_state_dict(path, hf))
    engine = build_engine(tmp_path / "ftw", device="cpu", dtype="float32", moe_backend="cpu")
    assert engine.pool.codec_names(engine.pool.layers[0]) == types
    assert greedy(engine, PROMPTS[:2], TOKENS) == reference_greedy(ref, PROMPTS[:2])


def test_bf16_experts_quantize_to_q8_0(tiny_model: tuple[Path, Any], tmp_path: Path) -> None:
    folder, hf = tiny_model
    result = convert_to_ftw(folder, tmp_path / "ftw", dtype="float32", expert_dtype="Q8_0")
    assert result.expert_dtypes == ("Q8_0",)
    plain = convert_to_ftw(folder, tmp_path / "plain", dtype="float32")
    experts = [e for e in FtwCheckpoint(tmp_path / "ftw").entries if e.kind in ("gate_up", "down")]
    full = [e for e in FtwCheckpoint(tmp_path / "plain").entries if e.kind in ("gate_up", "down")]
    assert sum(e.nbytes for e in experts) * 128 == sum(e.nbytes for e in full) * 34  # 34 B per 32 fp32
    want = reference_greedy(q8_round_trip(hf), PROMPTS[:2])
    engine = build_engine(tmp_path / "ftw", device="cpu", dtype="float32", moe_backend="cpu")
    assert engine.pool.describe()["dtypes"] == ["Q8_0"]
    assert greedy(engine, PROMPTS[:2], TOKENS) == want
    assert plain.expert_dtypes == ("float32",)


def fp8_round_trip(hf: Any) -> Any:
    """transformers with every routed expert replaced by the FP8 codec's quantize-then-dequantize of it."""
    from freetoken.codecs import fp8

    ref = type(hf)(hf.config).eval()
    sd = {k: v.clone() for k, v in hf.state_dict().items()}
    for key in [k for k in sd if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        rows = fp8.quantize_rows(sd[key].float().numpy())
        sd[key] = torch.from_numpy(fp8.dequantize_rows(rows)).reshape(sd[key].shape)
    ref.load_state_dict(sd)
    return ref


def test_bf16_experts_quantize_to_fp8(make_model: Any, tmp_path: Path) -> None:
    """One scale per 128 weights of a row (rows of 256 here): a quarter more bytes than e4m3 alone."""
    folder, hf = make_model(hidden_size=256, moe_intermediate_size=256, num_experts=4)
    result = convert_to_ftw(folder, tmp_path / "ftw", dtype="float32", expert_dtype="FP8")
    assert result.expert_dtypes == ("FP8",) and bank_codecs(tmp_path / "ftw") == {"FP8"}
    experts = [e for e in FtwCheckpoint(tmp_path / "ftw").entries if e.kind in ("gate_up", "down")]
    assert sum(e.nbytes for e in experts) == 3 * 4 * 256 * 256 // 128 * 132 * 2  # 2 MoE layers
    want = reference_greedy(fp8_round_trip(hf), PROMPTS[:2])
    engine = build_engine(tmp_path / "ftw", device="cpu", dtype="float32", moe_backend="cpu")
    assert engine.pool.describe()["dtypes"] == ["FP8"]
    assert greedy(engine, PROMPTS[:2], TOKENS) == want


def test_bad_expert_dtype_is_one_line(tiny_model: tuple[Path, Any], tmp_path: Path) -> None:
    with pytest.raises(FreeTokenError, match="--expert-dtype 'Q2_K': choose one of stored, dtype, Q8_0, FP8"):
        convert_to_ftw(tiny_model[0], tmp_path / "ftw", expert_dtype="Q2_K")
    from typer.testing import CliRunner

    from freetoken.cli.app import app

    result = CliRunner().invoke(
        app, ["convert", str(tiny_model[0]), str(tmp_path / "x"), "--expert-dtype", "q2"]
    )
    assert result.exit_code != 0 and "--expert-dtype" in result.output
    result = CliRunner().invoke(
        app, ["convert", str(tiny_model[0]), str(tmp_path / "y"), "--expert-dtype", "q8_0", "--json"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output.strip().splitlines()[-1])["expert_dtypes"] == ["Q8_0"]


def test_float_experts_take_the_dtype(tiny_model: tuple[Path, Any], tmp_path: Path) -> None:
    """An F32 GGUF's experts are written in --dtype, not kept as f32 blocks."""
    path = write_gguf(tiny_model[1], tiny_model[0], tmp_path / "f32.gguf", "F32")
    result = convert_to_ftw(path, tmp_path / "ftw")
    assert result.expert_dtypes == ("bfloat16",) and bank_codecs(tmp_path / "ftw") == {None}
