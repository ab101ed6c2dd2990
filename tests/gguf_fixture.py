"""Write a tiny qwen3moe or olmoe GGUF from a transformers model with the `gguf` package (the test's
oracle)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

LAYER_NAMES = {  # transformers name -> GGUF name, per layer (written independently of the runtime's table)
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    # glm4moe's
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
    # gpt-oss's (its router is `mlp.router`; GPT_OSS_NAMES)
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.sinks": "attn_sinks.weight",
}
GPT_OSS_NAMES = {"mlp.router.weight": "ffn_gate_inp.weight", "mlp.router.bias": "ffn_gate_inp.bias"}
# model_type -> llama.cpp's arch
ARCHS = {
    "qwen3_moe": "qwen3moe", "olmoe": "olmoe", "glm4_moe": "glm4moe", "minimax_m2": "minimax-m2",
    "gpt_oss": "gpt-oss", "mixtral": "llama", "deepseek_v3": "deepseek2", "glm_moe_dsa": "glm-dsa",
}  # fmt: skip
# DeepSeek-V3's latent attention (llama.cpp's deepseek2); kv_b_proj is written split (attn_k_b, attn_v_b)
DEEPSEEK2_NAMES = {
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.kv_b_proj.weight": "attn_kv_b.weight",
    # GLM-5's indexer (llama.cpp's glm-dsa)
    "self_attn.indexer.k_norm.weight": "indexer.k_norm.weight",
    "self_attn.indexer.k_norm.bias": "indexer.k_norm.bias",
    "self_attn.indexer.weights_proj.weight": "indexer.proj.weight",
    "self_attn.indexer.wk.weight": "indexer.attn_k.weight",
    "self_attn.indexer.wq_b.weight": "indexer.attn_q_b.weight",
}
LATENT = ("deepseek2", "glm-dsa")


def rope_permuted(rows: np.ndarray, heads: int, back: bool = False) -> np.ndarray:
    """llama.cpp's converter permutes the `llama` arch's q/k rows for its interleaved rope: per head,
    (half j, pair i) -> (pair i, half j); `back` undoes it."""
    d = rows.shape[0] // heads
    split = (heads, d // 2, 2) if back else (heads, 2, d // 2)
    return rows.reshape(*split, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def dequantised_state_dict(path: Path, hf: Any) -> dict[str, Any]:
    """transformers' state dict with every tensor taken from the GGUF (dequantised by the package)."""
    import gguf
    import torch
    from gguf.quants import dequantize

    back = {g: h for h, g in LAYER_NAMES.items()}
    back["post_attention_norm.weight"] = "post_attention_layernorm.weight"  # glm4moe's and gpt-oss's
    gpt_oss = hf.config.model_type == "gpt_oss"
    if gpt_oss:
        back.update({g: h for h, g in GPT_OSS_NAMES.items()})
    back.update({g: h for h, g in DEEPSEEK2_NAMES.items()})
    sd = {k: v.clone() for k, v in hf.state_dict().items()}
    inter = expert_size(hf.config)
    for t in gguf.GGUFReader(path).tensors:
        if ".nextn." in t.name:
            continue
        value = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if hf.config.model_type == "mixtral" and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = hf.config.num_attention_heads if "attn_q" in t.name else hf.config.num_key_value_heads
            value = rope_permuted(value, heads, back=True)
        value = torch.from_numpy(value)
        if t.name in GLOBAL_NAMES:
            sd[GLOBAL_NAMES[t.name]] = value.reshape(sd[GLOBAL_NAMES[t.name]].shape)
            continue
        _, layer, rest = t.name.split(".", 2)
        prefix = f"model.layers.{layer}."
        if gpt_oss and "_exps." in rest:  # [E, in, out] banks, gate and up columns alternating
            experts = prefix + "mlp.experts."
            part, kind = rest[len("ffn_") :].split("_exps.")
            suffix = "_bias" if kind == "bias" else ""
            if part == "down":
                sd[experts + "down_proj" + suffix] = value if suffix else value.transpose(1, 2)
            else:
                column = 0 if part == "gate" else 1
                target = sd[experts + "gate_up_proj" + suffix]
                target[..., column::2] = value if suffix else value.transpose(1, 2)
        elif rest in ("ffn_gate_exps.weight", "ffn_up_exps.weight"):
            rows = slice(0, inter) if rest.startswith("ffn_gate") else slice(inter, 2 * inter)
            sd[prefix + "mlp.experts.gate_up_proj"][:, rows] = value
        elif rest == "ffn_down_exps.weight":
            sd[prefix + "mlp.experts.down_proj"] = value
        elif rest in ("attn_k_b.weight", "attn_v_b.weight"):  # deepseek2's kv_b_proj, split per head
            cfg = hf.config
            kv_b = sd[prefix + "self_attn.kv_b_proj.weight"].view(
                cfg.num_attention_heads, -1, cfg.kv_lora_rank
            )
            if rest.startswith("attn_k_b"):
                kv_b[:, : cfg.qk_nope_head_dim] = value.transpose(1, 2)
            else:
                kv_b[:, cfg.qk_nope_head_dim :] = value
        elif re.fullmatch(r"ffn_(gate|up|down)\.\d+\.weight", rest):  # one expert's: ffn_gate.E.weight
            part, expert, _ = rest.split(".")
            rows = {"ffn_gate": slice(0, inter), "ffn_up": slice(inter, 2 * inter)}.get(part)
            name = "gate_up_proj" if rows is not None else "down_proj"
            sd[prefix + "mlp.experts." + name][int(expert), rows if rows is not None else slice(None)] = value
        else:
            key = prefix + back[rest]
            if key not in sd and rest == "exp_probs_b.bias":  # MiniMax-M2 keeps it beside the router
                key = prefix + "mlp.e_score_correction_bias"
            sd[key] = value.reshape(sd[key].shape)
    return sd


def _latent_attention_header(w: Any, cfg: Any) -> None:
    """deepseek2's keys: the latent's ranks, key/value lengths as llama.cpp's absorbed MQA sees them (the
    latent and rope key; the latent) and per head (`_mla`), rope dims, yarn with its log multiplier."""
    import gguf

    rank, rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(rank)
    w.add_key_length(rank + rope)
    w.add_value_length(rank)
    w.add_key_length_mla(cfg.qk_nope_head_dim + rope)
    w.add_value_length_mla(cfg.v_head_dim)
    w.add_rope_dimension_count(rope)
    params = cfg.rope_parameters
    if params.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(params["factor"])
        w.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * params["mscale_all_dim"])
    if getattr(cfg, "index_topk", None):
        w.add_indexer_head_count(cfg.index_n_heads)
        w.add_indexer_key_length(cfg.index_head_dim)
        w.add_indexer_top_k(cfg.index_topk)


def expert_size(cfg: Any) -> int:
    """An expert's intermediate size (OLMoE and MiniMax-M2 call it intermediate_size)."""
    as_intermediate = ("olmoe", "minimax_m2", "gpt_oss", "mixtral")
    return cfg.intermediate_size if cfg.model_type in as_intermediate else cfg.moe_intermediate_size


def _tokenizer_fields(folder: Path) -> dict[str, Any]:
    doc = json.loads((folder / "tokenizer.json").read_text())
    vocab = dict(doc["model"]["vocab"])
    for added in doc["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [None] * (max(vocab.values()) + 1)
    for tok, i in vocab.items():
        tokens[i] = tok
    special = {a["id"] for a in doc["added_tokens"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in doc["model"]["merges"]]
    config = json.loads((folder / "tokenizer_config.json").read_text())
    return {
        "tokens": tokens,
        "types": [3 if i in special else 1 for i in range(len(tokens))],
        "merges": merges,
        "eos": vocab[config["eos_token"]],
        "chat_template": config["chat_template"],
    }


# the value of every fp16 super-block scale in random raw blocks, so weights stay small
BLOCK_SCALE = {
    "Q4_K": 1e-3,
    "Q5_K": 1e-3,
    "Q6_K": 1e-4,
    "Q8_0": 5e-3,
    "IQ4_XS": 2e-4,
    "MXFP4": 2**-4,
    "IQ3_S": 1e-4,
    "IQ3_XXS": 1e-4,
    "Q4_0": 5e-3,
    "Q5_0": 3e-3,
    "IQ4_NL": 3e-4,
    "Q2_K": 1e-3,
    "Q3_K": 3e-4,
    "IQ2_XXS": 3e-4,
    "IQ2_XS": 3e-4,
    "Q4_1": 5e-3,
    "Q5_1": 3e-3,
}  # MXFP4: the power of two nearest, as its e8m0 scales hold


def add_tokenizer(w: Any, folder: Path, pre: str) -> None:
    """The tokenizer files in `folder` as a GGUFWriter's gpt2-style vocabulary with `pre`'s splits."""
    tok = _tokenizer_fields(folder)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    w.add_token_merges(tok["merges"])
    w.add_eos_token_id(tok["eos"])
    w.add_chat_template(tok["chat_template"])


def ftw_logits_match(path: Path, ftw: Path, prompt: list[int]) -> bool:
    """Whether a GGUF converted to FTW at `ftw` gives the GGUF's own fp32 logits for `prompt`, exactly."""
    import torch

    from freetoken.runtime.engine import build_engine
    from freetoken.runtime.loading.convert import convert_to_ftw

    convert_to_ftw(path, ftw, dtype="float32")
    a = build_engine(path, device="cpu", dtype="float32", moe_backend="fused")
    b = build_engine(ftw, device="cpu", dtype="float32", moe_backend="fused")
    return torch.equal(
        a.forward(a.new_sequence(), prompt, all_logits=True),
        b.forward(b.new_sequence(), prompt, all_logits=True),
    )


def random_blocks(qtype: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Random raw blocks of a GGML type for a weight of `shape` (last dim = row length): every bit pattern
    of the quants and packed sub-block scales, small finite super-block scales of either sign (a block's
    all negated at once); a type no codec of ours is (TQ1_0, TQ2_0) quantizes random values by gguf's
    quantizer. -> uint8 [..., row bytes]"""
    from freetoken.codecs import CODECS, get_codec

    if qtype not in CODECS:
        import gguf.quants as gq
        from gguf import GGMLQuantizationType as Q

        values = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.05
        return gq.quantize(values, Q[qtype])
    codec = get_codec(qtype)
    out = np.empty((*shape[:-1], codec.row_bytes(shape[-1])), dtype=np.uint8)
    return codec.random_blocks(out, np.random.default_rng(seed), BLOCK_SCALE[qtype], signed=True)


def expert_count(cfg: Any) -> int:
    """Routed experts, whatever the family's config calls them."""
    for key in ("n_routed_experts", "num_local_experts", "num_experts"):
        if getattr(cfg, key, None):
            return int(getattr(cfg, key))
    raise AttributeError(f"{type(cfg).__name__}: no routed expert count")


def write_gguf(
    hf: Any,
    folder: Path,
    path: Path,
    qtype: str = "F32",
    split_max_tensors: int = 0,
    expert_types: tuple[str, str] | list[tuple[str, str]] | None = None,
    one_per_expert: bool = False,
    split_kv_b: bool = True,
) -> Path:
    """hf: a Qwen3MoeForCausalLM or OlmoeForCausalLM; folder: where its tokenizer files are; qtype: type
    of 2-D/3-D weights.

    With split_max_tensors the package writes `-00001-of-0000N.gguf` shards; the first one is returned.
    `expert_types` (gate/up type, down type): the routed experts are random raw blocks of those types
    instead of the model's (types the package cannot quantize to, as K-quants; the model's own experts
    are then not in the file: compare against dequantised_state_dict); a list of pairs: layer n's pair is
    the list's n-th (modulo its length), as Q4_K_M files vary the down projection's type by layer."""
    import gguf
    import gguf.quants as gq
    from gguf import GGMLQuantizationType as Q

    cfg = hf.config
    arch = ARCHS[cfg.model_type]
    i_moe = expert_size(cfg)
    names = dict(LAYER_NAMES)
    if arch == "glm4moe":  # llama.cpp names GLM's post-attention norm apart
        names["post_attention_layernorm.weight"] = "post_attention_norm.weight"
    names["mlp.e_score_correction_bias"] = "exp_probs_b.bias"  # MiniMax-M2 keeps it beside the router
    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    w.add_block_count(cfg.num_hidden_layers + (1 if arch == "glm4moe" else 0))  # + a next-token block
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    if arch in LATENT:
        _latent_attention_header(w, cfg)
        names.update(DEEPSEEK2_NAMES)
        if split_kv_b:
            del names["self_attn.kv_b_proj.weight"]
    else:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_expert_count(expert_count(cfg))
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch in ("qwen3moe", "glm4moe", "minimax-m2", "gpt-oss", *LATENT):
        w.add_expert_feed_forward_length(i_moe)
    if arch == "gpt-oss":
        names.update(GPT_OSS_NAMES)
        names["post_attention_layernorm.weight"] = "post_attention_norm.weight"
        w.add_sliding_window(cfg.sliding_window)
        rope = cfg.rope_parameters
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if arch == "minimax-m2":
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_rope_dimension_count(int(cfg.head_dim * cfg.rope_parameters.get("partial_rotary_factor", 1.0)))
    if arch in ("glm4moe", *LATENT):
        if arch == "glm4moe":
            w.add_nextn_predict_layers(1)
        w.add_expert_shared_count(cfg.n_shared_experts)
        w.add_leading_dense_block_count(cfg.first_k_dense_replace)
        w.add_expert_weights_scale(cfg.routed_scaling_factor)
        w.add_expert_weights_norm(cfg.norm_topk_prob)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_group_count(cfg.n_group)
        w.add_expert_group_used_count(cfg.topk_group)
        if arch == "glm4moe":
            w.add_rope_dimension_count(int(cfg.head_dim * cfg.rope_parameters["partial_rotary_factor"]))
    elif arch == "olmoe" and cfg.clip_qkv is not None:
        w.add_clamp_kqv(cfg.clip_qkv)
    add_tokenizer(w, folder, "default")
    qt = Q[qtype]

    def add(name: str, array: np.ndarray) -> None:
        array = np.ascontiguousarray(array, dtype=np.float32)
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = cfg.num_attention_heads if "attn_q" in name else cfg.num_key_value_heads
            array = rope_permuted(array, heads)
        if array.ndim >= 2 and qt != Q.F32:
            w.add_tensor(name, gq.quantize(array, qt), raw_dtype=qt)
        else:
            w.add_tensor(name, array)

    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    add("token_embd.weight", sd["model.embed_tokens.weight"])
    add("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        add("output.weight", sd["lm_head.weight"])
    if arch == "glm4moe":  # a next-token-prediction block after the trunk, which readers skip
        add(
            f"blk.{cfg.num_hidden_layers}.nextn.eh_proj.weight",
            np.zeros((cfg.hidden_size, 2 * cfg.hidden_size)),
        )
    for layer in range(cfg.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        for hf_name, g_name in names.items():
            if prefix + hf_name in sd:
                add(f"blk.{layer}.{g_name}", sd[prefix + hf_name])
        if arch in LATENT and split_kv_b:  # per head: k_b [H, r, dn] (transposed), v_b [H, dv, r]
            kv_b = sd[prefix + "self_attn.kv_b_proj.weight"]
            kv_b = kv_b.reshape(cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, -1)
            add(f"blk.{layer}.attn_k_b.weight", kv_b[:, : cfg.qk_nope_head_dim].transpose(0, 2, 1))
            add(f"blk.{layer}.attn_v_b.weight", kv_b[:, cfg.qk_nope_head_dim :])
        if arch == "gpt-oss":  # [E, in, out] banks, gate and up columns alternating, with biases
            experts = prefix + "mlp.experts."
            gate_up, gate_up_bias = sd[experts + "gate_up_proj"], sd[experts + "gate_up_proj_bias"]
            for part, column in (("gate", 0), ("up", 1)):
                add(f"blk.{layer}.ffn_{part}_exps.weight", gate_up[..., column::2].transpose(0, 2, 1))
                add(f"blk.{layer}.ffn_{part}_exps.bias", gate_up_bias[:, column::2])
            add(f"blk.{layer}.ffn_down_exps.weight", sd[experts + "down_proj"].transpose(0, 2, 1))
            add(f"blk.{layer}.ffn_down_exps.bias", sd[experts + "down_proj_bias"])
        elif prefix + "mlp.experts.gate_up_proj" in sd and expert_types is not None:
            e, h = expert_count(cfg), cfg.hidden_size
            pair = (
                expert_types if isinstance(expert_types, tuple) else expert_types[layer % len(expert_types)]
            )
            for n, (part, shape, kind) in enumerate(
                (
                    ("gate", (e, i_moe, h), pair[0]),
                    ("up", (e, i_moe, h), pair[0]),
                    ("down", (e, h, i_moe), pair[1]),
                )
            ):
                raw = random_blocks(kind, shape, seed=10 * layer + n)
                w.add_tensor(f"blk.{layer}.ffn_{part}_exps.weight", raw, raw_dtype=Q[kind])
        elif one_per_expert:  # older Mixtral files: blk.N.ffn_gate.E.weight, ...
            gate_up, down = sd[prefix + "mlp.experts.gate_up_proj"], sd[prefix + "mlp.experts.down_proj"]
            for e in range(gate_up.shape[0]):
                add(f"blk.{layer}.ffn_gate.{e}.weight", gate_up[e, :i_moe])
                add(f"blk.{layer}.ffn_up.{e}.weight", gate_up[e, i_moe:])
                add(f"blk.{layer}.ffn_down.{e}.weight", down[e])
        elif prefix + "mlp.experts.gate_up_proj" in sd:  # transformers keeps experts fused in memory
            gate_up = sd[prefix + "mlp.experts.gate_up_proj"]  # [E, 2I, H]
            add(f"blk.{layer}.ffn_gate_exps.weight", gate_up[:, :i_moe])
            add(f"blk.{layer}.ffn_up_exps.weight", gate_up[:, i_moe:])
            add(f"blk.{layer}.ffn_down_exps.weight", sd[prefix + "mlp.experts.down_proj"])  # [E, H, I]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    shards = sorted(path.parent.glob(f"{path.stem}-*-of-*.gguf"))
    return shards[0] if shards else path
