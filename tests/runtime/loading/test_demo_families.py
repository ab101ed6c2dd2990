"""The random-model generator writes every family in its own HF layout: transformers loads each folder and
the engine gives transformers' logits and greedy tokens on it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from freetoken.runtime.engine import build_engine
from freetoken.runtime.loading.demo import DEMO_SPEC, FAMILIES, write_random_model
from oracle import rel_err

PROMPT = [5, 77, 301, 12, 9]
SPEC = replace(
    DEMO_SPEC, num_layers=3, hidden_size=64, intermediate_size=96, num_heads=4, num_kv_heads=2, head_dim=16,
    num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, dtype="float32", init_std=0.15,
)  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_loads_in_transformers_and_matches(family: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    folder = write_random_model(tmp_path / family, replace(SPEC, family=family))
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits[0]
    engine = build_engine(folder, device="cpu", dtype="float32", moe_backend="offload", cache_size=4)
    try:
        assert engine.config.architecture == family
        got = engine.forward(engine.new_sequence(), PROMPT, all_logits=True)
        assert rel_err(got, want) < 1e-4
    finally:
        engine.close()
