"""GGUF metadata -> an HF-style config dict, and `tokenizer.ggml.*` -> a `tokenizers` tokenizer."""

from __future__ import annotations

from typing import Any

from freetoken.errors import FreeTokenError
from freetoken.formats import gguf_deepseek4, gguf_kimi
from freetoken.formats.gguf_checkpoint import GgufCheckpoint
from freetoken.formats.gguf_spm import build_spm_tokenizer

# llama.cpp's arch -> model_type
ARCHITECTURES = {
    "qwen3moe": "qwen3_moe", "olmoe": "olmoe", "glm4moe": "glm4_moe", "minimax-m2": "minimax_m2",
    "gpt-oss": "gpt_oss", "llama": "mixtral", "deepseek2": "deepseek_v3", "glm-dsa": "glm_moe_dsa",
    "qwen35moe": "qwen3_5_moe_text", "qwen3next": "qwen3_next", "deepseek32": "deepseek_v32",
    "kimi-linear": "kimi_linear", "deepseek4": "deepseek_v4",
}  # fmt: skip
# per arch: the transformers class, and whether llama.cpp's graph renormalises the top-k weights (its
# qwen3moe graph always does; its olmoe graph never does)
ARCH_FIELDS: dict[str, dict[str, Any]] = {
    "qwen3moe": {"architectures": ["Qwen3MoeForCausalLM"], "norm_topk_prob": True},
    "olmoe": {"architectures": ["OlmoeForCausalLM"], "norm_topk_prob": False},
    "glm4moe": {"architectures": ["Glm4MoeForCausalLM"], "norm_topk_prob": True},
    "minimax-m2": {"architectures": ["MiniMaxM2ForCausalLM"], "norm_topk_prob": True},
    # llama.cpp's gpt-oss graph: sliding layers every other one from the first, alpha 1.702, limit 7
    "gpt-oss": {"architectures": ["GptOssForCausalLM"], "swiglu_alpha": 1.702, "swiglu_limit": 7.0},
    # llama.cpp stores Mixtral as `llama` with experts (feed_forward_length: an expert's size)
    "llama": {"architectures": ["MixtralForCausalLM"]},
    # DeepSeek-V3/R1, Kimi-K2: latent attention, rope on interleaved pairs (llama.cpp's norm rope)
    "deepseek2": {"architectures": ["DeepseekV3ForCausalLM"], "rope_interleave": True},
    # DeepSeek-V3.2: deepseek2's latent attention with the sparse attention's indexer in every layer
    "deepseek32": {"architectures": ["DeepseekV32ForCausalLM"], "rope_interleave": True},
    # GLM-5: deepseek2's latent attention with the sparse indexer (layers without one reuse the last)
    "glm-dsa": {"architectures": ["GlmMoeDsaForCausalLM"], "rope_interleave": True},
    # Qwen3.5/3.6 MoE: gated DeltaNet layers and gated attention every full_attention_interval-th
    "qwen35moe": {"architectures": ["Qwen3_5MoeForCausalLM"], "norm_topk_prob": True},
    # Kimi-Linear: delta attention and rope-less latent attention layers over DeepSeek-V3's MoE
    "kimi-linear": {"architectures": ["KimiLinearForCausalLM"], "norm_topk_prob": True},
    # DeepSeek-V4: compressed and sliding attention over hyper-connected streams (its own fields below)
    "deepseek4": {"architectures": ["DeepseekV4ForCausalLM"]},
    # Qwen3-Next: the same layers with fused DeltaNet projections (llama.cpp's graph renormalises top-k)
    "qwen3next": {"architectures": ["Qwen3NextForCausalLM"], "norm_topk_prob": True},
}
# archs whose config calls an expert's size `intermediate_size` (the file's expert_feed_forward_length)
EXPERT_SIZE_AS_INTERMEDIATE = ("minimax-m2", "gpt-oss")
# HF config field <- GGUF key under "{arch}."
CONFIG_KEYS = {
    "num_hidden_layers": "block_count",
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "max_position_embeddings": "context_length",
    "num_experts": "expert_count",
    "num_experts_per_tok": "expert_used_count",
    "moe_intermediate_size": "expert_feed_forward_length",
    "clip_qkv": "attention.clamp_kqv",
    "n_shared_experts": "expert_shared_count",
    "first_k_dense_replace": "leading_dense_block_count",
    "routed_scaling_factor": "expert_weights_scale",
    "norm_topk_prob": "expert_weights_norm",
    "n_group": "expert_group_count",
    "topk_group": "expert_group_used_count",
    "sliding_window": "attention.sliding_window",
    "q_lora_rank": "attention.q_lora_rank",
    "kv_lora_rank": "attention.kv_lora_rank",
    "index_n_heads": "attention.indexer.head_count",
    "index_head_dim": "attention.indexer.key_length",
    "index_topk": "attention.indexer.top_k",
    # qwen35moe's and qwen3next's DeltaNet layers and shared expert
    "linear_conv_kernel_dim": "ssm.conv_kernel",
    "linear_key_head_dim": "ssm.state_size",
    "linear_num_key_heads": "ssm.group_count",
    "linear_num_value_heads": "ssm.time_step_rank",
    "full_attention_interval": "full_attention_interval",
    "shared_expert_intermediate_size": "expert_shared_feed_forward_length",
    # kimi-linear's delta attention
    "linear_head_dim": "kda.head_dim",
}
# archs with latent attention (their geometry read by _latent_attention_fields)
LATENT_ATTENTION = ("deepseek2", "deepseek32", "glm-dsa", "kimi-linear")
# token_type values (llama.cpp): 3 = control, 4 = user defined
CONTROL, USER_DEFINED = 3, 4
# `tokenizer.ggml.pre` -> the splits applied in turn before the byte-level BPE (llama.cpp's regexes)
PRE_TOKENIZER_SPLITS: dict[str, str | tuple[str, ...]] = {
    # Qwen2/3: digits one at a time, contractions, letters with one leading non-letter, punctuation runs
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    # Qwen3.5/3.6: Qwen2's, with combining marks kept inside words
    "qwen35": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    # DeepSeek-V3/R1: numbers in threes, runs of CJK ideographs and kana, then words and punctuation
    "deepseek-v3": (
        r"\p{N}{1,3}",
        r"[一-龥぀-ゟ゠-ヿ]+",
        r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
        r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    # gpt-oss (o200k): cased words with an optional contraction, numbers in threes
    "gpt-4o": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}


def stored_dtype(ckpt: GgufCheckpoint) -> str:
    """The weights' dtype as config.json would name it: float32 for F32 matrices, else bfloat16 (what
    BF16, F16 and the quantized types load as)."""
    matrices = [t for t in ckpt.tensors.values() if len(t.shape) == 2]
    if matrices and all(t.tensor_type.name == "F32" for t in matrices):
        return "float32"
    return "bfloat16"


def config_dict(ckpt: GgufCheckpoint) -> dict[str, Any]:
    arch = ckpt.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise FreeTokenError(
            f"{ckpt.path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    raw: dict[str, Any] = {"model_type": ARCHITECTURES[arch], **ARCH_FIELDS[arch]}
    for field, key in CONFIG_KEYS.items():
        value = ckpt.get(f"{arch}.{key}")
        if value is not None:
            raw[field] = value
    if arch == "llama" and not raw.get("num_experts"):
        raise FreeTokenError(
            f"{ckpt.path}: GGUF architecture 'llama' without experts (a dense model): not supported"
        )
    for required in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_experts"):
        if required not in raw:
            raise FreeTokenError(f"{ckpt.path}: GGUF lacks {arch}.{CONFIG_KEYS[required]}")
    tokens = ckpt.get("tokenizer.ggml.tokens")
    raw["vocab_size"] = (
        ckpt.shape("model.embed_tokens.weight")[0]
        if tokens is None
        else max(len(tokens), ckpt.shape("model.embed_tokens.weight")[0])
    )
    raw["rope_theta"] = float(ckpt.get(f"{arch}.rope.freq_base", 10000.0))
    if ckpt.get(f"{arch}.rope.scaling.type") == "yarn":
        raw["rope_scaling"] = {
            "rope_type": "yarn",
            "factor": float(ckpt.get(f"{arch}.rope.scaling.factor")),
            "original_max_position_embeddings": int(ckpt.get(f"{arch}.rope.scaling.original_context_length")),
            "truncate": arch != "gpt-oss",  # llama.cpp's yarn for gpt-oss keeps the fractional bounds
        }
    elif arch == "gpt-oss":
        raw["rope_scaling"] = {"rope_type": "default"}
    raw["torch_dtype"] = stored_dtype(ckpt)
    raw["num_hidden_layers"] -= int(ckpt.get(f"{arch}.nextn_predict_layers", 0) or 0)  # MTP blocks: not read
    if arch in EXPERT_SIZE_AS_INTERMEDIATE and "moe_intermediate_size" in raw:
        raw["intermediate_size"] = raw.pop("moe_intermediate_size")
    inner = ckpt.get(f"{arch}.ssm.inner_size")  # qwen35moe's and qwen3next's DeltaNet: value heads x dims
    if inner is not None and raw.get("linear_num_value_heads"):
        raw["linear_value_head_dim"] = int(inner) // raw["linear_num_value_heads"]
    if arch == "kimi-linear":  # which layers are latent attention: those with KV heads
        kda = next(n for n in ckpt.names() if n.endswith("self_attn.b_proj.weight"))
        raw.update(gguf_kimi.config_fields(list(raw.pop("num_key_value_heads")), ckpt.shape(kda)[0]))
    if arch == "deepseek4":
        indexed = {int(n.split(".")[2]) for n in ckpt.names() if ".indexer." in n}
        raw.update(gguf_deepseek4.config_fields(lambda key: ckpt.get(f"{arch}.{key}"), indexed))
    recurrent = ckpt.get(f"{arch}.attention.recurrent_layers")  # newer files: each layer's kind
    if recurrent is not None:
        raw["layer_types"] = ["linear_attention" if r else "full_attention" for r in recurrent]
    rotary = ckpt.get(f"{arch}.rope.dimension_count")
    if arch in LATENT_ATTENTION:
        _latent_attention_fields(ckpt, arch, raw, int(rotary))
    elif rotary is not None and raw.get("head_dim"):
        raw["partial_rotary_factor"] = int(rotary) / int(raw["head_dim"])
    raw["use_qk_norm"] = any(n.endswith("self_attn.q_norm.weight") for n in ckpt.names())
    raw["attention_bias"] = any(n.endswith("self_attn.q_proj.bias") for n in ckpt.names())
    raw["tie_word_embeddings"] = "lm_head.weight" not in ckpt.tensors
    moe_layers = {int(n.split(".")[2]) for n in ckpt.names() if n.endswith("mlp.experts.down_proj")}
    raw["mlp_only_layers"] = sorted(set(range(raw["num_hidden_layers"])) - moe_layers)
    eos = ckpt.get("tokenizer.ggml.eos_token_id")
    if eos is not None:
        raw["eos_token_id"] = int(eos)
    return raw


def _latent_attention_fields(ckpt: GgufCheckpoint, arch: str, raw: dict[str, Any], rope_dim: int) -> None:
    """Latent attention's head geometry: key_length_mla = nope + rope dims and value_length_mla (older files:
    key_length and value_length themselves); yarn's mscale from its log multiplier (0.1 · mscale_all_dim);
    with an indexer, the layers that have none reuse the last one's choice (GLM-5's shared layers)."""
    key = ckpt.get(f"{arch}.attention.key_length_mla", ckpt.get(f"{arch}.attention.key_length"))
    value = ckpt.get(f"{arch}.attention.value_length_mla", ckpt.get(f"{arch}.attention.value_length"))
    raw.update(qk_rope_head_dim=rope_dim, qk_nope_head_dim=int(key) - rope_dim, v_head_dim=int(value))
    raw.pop("head_dim", None)
    log_mul = ckpt.get(f"{arch}.rope.scaling.yarn_log_multiplier")
    if "index_topk" in raw:
        indexing = {n.split(".")[2] for n in ckpt.names() if n.endswith("self_attn.indexer.wk.weight")}
        layers = range(raw["num_hidden_layers"])
        raw["indexer_types"] = ["full" if str(i) in indexing else "shared" for i in layers]
    if log_mul and "rope_scaling" in raw:
        raw["rope_scaling"].update(mscale=float(log_mul) / 0.1, mscale_all_dim=float(log_mul) / 0.1)
    raw["rope_scaling"] = raw.get("rope_scaling", {"rope_type": "default"})


def build_tokenizer(ckpt: GgufCheckpoint) -> tuple[Any, dict[str, Any]]:
    """-> (tokenizers.Tokenizer, tokenizer_config dict with chat_template and special tokens)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    kind = ckpt.get("tokenizer.ggml.model")
    tokens: list[str] = ckpt.get("tokenizer.ggml.tokens")
    if kind == "llama":
        spm = build_spm_tokenizer(
            tokens,
            ckpt.get("tokenizer.ggml.scores"),
            ckpt.get("tokenizer.ggml.token_type"),
            bool(ckpt.get("tokenizer.ggml.add_space_prefix", True)),
        )
        return spm, _tokenizer_config(ckpt, tokens)
    if kind != "gpt2":
        raise FreeTokenError(
            f"{ckpt.path}: tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2' and "
            "SentencePiece 'llama' are)"
        )
    types = ckpt.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in ckpt.get("tokenizer.ggml.merges") or []]
    special = [i for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED)]
    vocab = {tok: i for i, tok in enumerate(tokens) if i not in special}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    splits = PRE_TOKENIZER_SPLITS.get(ckpt.get("tokenizer.ggml.pre", ""))
    if splits:
        patterns = (splits,) if isinstance(splits, str) else splits
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                *(pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in patterns),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    # Added tokens keep their ids: add them in id order after the base vocabulary.
    for i in special:
        tokenizer.add_special_tokens(
            [AddedToken(tokens[i], special=types[i] == CONTROL, normalized=False)]
        ) if types[i] == CONTROL else tokenizer.add_tokens([AddedToken(tokens[i], normalized=False)])
    for i in special:
        if tokenizer.token_to_id(tokens[i]) != i:
            raise FreeTokenError(f"{ckpt.path}: added token {tokens[i]!r} does not keep its id {i}")

    return tokenizer, _tokenizer_config(ckpt, tokens)


def _tokenizer_config(ckpt: GgufCheckpoint, tokens: list[str]) -> dict[str, Any]:
    """tokenizer_config fields: the special tokens the file names, and its chat template."""

    def token(key: str) -> str | None:
        index = ckpt.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(index)] if index is not None and int(index) < len(tokens) else None

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": token("eos"),
        "bos_token": token("bos"),
        "pad_token": token("padding"),
        "chat_template": ckpt.get("tokenizer.chat_template"),
    }
