"""Mixtral, OLMoE, GLM-4.5, MiniMax-M2, gpt-oss, DeepSeek-V3/V3.2/V4, GLM-5 and Kimi-Linear against
transformers' implementations on tiny odd-shaped random models: the config, fp32 logits on the prompt and
16 decode steps, and the reference's 32 greedy tokens under every MoE backend and cache size {top-k, 25%,
100%}."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from freetoken.runtime.engine import build_engine
from freetoken.runtime.sampling import SamplingParams
from oracle import FAMILY_TINY, assert_follows_cached_decode, build_family_model, rel_err

PROMPT = [5, 77, 301, 12, 9, 250, 33, 401, 18, 2, 64, 111]
POOL = 6 * 2  # experts per layer x MoE layers (GLM's first layer is dense: at most this many)
BACKENDS = [
    ("fused", {}),
    ("offload", {"cache_size": 3}),
    ("offload", {"cache_size": POOL // 4}),
    ("offload", {"cache_size": POOL}),
    ("cpu", {"cache_size": 3}),
    ("cpu", {}),
    ("hybrid", {"cache_size": POOL // 4, "pcie_gbps": 25.0, "host_gbps": 100.0}),
    ("hybrid", {"cache_size": POOL, "pcie_gbps": 25.0, "host_gbps": 100.0}),
]


@pytest.fixture(scope="module", params=list(FAMILY_TINY))
def family_model(request: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Any]:
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    return request.param, folder, build_family_model(folder, request.param)


def reference(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_config(family_model: tuple[str, Path, Any]) -> None:
    family, folder, _ = family_model
    cfg = build_engine(folder, device="cpu", dtype="float32", moe_backend="fused").config
    assert cfg.architecture == family
    grouped = ("glm4_moe", "deepseek_v3", "deepseek_v32", "glm_moe_dsa", "kimi_linear")  # a dense first layer
    assert cfg.moe_layers == ((1, 2) if family in grouped else (0, 1, 2))
    assert cfg.num_experts == 6 and cfg.num_experts_per_tok == 3 and cfg.moe_intermediate_size == 40
    assert cfg.norm_topk_prob == (family != "olmoe")
    norms = {"mixtral": "none", "olmoe": "full", "glm4_moe": "head", "minimax_m2": "full"}
    assert cfg.qk_norm == norms.get(family, "none")
    scoring = {
        "glm4_moe": "sigmoid",
        "minimax_m2": "sigmoid",
        "gpt_oss": "topk_softmax",
        "deepseek_v3": "sigmoid",
        "deepseek_v32": "sigmoid",
        "glm_moe_dsa": "sigmoid",
        "kimi_linear": "sigmoid",
        "deepseek_v4": "sqrtsoftplus",
    }
    assert cfg.router_scoring == scoring.get(family, "softmax")
    assert cfg.clip_qkv == (2.5 if family == "olmoe" else None)
    if family == "glm4_moe":
        assert (cfg.router_scoring, cfg.n_group, cfg.topk_group, cfg.n_shared_experts) == ("sigmoid", 2, 1, 1)
        assert cfg.routed_scaling_factor == 1.7 and cfg.rope.partial_rotary_factor == 0.5
    if family == "deepseek_v3":
        assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.v_head_dim) == (24, 16, 4, 10)
        assert cfg.kv_dims == (1, 20, 0) and cfg.rope_interleave and cfg.rope.mscale_all_dim == 1.0
        assert (cfg.n_group, cfg.n_shared_experts, cfg.routed_scaling_factor) == (2, 1, 1.7)
    if family == "deepseek_v4":
        kinds = ("compressed_sparse_attention", "sliding_attention", "heavily_compressed_attention")
        assert (cfg.layer_kinds, cfg.hash_layers, cfg.csa_rate, cfg.hca_rate) == (kinds, (0,), 3, 5)
        assert (cfg.hc_mult, cfg.o_groups, cfg.o_lora_rank, cfg.qk_rope_head_dim) == (3, 2, 10, 6)
        assert cfg.rope.type == "default" and cfg.compress_rope.type == "yarn"
        assert cfg.compress_rope.attention_factor == 1.0 and cfg.compress_rope.theta == 160000.0
        assert (cfg.expert_act, cfg.swiglu_limit) == ("clamped_silu", 10.0)
    if family == "mixtral":
        assert (cfg.sliding_window, cfg.sliding_layers, cfg.attention_sinks) == (5, (0, 1, 2), False)
    if family == "gpt_oss":
        assert (cfg.sliding_window, cfg.sliding_layers, cfg.attention_sinks) == (4, (0, 2), True)
        assert (cfg.expert_act, cfg.swiglu_limit, cfg.expert_bias, cfg.router_bias) == (
            "clamped",
            0.6,
            True,
            True,
        )
        assert cfg.rope.type == "yarn" and cfg.attention_bias


def test_prompt_and_decode_logits(family_model: tuple[str, Path, Any]) -> None:
    _, folder, model = family_model
    engine = build_engine(folder, device="cpu", dtype="float32", moe_backend="fused")
    seq = engine.new_sequence()
    ids = list(PROMPT)
    assert rel_err(engine.forward(seq, ids, all_logits=True), reference(model, ids)) < 1e-4
    for _ in range(16):
        ids.append(int(reference(model, ids)[-1].argmax()))
        assert rel_err(engine.forward(seq, ids[-1:])[-1], reference(model, ids)[-1]) < 1e-4


def test_every_family_decodes_by_its_static_step(family_model: tuple[str, Path, Any]) -> None:
    """Every family decodes over the static KV pool (CUDA graphs on a GPU), so the tests below check that
    step against transformers."""
    _, folder, _ = family_model
    engine = build_engine(folder, device="cpu", dtype="float32", moe_backend="fused")
    try:
        assert [e.token_id for e in engine.generate([3, 4], SamplingParams(max_tokens=3, ignore_eos=True))]
        assert engine.decoder.steps == 2  # the first token comes from the prefill
    finally:
        engine.close()


@pytest.mark.parametrize(("backend", "options"), BACKENDS)
def test_every_backend_gives_the_reference_greedy_tokens(
    family_model: tuple[str, Path, Any], backend: str, options: dict
) -> None:
    _, folder, model = family_model
    ids = list(PROMPT)
    for _ in range(32):
        ids.append(int(reference(model, ids)[-1].argmax()))
    engine = build_engine(folder, device="cpu", dtype="float32", moe_backend=backend, **options)
    try:
        out = engine.generate(PROMPT, SamplingParams(max_tokens=32, ignore_eos=True))
        assert [e.token_id for e in out] == ids[len(PROMPT) :]
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("backend", "options"),
    [("fused", {}), ("offload", {"cache_size": 3}), ("cpu", {"cache_size": 3}), BACKENDS[-2]],
)
def test_three_sequences_decoded_together_give_each_ones_reference(
    family_model: tuple[str, Path, Any], backend: str, options: dict
) -> None:
    from scheduler_runs import PROMPTS, greedy

    _, folder, model = family_model
    prompts = PROMPTS[:3]
    want = []
    for prompt in prompts:
        ids = list(prompt)
        for _ in range(12):
            ids.append(int(reference(model, ids)[-1].argmax()))
        want.append(ids[len(prompt) :])
    engine = build_engine(folder, device="cpu", dtype="float32", moe_backend=backend, **options)
    try:
        assert greedy(engine, prompts, 12) == want
    finally:
        engine.close()


def test_a_missing_field_names_the_field_and_the_file(
    family_model: tuple[str, Path, Any], tmp_path: Path
) -> None:
    import json

    from freetoken.errors import FreeTokenError
    from freetoken.runtime.models import load_model_config

    _, folder, _ = family_model
    raw = json.loads((folder / "config.json").read_text())
    raw.pop("num_experts_per_tok", None)
    raw.pop("num_experts_per_token", None)  # Kimi-Linear's spelling as saved
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(FreeTokenError, match=r"config\.json.*num_experts_per_tok"):
        load_model_config(tmp_path)


GGUF_SHAPE = dict(hidden_size=64, intermediate_size=64, head_dim=16)  # rows of whole Q8_0 blocks


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
@pytest.mark.parametrize(
    "family", ["mixtral", "olmoe", "glm4_moe", "minimax_m2", "gpt_oss", "deepseek_v3", "glm_moe_dsa"]
)
def test_a_gguf_of_the_same_weights(family: str, qtype: str, tmp_path: Path) -> None:
    """The families llama.cpp reads here (its `olmoe`, `glm4moe`, `minimax-m2`, `gpt-oss`, and Mixtral as
    `llama` with experts and q/k rows permuted for its rope; GLM's file with a next-token block after the
    trunk, which is skipped): the GGUF gives the logits and greedy tokens of
    transformers given the file's dequantised weights; the cpu backend keeps Q8_0 experts as stored."""
    from gguf_fixture import dequantised_state_dict, write_gguf

    folder = tmp_path / family
    extra = {
        "glm4_moe": {"moe_intermediate_size": 64},
        "minimax_m2": {"rotary_dim": 8},
        "gpt_oss": {"swiglu_limit": 7.0},  # llama.cpp's graph has no other
        "mixtral": {"sliding_window": None},  # llama.cpp's `llama` graph has no window
        "deepseek_v3": {  # rows of whole Q8_0 blocks: k_b's are qk_nope_head_dim long, o_proj's heads · dv
            "moe_intermediate_size": 64,
            "head_dim": 4,
            "kv_lora_rank": 32,
            "q_lora_rank": 32,
            "qk_nope_head_dim": 32,
            "v_head_dim": 8,
        },
    }
    extra["glm_moe_dsa"] = {**extra["deepseek_v3"], "index_head_dim": 32, "index_topk": 6}
    extra = extra.get(family, {})
    shape = {**GGUF_SHAPE, **extra}
    model = build_family_model(folder, family, **shape)
    path = write_gguf(model, folder, tmp_path / f"{family}-{qtype}.gguf", qtype)
    ref = type(model)(model.config).eval()
    ref.load_state_dict(dequantised_state_dict(path, model))
    engine = build_engine(path, device="cpu", dtype="float32", moe_backend="cpu")
    try:
        cfg = engine.config
        assert cfg.architecture == family and cfg.num_layers == 3
        if family == "olmoe":
            assert not cfg.norm_topk_prob and cfg.clip_qkv == 2.5
        elif family == "deepseek_v3":
            geometry = (cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.rope_interleave)
            assert geometry == (32, 32, 8, True)
            assert cfg.rope.type == "yarn" and cfg.rope.mscale_all_dim == pytest.approx(1.0)
            assert cfg.moe_layers == (1, 2) and cfg.n_group == 2 and cfg.n_shared_experts == 1
        elif family == "glm_moe_dsa":  # layer 2 has no indexer in the file: it reuses layer 1's choice
            assert (cfg.index_topk, cfg.index_head_dim, cfg.indexer_shared_layers) == (6, 32, (2,))
        elif family == "mixtral":
            assert cfg.qk_norm == "none" and cfg.moe_intermediate_size == 64 and cfg.sliding_window is None
        elif family == "gpt_oss":
            assert (cfg.sliding_window, cfg.sliding_layers, cfg.expert_bias) == (4, (0, 2), True)
            assert cfg.rope.type == "yarn" and cfg.moe_intermediate_size == 64
        elif family == "minimax_m2":
            assert (
                cfg.router_scoring == "sigmoid" and cfg.qk_norm == "full" and cfg.moe_intermediate_size == 64
            )
            assert cfg.rope.partial_rotary_factor == 0.5
        else:
            got = (cfg.router_scoring, cfg.n_group, cfg.n_shared_experts, cfg.moe_layers)
            assert got == ("sigmoid", 2, 1, (1, 2))
            assert cfg.rope.partial_rotary_factor == 0.5 and cfg.qk_norm == "head" and cfg.attention_bias
        assert engine.pool.describe()["dtypes"] == (["Q8_0"] if qtype == "Q8_0" else ["f32"])
        got = engine.forward(engine.new_sequence(), PROMPT, all_logits=True)
        assert rel_err(got, reference(ref, PROMPT)) < 1e-4
        ids = list(PROMPT)
        for _ in range(16):
            ids.append(int(reference(ref, ids)[-1].argmax()))
        out = engine.generate(PROMPT, SamplingParams(max_tokens=16, ignore_eos=True))
        assert [e.token_id for e in out] == ids[len(PROMPT) :]
    finally:
        engine.close()


@pytest.mark.parametrize("expert_dtype", ["stored", "Q8_0"])
def test_gpt_oss_through_ftw_keeps_its_expert_biases(tmp_path: Path, expert_dtype: str) -> None:
    """FTW stores the experts' biases beside the banks (fp32, never quantized): the converted folder gives
    the reference's greedy tokens (fp32 banks); with Q8_0 banks the cpu backend computing from the blocks
    gives the tokens of the fused backend over the same banks dequantised at load."""
    from freetoken.runtime.loading.convert import convert_to_ftw

    model = build_family_model(tmp_path / "hf", "gpt_oss", hidden_size=64, intermediate_size=64, head_dim=16)
    out = tmp_path / "ftw"
    convert_to_ftw(tmp_path / "hf", out, dtype="float32", expert_dtype=expert_dtype)
    runs = {}
    for backend in ("cpu", "fused"):
        engine = build_engine(out, device="cpu", dtype="float32", moe_backend=backend)
        try:
            assert engine.pool.biased and engine.pool.fn.kind == "clamped"
            if backend == "cpu":
                assert engine.pool.describe()["dtypes"] == (
                    [expert_dtype] if expert_dtype != "stored" else ["f32"]
                )
            params = SamplingParams(max_tokens=12, ignore_eos=True)
            runs[backend] = [e.token_id for e in engine.generate(PROMPT, params)]
        finally:
            engine.close()
    assert runs["cpu"] == runs["fused"]
    if expert_dtype == "stored":
        ids = list(PROMPT)
        for _ in range(12):
            ids.append(int(reference(model, ids)[-1].argmax()))
        assert runs["cpu"] == ids[len(PROMPT) :]


def write_mxfp4_gpt_oss(folder: Path) -> Any:
    """A tiny gpt-oss checkpoint whose experts are MXFP4 as OpenAI publishes them (`*_blocks` [E, R, C/32,
    16] with weights 2j, 2j+1 in a byte's low and high nibble, `*_scales` e8m0 [E, R, C/32]); -> transformers'
    model with the weights its own MXFP4 dequantiser gives (the reference)."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model = build_family_model(folder, "gpt_oss", hidden_size=64, intermediate_size=64, head_dim=16)
    state = load_file(str(folder / "model.safetensors"))
    gen = torch.Generator().manual_seed(9)
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, c, r = state.pop(name).shape  # [E, in, out]
        blocks = torch.randint(0, 256, (e, r, c // 32, 16), generator=gen, dtype=torch.uint8)
        scales = torch.randint(121, 125, (e, r, c // 32), generator=gen, dtype=torch.uint8)  # 2^-6 .. 2^-3
        state[name + "_blocks"], state[name + "_scales"] = blocks, scales
        value = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
        model.get_parameter(name).data.copy_(value)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return model


def test_gpt_oss_mxfp4_experts_kept_as_stored(tmp_path: Path) -> None:
    """Published gpt-oss experts: the cpu backend keeps them MXFP4 (pool bytes 17 per 32 weights), from the
    folder or its FTW conversion, and the fused backend dequantises them; all give the logits and greedy
    tokens of transformers' own dequantisation."""
    from freetoken.runtime.loading.convert import convert_to_ftw

    model = write_mxfp4_gpt_oss(tmp_path / "hf")
    convert_to_ftw(tmp_path / "hf", tmp_path / "ftw", dtype="float32")  # keeps the MXFP4 rows
    ids = list(PROMPT)
    for _ in range(12):
        ids.append(int(reference(model, ids)[-1].argmax()))
    for folder, backend in ((tmp_path / "hf", "cpu"), (tmp_path / "hf", "fused"), (tmp_path / "ftw", "cpu")):
        engine = build_engine(folder, device="cpu", dtype="float32", moe_backend=backend)
        try:
            if backend == "cpu":
                pool = engine.pool
                assert pool.describe()["dtypes"] == ["MXFP4"]
                weights = 3 * 64 * 64 * 6 * 3  # [gate, up, down] x H x I x experts x layers
                biases = (2 * 64 + 64) * 6 * 3 * 4
                assert pool.nbytes == weights // 32 * 17 + biases
            got = engine.forward(engine.new_sequence(), PROMPT, all_logits=True)
            assert rel_err(got, reference(model, PROMPT)) < 1e-4
            out = engine.generate(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))
            assert [e.token_id for e in out] == ids[len(PROMPT) :]
        finally:
            engine.close()


def test_an_older_mixtral_gguf_with_one_tensor_per_expert(tmp_path: Path) -> None:
    """Mixtral GGUFs converted before whole-layer banks hold `blk.N.ffn_gate.E.weight` and the like."""
    from gguf_fixture import dequantised_state_dict, write_gguf

    model = build_family_model(tmp_path / "hf", "mixtral", sliding_window=None, **GGUF_SHAPE)
    path = write_gguf(model, tmp_path / "hf", tmp_path / "mixtral.gguf", "F32", one_per_expert=True)
    ref = type(model)(model.config).eval()
    ref.load_state_dict(dequantised_state_dict(path, model))
    engine = build_engine(path, device="cpu", dtype="float32", moe_backend="offload", cache_size=4)
    try:
        assert (
            rel_err(engine.forward(engine.new_sequence(), PROMPT, all_logits=True), reference(ref, PROMPT))
            < 1e-4
        )
    finally:
        engine.close()


def test_latent_attention_decodes_absorbed_as_expanded(tmp_path: Path) -> None:
    """MLA: a decode step in the absorbed form (scores against the cached latent) gives the expanded
    form's output, and the cache holds one latent and rope key per position: (r + d_rope) numbers against
    heads × (d_qk + d_v)."""
    build_family_model(tmp_path, "deepseek_v3")
    engine = build_engine(tmp_path, device="cpu", dtype="float32", moe_backend="fused")
    attn = engine.model.model.layers[0].self_attn
    seq = engine.new_sequence()
    engine.forward(seq, PROMPT)
    x = torch.randn(1, engine.config.hidden_size)
    cos, sin = engine.model.rotary(torch.tensor([len(PROMPT)]), x.dtype)
    q_nope, q_pe, latent, _ = attn._project(x, cos, sin)
    cache = torch.cat((seq.kv.k[0][:, : len(PROMPT)], latent), dim=1)
    torch.testing.assert_close(
        attn._absorbed(q_nope, q_pe, cache), attn._expanded(q_nope, q_pe, cache), rtol=1e-5, atol=1e-6
    )
    report = engine.memory_report()
    layers = engine.config.num_layers
    assert report["kv_bytes_per_token"] == layers * (16 + 4) * 4
    assert report["kv_bytes_per_token_expanded"] == layers * 4 * (12 + 10) * 4


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_multi_token_prediction_blocks_are_skipped(family: str, tmp_path: Path) -> None:
    """Published DeepSeek-V3 and GLM-4.5 checkpoints append `num_nextn_predict_layers` blocks after the
    trunk: skipped when the config declares them, unexpected tensors otherwise."""
    import json

    from safetensors.torch import load_file, save_file

    from freetoken.errors import FreeTokenError

    model = build_family_model(tmp_path / "m", family)
    state = load_file(str(tmp_path / "m" / "model.safetensors"))
    state["model.layers.3.eh_proj.weight"] = torch.zeros(48, 96)
    state["model.layers.3.mlp.experts.0.gate_proj.weight"] = torch.zeros(40, 48)
    save_file(state, str(tmp_path / "m" / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1  # transformers' default for both
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(FreeTokenError, match=r"unexpected tensors: model\.layers\.3\."):
        build_engine(tmp_path / "m", device="cpu", dtype="float32", moe_backend="fused")
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    engine = build_engine(tmp_path / "m", device="cpu", dtype="float32", moe_backend="fused")
    got = engine.forward(engine.new_sequence(), PROMPT, all_logits=True)
    assert rel_err(got, reference(model, PROMPT)) < 1e-4


@pytest.mark.parametrize(
    ("backend", "options"),
    [
        ("offload", {"cache_size": 8}),
        ("hybrid", {"cache_ratio": 0.25, "pcie_gbps": 25.0, "host_gbps": 100.0}),
    ],
)
def test_deepseek_v3_at_full_expert_count(tmp_path: Path, backend: str, options: dict) -> None:
    """DeepSeek-V3's routing at its real scale with a tiny hidden size: 256 experts a layer in 8 groups of
    which 4 are kept, 8 chosen; the slots (top-k, then 25% of the pool), the global LRU and the residency
    give the reference's greedy tokens."""
    overrides = dict(
        n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4, moe_intermediate_size=8,
        hidden_size=32,
    )  # fmt: skip
    model = build_family_model(tmp_path, "deepseek_v3", **overrides)
    ids = list(PROMPT)
    for _ in range(12):
        ids.append(int(reference(model, ids)[-1].argmax()))
    engine = build_engine(tmp_path, device="cpu", dtype="float32", moe_backend=backend, **options)
    try:
        assert engine.pool.num_experts == 256 and engine.num_slots == (8 if backend == "offload" else 128)
        out = engine.generate(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))
        assert [e.token_id for e in out] == ids[len(PROMPT) :]
    finally:
        engine.close()


def test_an_older_deepseek2_gguf_with_kv_b_whole(tmp_path: Path) -> None:
    """deepseek2 files converted before llama.cpp split kv_b_proj (attn_kv_b) read the same."""
    from gguf_fixture import dequantised_state_dict, write_gguf

    shape = {**GGUF_SHAPE, "moe_intermediate_size": 64, "head_dim": 4, "kv_lora_rank": 32, "q_lora_rank": 32}
    model = build_family_model(tmp_path / "hf", "deepseek_v3", **shape)
    path = write_gguf(model, tmp_path / "hf", tmp_path / "ds.gguf", "F32", split_kv_b=False)
    ref = type(model)(model.config).eval()
    ref.load_state_dict(dequantised_state_dict(path, model))
    engine = build_engine(path, device="cpu", dtype="float32", moe_backend="offload", cache_size=3)
    try:
        got = engine.forward(engine.new_sequence(), PROMPT, all_logits=True)
        assert rel_err(got, reference(ref, PROMPT)) < 1e-4
    finally:
        engine.close()


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_sparse_attention_keeps_the_indexers_choice(tmp_path: Path, family: str) -> None:
    """DeepSeek-V3.2 and GLM-5 (its layer 2 reusing layer 1's choice) with each query seeing 4 of its
    positions: the prompt's logits are transformers' (the whole prompt in one pass), and 16 decode steps
    give those of transformers decoding with its cache. Sixteen index heads keep scores from tying at zero
    (with four, a key no head's relu passes often scores exactly 0): at a tie torch's top-k picks by its
    algorithm, ours the earlier position (dsa.top_positions), so only tie-free choices can be compared."""
    model = build_family_model(tmp_path, family, index_topk=4, index_n_heads=16)
    engine = build_engine(tmp_path, device="cpu", dtype="float32", moe_backend="offload", cache_size=3)
    assert engine.config.index_topk == 4 and engine.config.kv_dims == (1, 20, 8)
    shared = (2,) if family == "glm_moe_dsa" else ()
    assert (engine.config.indexer_shared_layers, engine.config.index_rope_interleave) == (
        shared,
        bool(shared),
    )
    assert_follows_cached_decode(engine, model, PROMPT, 16, "past_key_values")
    engine.close()
