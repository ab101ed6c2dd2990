"""Random-model generator: deterministic, a valid HF folder that transformers loads and agrees with."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from freetoken.runtime.engine import build_engine
from freetoken.runtime.loading.demo import (
    RandomModelSpec,
    ensure_demo_model,
    is_random_model,
    write_random_model,
)
from oracle import rel_err

SMALL = RandomModelSpec(
    num_layers=2,
    hidden_size=32,
    intermediate_size=48,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    mlp_only_layers=(1,),
    dtype="float32",
    init_std=0.2,
)


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_same_spec_same_bytes(tmp_path: Path) -> None:
    a = write_random_model(tmp_path / "a", SMALL)
    b = write_random_model(tmp_path / "b", SMALL)
    assert digest(a) == digest(b)
    c = write_random_model(tmp_path / "c", RandomModelSpec(**{**SMALL.__dict__, "seed": 1}))
    assert digest(c)["model.safetensors"] != digest(a)["model.safetensors"]
    assert not list(tmp_path.glob(".*tmp*")), "no temporary folder is left behind"


def test_transformers_loads_it_and_agrees(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    folder = write_random_model(tmp_path / "m", SMALL)
    assert is_random_model(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = [3, 99, 250, 7, 512, 14]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    engine = build_engine(folder, device="cpu", dtype="float32")
    assert rel_err(engine.forward(engine.new_sequence(), ids, all_logits=True), ref) < 1e-4


def test_shards_with_an_index(tmp_path: Path) -> None:
    folder = write_random_model(tmp_path / "m", SMALL, shard_bytes=64 << 10)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in folder.glob("model-*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == set(shards)
    build_engine(folder, device="cpu", dtype="float32")


def test_demo_is_created_once_under_home(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("FREETOKEN_HOME", str(tmp_path / "home"))
    path = ensure_demo_model()
    assert path.parent == tmp_path / "home" / "models"
    cfg = json.loads((path / "config.json").read_text())
    assert (
        cfg["model_type"] == "qwen3_moe"
        and 16 <= cfg["num_experts"] <= 32
        and cfg["num_experts_per_tok"] == 4
    )
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_model() == path and (path / "model.safetensors").stat().st_mtime_ns == stamp
    specials = json.loads((path / "tokenizer_config.json").read_text())["chat_template"]
    for token in ("<think>", "<tool_call>", "<tool_response>", "<|im_start|>", "<|im_end|>"):
        assert token in specials


def test_in_memory_random_weights_and_reconfiguring_experts(tmp_path: Path) -> None:
    from freetoken.runtime.config import EngineConfig, MoeConfig
    from freetoken.runtime.engine import Engine
    from freetoken.runtime.loading.demo import random_weights

    folder = write_random_model(tmp_path / "m", SMALL, with_weights=False)
    assert not list(folder.glob("*.safetensors"))
    engine = Engine(
        EngineConfig(folder, "cpu", "float32", MoeConfig("fused")), weights=random_weights(std=0.2)
    )
    ids = [3, 99, 250, 7, 512, 14]
    ref = engine.forward(engine.new_sequence(), ids, all_logits=True)
    assert ref.std() > 0.1
    for moe in (
        MoeConfig("offload", cache_size=3),
        MoeConfig("cpu"),
        MoeConfig("hybrid", cache_ratio=0.5, pcie_gbps=20, host_gbps=80),
    ):
        engine.configure_moe(moe)
        assert engine.backend == moe.backend
        assert rel_err(engine.forward(engine.new_sequence(), ids, all_logits=True), ref) < 1e-5
    engine.close()
