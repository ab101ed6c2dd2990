"""The oracle side of the tests: tiny random transformers models saved to disk, and error measures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from freetoken.runtime.text.demo_tokenizer import write_demo_tokenizer

TINY: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    mlp_only_layers=[1],
    norm_topk_prob=True,
    max_position_embeddings=1024,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)


# A tiny Qwen3.5-MoE text model: three DeltaNet layers and one gated full-attention layer.
HYBRID_TINY: dict[str, Any] = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    num_experts=8,
    num_experts_per_tok=2,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    max_position_embeddings=1024,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)


def build_hf_model(folder: Path, seed: int = 0, std: float = 0.15, **overrides: Any) -> Any:
    """Save a random transformers Qwen3MoeForCausalLM (plus the demo tokenizer) into `folder`.

    Weights are redrawn with a large std so logits and routing are far from uniform: greedy choices
    then have margins that rounding cannot flip, and different experts really get chosen.
    """
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_demo_tokenizer(folder)
    cfg = Qwen3MoeConfig(vocab_size=vocab, **{**TINY, **overrides})
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(std * torch.randn(param.shape, generator=gen))
    model.eval()
    model.save_pretrained(folder)
    return model


def build_hybrid_model(folder: Path, seed: int = 0, wrapped: bool = False, **overrides: Any) -> Any:
    """Save a random transformers Qwen3_5MoeForCausalLM (HYBRID_TINY with `overrides`, demo tokenizer) into
    `folder`; with `wrapped`, inside Qwen3_5MoeForConditionalGeneration with a tiny vision tower, as Qwen
    publishes it."""
    from transformers import (
        Qwen3_5MoeConfig,
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeForConditionalGeneration,
        Qwen3_5MoeTextConfig,
    )

    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_demo_tokenizer(folder)
    torch.manual_seed(seed)
    if wrapped:
        vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=64)
        cfg_vl = Qwen3_5MoeConfig(
            text_config={**HYBRID_TINY, "vocab_size": vocab}, vision_config={**vision, "patch_size": 4}
        )
        model = Qwen3_5MoeForConditionalGeneration(cfg_vl).eval()
    else:
        text = Qwen3_5MoeTextConfig(vocab_size=vocab, **{**HYBRID_TINY, **overrides})
        model = Qwen3_5MoeForCausalLM(text).eval()
    return save_redrawn(model, folder, seed)


def save_redrawn(model: Any, folder: Path, seed: int, whole_banks: bool = False) -> Any:
    """Redraw a hybrid model's weights (norms 0.1, the rest 0.15 std: decisive routing and logits) and
    save it into `folder`: as transformers publishes it (one tensor per expert where the family's
    checkpoints have them), or with `whole_banks` as it holds them (one [E, 2I, H] gate_up and [E, H, I]
    down bank per layer; far faster to write and read at hundreds of experts)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((0.1 if "norm" in name else 0.15) * torch.randn(p.shape, generator=gen))
    if whole_banks:
        from safetensors.torch import save_file

        model.config.save_pretrained(folder)
        state = {name: t.contiguous() for name, t in model.state_dict().items()}
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    else:
        model.save_pretrained(folder)
    return model


# Every MoE backend and a chunked prefill, as the hybrid oracle tests run them: (backend, build options).
HYBRID_BACKEND_CASES = [
    ("fused", {}),
    ("offload", {"cache_size": 3}),
    ("cpu", {"cache_size": 4}),
    ("hybrid", {"cache_size": 4, "pcie_gbps": 25.0, "host_gbps": 100.0}),
    ("fused", {"max_prefill_tokens": 5}),
]


def build_qwen3_next_model(folder: Path, seed: int = 0, **overrides: Any) -> Any:
    """Save a random transformers Qwen3NextForCausalLM into `folder`: HYBRID_TINY's layers, layer 1 a
    dense MLP (`mlp_only_layers`), top-k not renormalised (the default of Qwen3-MoE, not of Qwen3-Next);
    `overrides` change those."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_demo_tokenizer(folder)
    torch.manual_seed(seed)
    shape = dict(intermediate_size=40, mlp_only_layers=[1], norm_topk_prob=False)
    cfg = Qwen3NextConfig(vocab_size=vocab, **{**HYBRID_TINY, **shape, **overrides})
    model = Qwen3NextForCausalLM(cfg).eval()
    return save_redrawn(model, folder, seed)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm())


def assert_follows_cached_decode(
    engine: Any, model: Any, prompt: list[int], steps: int, cache_arg: str
) -> None:
    """The engine's fp32 logits within 1e-4 of transformers' over the prompt, then over `steps` greedy
    tokens decoded with transformers' own cache (`cache_arg`: the forward's name for it)."""
    from transformers import DynamicCache

    seq = engine.new_sequence()
    got = engine.forward(seq, prompt, all_logits=True)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True, **{cache_arg: cache})
    assert rel_err(got, out.logits[0]) < 1e-4
    for _ in range(steps):
        token = int(out.logits[0, -1].argmax())
        with torch.no_grad():
            out = model(torch.tensor([[token]]), use_cache=True, **{cache_arg: cache})
        assert rel_err(engine.forward(seq, [token])[-1], out.logits[0, -1]) < 1e-4


# every model_type the architecture registry knows, as its errors list them
SUPPORTED_ARCHITECTURES = (
    "deepseek_v3, deepseek_v32, deepseek_v4, glm4_moe, glm_moe_dsa, gpt_oss, kimi_linear, minimax_m2, "
    "mixtral, olmoe, qwen3_5_moe, qwen3_5_moe_text, qwen3_moe, qwen3_next"
)
# GLM-4.5's and DeepSeek-V3's MoE, tiny: a dense first layer, a shared expert, two groups of 3 experts
GROUPED_MOE_TINY: dict[str, Any] = dict(
    n_routed_experts=6,
    moe_intermediate_size=40,
    intermediate_size=56,
    first_k_dense_replace=1,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=1.7,
)
# DeepSeek-V3's layers, tiny: that MoE and latent attention
DEEPSEEK_TINY: dict[str, Any] = dict(
    **GROUPED_MOE_TINY,
    num_key_value_heads=4,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    head_dim=4,  # transformers' rotary dims: the rope part's
    v_head_dim=10,
)
# Tiny configs per family (odd shapes: 6 experts, top-3, GQA 4:2, head_dim 12); OLMoE clamps q/k/v.
FAMILY_TINY: dict[str, dict[str, Any]] = {
    "mixtral": dict(num_local_experts=6, sliding_window=5),  # every layer's window: 5 keys
    "olmoe": dict(num_experts=6, clip_qkv=2.5, norm_topk_prob=False),
    # a dense first layer, a shared expert, two groups (the best one kept), partial rope, q/k norms, biases
    "glm4_moe": dict(
        **GROUPED_MOE_TINY,
        use_qk_norm=True,
        attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    ),
    # the Hub's spelling of a partial rope (transformers keeps the key; the engine reads it)
    "minimax_m2": dict(num_local_experts=6, rotary_dim=6),
    # latent attention (q through a low rank, yarn with mscale), a dense first layer, a shared expert, two
    # groups of experts (the best one kept)
    "deepseek_v3": dict(
        **DEEPSEEK_TINY,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 256,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    ),
    # DeepSeek-V3's shape with an indexer (index_topk covers these tests' lengths; the sparse selection's
    # own test lowers it)
    "deepseek_v32": dict(**DEEPSEEK_TINY, index_n_heads=4, index_head_dim=8, index_topk=64),
    # GLM-5: DeepSeek-V3.2's layers, the indexer's rope on pairs, layer 2 reusing layer 1's choice
    "glm_moe_dsa": dict(
        **DEEPSEEK_TINY,
        index_n_heads=4,
        index_head_dim=8,
        index_topk=64,
        indexer_types=["full", "full", "shared"],
    ),
    # Kimi-Linear: delta-attention layers 0 and 2 around a rope-less latent attention layer, DeepSeek's MoE
    "kimi_linear": dict(
        num_local_experts=6,
        num_experts_per_tok=3,
        moe_intermediate_size=40,
        intermediate_size=56,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=1.7,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=10,
        linear_num_heads=2,
        linear_head_dim=8,
        linear_conv_kernel_dim=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"],
        num_key_value_heads=4,
    ),
    # DeepSeek-V4: a compressed-sparse layer (windows of 3, two series, an indexer whose index_topk keeps
    # every entry these tests reach; the sparse choice's own test lowers it) routed by its token-id table,
    # a sliding-only layer, a heavily-compressed one (windows of 5); a window of 5 keys, 3 streams, two
    # head groups, yarn on the compressed layers (the flat rope object, as older configs spell it)
    "deepseek_v4": dict(
        n_routed_experts=6,
        num_key_value_heads=1,
        q_lora_rank=20,
        partial_rotary_factor=0.5,
        layer_types=["compressed_sparse_attention", "sliding_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 3, "heavily_compressed_attention": 5},
        sliding_window=5,
        hc_mult=3,
        o_groups=2,
        o_lora_rank=10,
        index_n_heads=3,
        index_head_dim=8,
        index_topk=64,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
    ),
    # sinks, a window of 4 on layers 0 and 2, yarn rope, biases everywhere, a clamp the activations reach
    "gpt_oss": dict(
        num_local_experts=6,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        swiglu_limit=0.6,
        rms_norm_eps=1e-5,
    ),
}


def build_family_model(
    folder: Path, family: str, seed: int = 0, whole_banks: bool = False, **overrides: Any
) -> Any:
    """Save a random transformers model of `family` (FAMILY_TINY, the demo tokenizer) into `folder`;
    `overrides` change the shared shape (hidden 48, head_dim 12, ...); `whole_banks`: see save_redrawn."""
    from transformers import (
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        DeepseekV4Config,
        DeepseekV4ForCausalLM,
        DeepseekV32Config,
        DeepseekV32ForCausalLM,
        Glm4MoeConfig,
        Glm4MoeForCausalLM,
        GlmMoeDsaConfig,
        GlmMoeDsaForCausalLM,
        GptOssConfig,
        GptOssForCausalLM,
        KimiLinearConfig,
        KimiLinearForCausalLM,
        MiniMaxM2Config,
        MiniMaxM2ForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        OlmoeConfig,
        OlmoeForCausalLM,
    )

    config_class, model_class = {
        "mixtral": (MixtralConfig, MixtralForCausalLM),
        "olmoe": (OlmoeConfig, OlmoeForCausalLM),
        "glm4_moe": (Glm4MoeConfig, Glm4MoeForCausalLM),
        "minimax_m2": (MiniMaxM2Config, MiniMaxM2ForCausalLM),
        "gpt_oss": (GptOssConfig, GptOssForCausalLM),
        "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM),
        "deepseek_v32": (DeepseekV32Config, DeepseekV32ForCausalLM),
        "deepseek_v4": (DeepseekV4Config, DeepseekV4ForCausalLM),
        "glm_moe_dsa": (GlmMoeDsaConfig, GlmMoeDsaForCausalLM),
        "kimi_linear": (KimiLinearConfig, KimiLinearForCausalLM),
    }[family]
    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_demo_tokenizer(folder)
    torch.manual_seed(seed)
    shape = dict(
        vocab_size=vocab, hidden_size=48, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, num_experts_per_tok=3, max_position_embeddings=1024,
        rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    model = model_class(config_class(**{**shape, **FAMILY_TINY[family], **overrides})).eval()
    gen = torch.Generator().manual_seed(seed + 1)  # correction biases that change choices (buffers)
    for layer in model.model.layers:
        bias = getattr(getattr(layer.mlp, "gate", None), "e_score_correction_bias", None)
        bias = bias if bias is not None else getattr(layer.mlp, "e_score_correction_bias", None)
        if bias is not None:
            bias.copy_(0.3 * torch.randn(bias.shape, generator=gen))
        table = getattr(getattr(layer.mlp, "gate", None), "tid2eid", None)  # DeepSeek-V4's hash routing
        if table is not None:  # each token's own distinct experts
            experts = model.config.n_routed_experts
            picks = [torch.randperm(experts, generator=gen)[: table.shape[1]] for _ in range(table.shape[0])]
            table.copy_(torch.stack(picks))
    return save_redrawn(model, folder, seed, whole_banks)


def build_any_model(folder: Path, family: str) -> Any:
    """A tiny random transformers model of any family into `folder`: Qwen3-MoE (TINY), Qwen3.5-MoE
    (HYBRID_TINY), Qwen3-Next, or one of FAMILY_TINY."""
    if family == "qwen3_moe":
        return build_hf_model(folder)
    if family == "qwen3_5_moe":
        return build_hybrid_model(folder)
    if family == "qwen3_next":
        return build_qwen3_next_model(folder)
    return build_family_model(folder, family)
