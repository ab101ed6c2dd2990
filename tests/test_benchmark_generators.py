"""The benchmarks' random-weight GGUF generators write files the engine loads as they say: Qwen3-MoE with
Q4_K_M's per-layer expert types, each grouped-query family with its own attention and router, gpt-oss
with MXFP4 experts, DeepSeek-V3 with latent attention, GLM-5 with its indexer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from freetoken.runtime.engine import build_engine
from freetoken.runtime.sampling import SamplingParams

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SMALL = ["--hidden", "256", "--experts", "8", "--vocab", "2048", "--heads", "4", "--kv-heads", "2"]


def generate(script: str, out: Path, *args: str) -> None:
    subprocess.run(
        [sys.executable, str(BENCHMARKS / script), str(out), *args], check=True, capture_output=True
    )


def decode(path: Path) -> list[int]:
    engine = build_engine(path, device="cpu", dtype="float32", moe_backend="cpu")
    try:
        return [e.token_id for e in engine.generate([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))]
    finally:
        engine.close()


def test_q4_k_m_layout_by_layer(tmp_path: Path) -> None:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from random_gguf import more_bits
    finally:
        sys.path.remove(str(BENCHMARKS))
    assert [more_bits(n, 24) for n in range(24)] == [n < 3 or n >= 21 or (n - 3) % 3 == 2 for n in range(24)]
    path = tmp_path / "q.gguf"
    generate("make_qwen3moe_gguf.py", path, "--layers", "8", *SMALL, "--moe-inter", "256", "--head-dim", "64",
             "--expert-type", "Q4_K_M")  # fmt: skip
    engine = build_engine(path, device="cpu", dtype="float32", moe_backend="cpu")
    try:
        want = [("Q4_K", "Q6_K" if more_bits(n, 8) else "Q4_K") for n in range(8)]
        assert [engine.pool.codec_names(n) for n in engine.pool.layers] == want
        assert sorted(engine.pool.describe()["dtypes"]) == ["Q4_K", "Q6_K"]
    finally:
        engine.close()
    assert len(decode(path)) == 4


# --family -> (architecture, qk_norm, attention_bias, router_scoring, shared experts, MoE layers, rotary)
FAMILY_FIELDS = {
    "qwen3moe": ("qwen3_moe", "head", False, "softmax", 0, (0, 1, 2), 1.0),
    "olmoe": ("olmoe", "full", False, "softmax", 0, (0, 1, 2), 1.0),
    "glm4moe": ("glm4_moe", "none", True, "sigmoid", 1, (1, 2), 0.5),
    "minimax-m2": ("minimax_m2", "full", False, "sigmoid", 0, (0, 1, 2), 0.5),
    "mixtral": ("mixtral", "none", False, "softmax", 0, (0, 1, 2), 1.0),
}


@pytest.mark.parametrize("family", sorted(FAMILY_FIELDS))
def test_family_generator_writes_each_familys_layout(tmp_path: Path, family: str) -> None:
    path = tmp_path / "f.gguf"
    shape = ["--top-k", "2", "--moe-inter", "256", "--head-dim", "128", "--dense-inter", "384"]
    generate(
        "make_family_gguf.py",
        path,
        "--family",
        family,
        "--layers",
        "3",
        *SMALL,
        *shape,
        "--expert-type",
        "Q8_0",
    )
    arch, qk_norm, bias, scoring, shared, moe_layers, rotary = FAMILY_FIELDS[family]
    engine = build_engine(path, device="cpu", dtype="float32", moe_backend="cpu")
    try:
        cfg = engine.config
        assert (cfg.architecture, cfg.qk_norm, cfg.attention_bias, cfg.router_scoring) == (
            arch,
            qk_norm,
            bias,
            scoring,
        )
        assert (cfg.n_shared_experts, cfg.moe_layers, cfg.rope.partial_rotary_factor) == (
            shared,
            moe_layers,
            rotary,
        )
        assert (cfg.num_kv_heads, cfg.head_dim, cfg.moe_intermediate_size, cfg.num_experts_per_tok) == (
            2,
            128,
            256,
            2,
        )
        assert engine.pool.describe()["dtypes"] == ["Q8_0"]
    finally:
        engine.close()
    assert len(decode(path)) == 4


def test_family_generator_falls_back_to_q8_0_where_k_blocks_do_not_divide_a_row(tmp_path: Path) -> None:
    path = tmp_path / "g.gguf"
    shape = ["--moe-inter", "1408", "--head-dim", "64", "--dense-inter", "384"]
    generate(
        "make_family_gguf.py",
        path,
        "--family",
        "glm4moe",
        "--layers",
        "2",
        *SMALL,
        *shape,
        "--expert-type",
        "Q4_K_M",
    )
    engine = build_engine(path, device="cpu", dtype="float32", moe_backend="cpu")
    try:  # the dense first layer has no experts; gate/up rows are 256 wide, down rows 1408
        assert [engine.pool.codec_names(n) for n in engine.pool.layers] == [("Q4_K", "Q8_0")]
    finally:
        engine.close()


def test_gpt_oss_generator_keeps_mxfp4_experts(tmp_path: Path) -> None:
    path = tmp_path / "o.gguf"
    generate("make_gpt_oss_gguf.py", path, "--layers", "2", *SMALL, "--moe-inter", "256", "--head-dim", "64")
    engine = build_engine(path, device="cpu", dtype="float32", moe_backend="cpu")
    try:
        assert engine.pool.describe()["dtypes"] == ["MXFP4"]
    finally:
        engine.close()
    assert len(decode(path)) == 4


def test_deepseek_generator_writes_latent_attention_and_grouped_routing(tmp_path: Path) -> None:
    path = tmp_path / "d.gguf"
    generate("make_deepseek_gguf.py", path, "--layers", "3", "--dense-layers", "1", "--hidden", "256",
             "--experts", "16", "--groups", "4", "--group-topk", "2", "--moe-inter", "256", "--inter", "384",
             "--heads", "4", "--q-lora-rank", "64", "--kv-lora-rank", "32", "--vocab", "2048")  # fmt: skip
    engine = build_engine(path, device="cpu", dtype="float32", moe_backend="cpu")
    try:
        cfg = engine.config
        assert (cfg.architecture, cfg.kv_lora_rank, cfg.n_group, cfg.topk_group) == ("deepseek_v3", 32, 4, 2)
        assert cfg.moe_layers == (1, 2) and cfg.n_shared_experts == 1 and cfg.routed_scaling_factor == 2.5
        assert engine.pool.describe()["dtypes"] == ["Q4_K"]
    finally:
        engine.close()
    assert len(decode(path)) == 4
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from peer_llamacpp import expert_tensors, tensor_split
    finally:
        sys.path.remove(str(BENCHMARKS))
    tensors = expert_tensors(path)  # the dense layer 0 has none; gate, up, down of layers 1 and 2
    assert [name for name, _ in tensors] == [
        f"blk.{layer}.ffn_{kind}_exps.weight" for layer in (1, 2) for kind in ("gate", "up", "down")
    ]
    assert len({size for _, size in tensors}) == 1
    assert tensor_split(0.11, tensors) == (tuple(name for name, _ in tensors[:5]), 1 / 6)
    assert tensor_split(0.5, tensors)[1] == 0.5 and tensor_split(0.0, tensors)[1] == 0.0


def test_deepseek_generator_writes_glm5_with_its_indexer(tmp_path: Path) -> None:
    path = tmp_path / "g.gguf"
    generate("make_deepseek_gguf.py", path, "--family", "glm-dsa", "--layers", "3", "--dense-layers", "1",
             "--hidden", "256", "--experts", "16", "--moe-inter", "256", "--inter", "384", "--heads", "4",
             "--q-lora-rank", "64", "--kv-lora-rank", "32", "--vocab", "2048")  # fmt: skip
    engine = build_engine(path, device="cpu", dtype="float32", moe_backend="cpu")
    try:
        cfg = engine.config
        assert (cfg.architecture, cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (
            "glm_moe_dsa",
            32,
            128,
            2048,
        )
        assert (cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.n_group, cfg.indexer_shared_layers) == (
            192,
            256,
            1,
            (),
        )
        assert cfg.moe_layers == (1, 2)
    finally:
        engine.close()
    assert len(decode(path)) == 4


def test_bootstrap_times_a_gguf_file_against_its_read(tmp_path: Path) -> None:
    path = tmp_path / "b.gguf"
    generate("make_qwen3moe_gguf.py", path, "--layers", "2", *SMALL, "--moe-inter", "256", "--head-dim", "64",
             "--expert-type", "Q8_0")  # fmt: skip
    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bootstrap.py"), "--gguf", str(path), "--json"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    doc = json.loads(run.stdout)
    row = doc["rows"]["gguf"]
    assert doc["bytes"] == path.stat().st_size and doc["floor_s"] > 0
    assert 0 < row["load_s"] <= row["ttft_s"] and row["over_floor"] == row["load_s"] / doc["floor_s"]


def test_random_expert_blocks_are_zero_mean() -> None:
    """Random blocks under unsigned scales and mins had a mean of up to 1.8 × their spread (Q4_K 0.9,
    Q5_1 1.8): every row's product shared one direction and routing collapsed within a few layers."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from random_gguf import GGML_TYPES, random_experts
    finally:
        sys.path.remove(str(BENCHMARKS))
    from freetoken.codecs import get_codec

    rng = np.random.default_rng(0)
    for kind in GGML_TYPES:
        w = get_codec(kind).dequantize(random_experts(rng, kind, 4, 64, 512), 512)
        assert abs(float(w.mean())) < 0.06 * float(w.std()), kind


QWEN35_SMALL = ["--layers", "4", "--hidden", "256", "--experts", "32", "--top-k", "4", "--moe-inter", "256",
                "--shared-inter", "128", "--heads", "4", "--kv-heads", "2", "--head-dim", "64",
                "--linear-heads", "2", "--linear-dim", "32", "--vocab", "2048"]  # fmt: skip


def lru_decode_miss_rate(path: Path, capacity: float) -> float:
    """A global LRU over `capacity` of the experts, replayed on 64 tokens decoded at temperature 1."""
    from freetoken.replay.policies import lru
    from freetoken.replay.recorder import attach_recorder

    engine = build_engine(path, device="cpu", dtype="float32", moe_backend="cpu")
    try:
        recorder = attach_recorder(engine)
        params = SamplingParams(max_tokens=64, ignore_eos=True, temperature=1.0, seed=1)
        list(engine.generate(list(range(5, 37)), params))
        trace = recorder.trace()
    finally:
        engine.close()
    return lru(trace, int(capacity * trace.num_experts * trace.num_layers)).decode_miss_rate


def test_qwen35_generator_writes_qwen36_layers_and_states_its_routing(tmp_path: Path) -> None:
    uniform, skewed = tmp_path / "u.gguf", tmp_path / "s.gguf"
    generate("make_qwen35_gguf.py", uniform, *QWEN35_SMALL, "--expert-type", "Q4_K_M")
    generate("make_qwen35_gguf.py", skewed, *QWEN35_SMALL, "--expert-type", "Q4_K_M", "--router-skew", "1.5")
    engine = build_engine(uniform, device="cpu", dtype="float32", moe_backend="cpu")
    try:
        cfg = engine.config
        assert cfg.architecture == "qwen3_5_moe_text" and cfg.num_experts == 32
        mixers = [type(layer.mixer).__name__ for layer in engine.model.model.layers]
        assert mixers == ["GatedDeltaNet"] * 3 + ["GatedAttention"]
        assert sorted(engine.pool.describe()["dtypes"]) == ["Q4_K", "Q6_K"]
    finally:
        engine.close()
    assert len(decode(uniform)) == 4
    # near-uniform routing misses most of what a 37 % cache does not hold; a stated skew far less
    miss_uniform, miss_skewed = lru_decode_miss_rate(uniform, 0.37), lru_decode_miss_rate(skewed, 0.37)
    assert miss_uniform > 0.45, miss_uniform
    assert miss_skewed < miss_uniform - 0.15, (miss_uniform, miss_skewed)


@pytest.mark.parametrize("family", ["glm4moe", "qwen3moe"])
def test_family_files_route_near_uniformly_without_a_skew(tmp_path: Path, family: str) -> None:
    """Router rows of std 0.5 saturated a sigmoid router (GLM-4.5's) to 1.0 for most experts, so the
    correction bias alone chose — the same experts for every token."""
    path = tmp_path / "f.gguf"
    shape = ["--hidden", "512", "--experts", "32", "--top-k", "4", "--moe-inter", "256", "--head-dim", "64"]
    generate("make_family_gguf.py", path, "--family", family, "--layers", "4", "--vocab", "2048", "--heads",
             "4", "--kv-heads", "2", "--dense-inter", "256", *shape, "--expert-type", "Q4_K")  # fmt: skip
    assert lru_decode_miss_rate(path, 0.37) > 0.45


V4_TINY = {"hidden_size": 64, "moe_intermediate_size": 64, "intermediate_size": 64, "q_lora_rank": 32,
           "o_lora_rank": 16, "o_groups": 2, "num_attention_heads": 4, "head_dim": 32, "index_n_heads": 2,
           "index_head_dim": 16, "vocab_size": 2048, "qk_rope_head_dim": 4, "n_routed_experts": 16,
           "index_topk": 16, "sliding_window": 8}  # fmt: skip


def test_deepseek_v4_generator_writes_the_published_form(tmp_path: Path) -> None:
    """V4-Flash's layer kinds (hash-routed, then score-routed; heavily compressed, then compressed-sparse)
    as DeepSeek publishes them, FP4 experts kept as MXFP4; llama.cpp's converter (where fetched) makes a
    GGUF of it that decodes the folder's own greedy tokens."""
    folder = tmp_path / "v4"
    generate("make_deepseek_v4.py", folder, "--layers", "4", "--shape", json.dumps(V4_TINY))
    engine = build_engine(folder, device="cpu", dtype="float32", moe_backend="cpu")
    try:
        cfg = engine.config
        assert cfg.architecture == "deepseek_v4" and cfg.vocab_size == 2048
        assert cfg.hash_layers == (0, 1, 2) and engine.pool.describe()["dtypes"] == ["MXFP4"]
    finally:
        engine.close()
    want = decode(folder)
    converter = Path(__file__).resolve().parent.parent / ".cache" / "llama-cpp-converter"
    if not (converter / "convert_hf_to_gguf.py").is_file():
        pytest.skip("llama.cpp's converter not fetched (make llama-cpp-converter)")
    gguf_path = tmp_path / "v4.gguf"
    driver = Path(__file__).resolve().parent / "llama_cpp_convert.py"
    subprocess.run([sys.executable, str(driver), str(converter), str(folder), str(gguf_path),
                    "DeepseekV4ForCausalLM"], check=True, capture_output=True)  # fmt: skip
    assert decode(gguf_path) == want
