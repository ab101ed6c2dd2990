"""Qwen3-Next against transformers' implementation (its pure-torch path) on a tiny random model: the
fused DeltaNet projections (rows grouped by key head), a dense layer among the MoE ones, top-k without
renormalisation; logits through the carried states, every MoE backend, FTW."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from freetoken.runtime.engine import build_engine
from freetoken.runtime.sampling import SamplingParams
from oracle import HYBRID_BACKEND_CASES, build_qwen3_next_model, rel_err

PROMPT = [5, 77, 301, 12, 9, 250, 33, 401, 18, 2, 64, 111]


@pytest.fixture(scope="module")
def next_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    pytest.importorskip("transformers.models.qwen3_next")
    folder = tmp_path_factory.mktemp("tiny-qwen3-next")
    return folder, build_qwen3_next_model(folder)


def reference(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_config_and_layout(next_model: tuple[Path, Any]) -> None:
    folder, _ = next_model
    engine = build_engine(folder, device="cpu", dtype="float32", moe_backend="fused")
    assert engine.config.architecture == "qwen3_next"
    assert engine.config.moe_layers == (0, 2, 3) and not engine.config.norm_topk_prob


def test_prompt_and_decode_logits(next_model: tuple[Path, Any]) -> None:
    folder, model = next_model
    engine = build_engine(folder, device="cpu", dtype="float32", moe_backend="fused")
    seq = engine.new_sequence()
    ids = list(PROMPT)
    assert rel_err(engine.forward(seq, ids, all_logits=True), reference(model, ids)) < 1e-4
    for _ in range(6):
        ids.append(int(reference(model, ids)[-1].argmax()))
        assert rel_err(engine.forward(seq, ids[-1:])[-1], reference(model, ids)[-1]) < 1e-4


@pytest.mark.parametrize(("backend", "options"), HYBRID_BACKEND_CASES)
def test_every_backend_gives_the_reference_greedy_tokens(
    next_model: tuple[Path, Any], backend: str, options: dict
) -> None:
    folder, model = next_model
    ids = list(PROMPT)
    for _ in range(12):
        ids.append(int(reference(model, ids)[-1].argmax()))
    engine = build_engine(folder, device="cpu", dtype="float32", moe_backend=backend, **options)
    try:
        out = engine.generate(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))
        assert [e.token_id for e in out] == ids[len(PROMPT) :]
    finally:
        engine.close()


def test_loads_from_ftw(next_model: tuple[Path, Any], tmp_path: Path) -> None:
    from freetoken.runtime.loading.convert import convert_to_ftw

    folder, model = next_model
    ftw = convert_to_ftw(folder, tmp_path / "next.ftw", dtype="float32").out
    engine = build_engine(ftw, device="cpu", dtype="float32", moe_backend="offload", cache_size=4)
    try:
        assert (
            rel_err(engine.forward(engine.new_sequence(), PROMPT, all_logits=True), reference(model, PROMPT))
            < 1e-4
        )
    finally:
        engine.close()
