"""Write a random-weight GGUF with a grouped-query MoE family's published shapes, in llama.cpp's layout for
that arch, for side-by-side runs with `peer_llamacpp.py` (both engines read the same bytes).

  --family qwen3moe    Qwen3-30B-A3B (per-head q/k norms, softmax router)
  --family olmoe       OLMoE-1B-7B (q/k norms over the whole projection, top-k weights not renormalised)
  --family glm4moe     GLM-4.5-Air (qkv biases, half rotary, sigmoid router with its correction bias, one
                       shared expert, the first layer dense; its post-attention norm named apart)
  --family minimax-m2  MiniMax-M2 (whole-projection q/k norms, 64 rotary dims, sigmoid router and bias)
  --family mixtral     Mixtral-8x7B as llama.cpp's `llama` (8 experts, top 2, no q/k norm)

Routed experts in `--expert-type`: BF16 (std 0.02), Q8_0, Q4_K, Q6_K as random raw blocks with small
finite scales (gguf.quants.dequantize defines their values), or Q4_K_M's layout: gate/up Q4_K in every
layer, down Q6_K in the layers llama.cpp's quantizer gives more bits (the first and last eighth, and
every third layer between) and Q4_K elsewhere; Q8_0 where a K-quant's 256-weight blocks do not divide
a row (GLM-4.5's 1408-wide down projection), as llama.cpp's quantizer falls back there. Attention,
router, shared and dense MLPs and embeddings are bf16, norms and biases fp32. Layers of equal parity
share their arrays (fast to write; the reads are the same). The vocabulary is byte-level BPE padded to
--vocab with the family's markers at the end, so the output projection costs what the real one does.
--layers cuts the model (default: all its layers).

  python benchmarks/make_family_gguf.py /dev/shm/glm45air-q4km.gguf --family glm4moe --layers 9 \\
      --expert-type Q4_K_M
  python benchmarks/make_family_gguf.py /tmp/small.gguf --family olmoe --layers 2 --hidden 256 \\
      --experts 8 --moe-inter 256 --heads 4 --kv-heads 4 --head-dim 64 --vocab 2048
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import numpy as np
from random_gguf import (
    CHATML,
    EXPERT_TYPES,
    add_array,
    add_byte_tokenizer,
    add_embeddings,
    add_expert_banks,
    random_bf16,
    router_rows,
    shape_parser,
    write_out,
)


@dataclass(frozen=True)
class Family:
    """One family's published shapes and how llama.cpp writes it."""

    arch: str  # llama.cpp's general.architecture
    shape: dict[str, int]  # shape_parser's defaults: layers, vocab, hidden, experts, top_k, moe_inter, heads,
    # kv_heads, head_dim
    rope_base: float
    eps: float
    context: int
    specials: list[str]  # control tokens at the end of the vocabulary; the first is bos, the second eos
    pre: str  # tokenizer.ggml.pre
    qk_norm: str | None = None  # "head": [head_dim] weights; "projection": over all heads' q / k
    rope_dims: int | None = None  # partial rotary: dims of a head that rotate
    qkv_bias: bool = False
    ffn_norm: str = "ffn_norm"  # the pre-MLP norm's GGUF name
    sigmoid_router: bool = False  # sigmoid scores with a correction bias (exp_probs_b), else softmax
    shared_experts: int = 0  # each of the routed experts' size
    dense_layers: int = 0  # leading dense layers
    dense_inter: int = 0  # their intermediate size (the file's feed_forward_length)
    weights_norm: bool | None = None  # expert_weights_norm, written where the arch reads it
    expert_size_key: tuple[str, ...] = ("expert",)  # where the expert size goes: expert_ / feed_forward_
    extra: dict[str, float] = field(default_factory=dict)


FAMILIES = {
    "qwen3moe": Family(
        "qwen3moe",
        dict(layers=48, vocab=151936, hidden=2048, experts=128, top_k=8, moe_inter=768, heads=32, kv_heads=4,
             head_dim=128),
        rope_base=1e6, eps=1e-6, context=40960, qk_norm="head", dense_inter=6144, pre="qwen2",
        specials=["<|endoftext|>", "<|im_end|>", "<|im_start|>", "<think>", "</think>", "<tool_call>",
                  "</tool_call>", "<tool_response>", "</tool_response>"],
    ),
    "olmoe": Family(
        "olmoe",
        dict(layers=16, vocab=50304, hidden=2048, experts=64, top_k=8, moe_inter=1024, heads=16, kv_heads=16,
             head_dim=128),
        rope_base=1e4, eps=1e-5, context=4096, qk_norm="projection", pre="olmo",
        expert_size_key=("ffn",), specials=["<|endoftext|>", "<|padding|>", "<|im_start|>", "<|im_end|>"],
    ),
    "glm4moe": Family(
        "glm4moe",
        dict(layers=46, vocab=151552, hidden=4096, experts=128, top_k=8, moe_inter=1408, heads=96, kv_heads=8,
             head_dim=128),
        rope_base=1e6, eps=1e-5, context=131072, rope_dims=64, qkv_bias=True, ffn_norm="post_attention_norm",
        sigmoid_router=True, shared_experts=1, dense_layers=1, dense_inter=10944, weights_norm=True,
        extra={"expert_weights_scale": 1.0}, pre="glm4",
        specials=["<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>", "[gMASK]", "<sop>"],
    ),
    "minimax-m2": Family(
        "minimax-m2",
        dict(layers=62, vocab=200064, hidden=3072, experts=256, top_k=8, moe_inter=1536, heads=48, kv_heads=8,
             head_dim=128),
        rope_base=5e6, eps=1e-6, context=196608, qk_norm="projection", rope_dims=64, sigmoid_router=True,
        expert_size_key=("expert", "ffn"), pre="minimax-m2",
        specials=["]~!b[", "[e~[", "]~b]", "<think>", "</think>"],
    ),
    "mixtral": Family(
        "llama",
        dict(layers=32, vocab=32000, hidden=4096, experts=8, top_k=2, moe_inter=14336, heads=32, kv_heads=8,
             head_dim=128),
        rope_base=1e6, eps=1e-5, context=32768, expert_size_key=("ffn",), pre="default",
        specials=["<s>", "</s>", "[INST]", "[/INST]"],
    ),
}  # fmt: skip


def parse(argv: list[str] | None = None, family: str = "qwen3moe") -> tuple[argparse.Namespace, Family]:
    """--family (default `family`) and the shape options, defaulting to that family's published ones."""
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--family", choices=sorted(FAMILIES), default=family)
    family = first.parse_known_args(argv)[0].family
    fam = FAMILIES[family]
    ap = shape_parser(__doc__, **fam.shape)
    ap.formatter_class = argparse.RawDescriptionHelpFormatter
    ap.add_argument("--family", choices=sorted(FAMILIES), default=family)
    ap.add_argument("--expert-type", choices=EXPERT_TYPES, default="BF16")
    ap.add_argument("--dense-inter", type=int, default=fam.dense_inter, help="the leading dense layers' size")
    return ap.parse_args(argv), fam


def write_header(w: object, fam: Family, args: argparse.Namespace) -> None:
    """The arch's hyperparameters as llama.cpp reads them."""
    import gguf

    d = args.head_dim
    w.add_block_count(args.layers)
    w.add_context_length(fam.context)
    w.add_embedding_length(args.hidden)
    w.add_feed_forward_length(args.moe_inter if "ffn" in fam.expert_size_key else args.dense_inter)
    w.add_head_count(args.heads)
    w.add_head_count_kv(args.kv_heads)
    w.add_key_length(d)
    w.add_value_length(d)
    w.add_layer_norm_rms_eps(fam.eps)
    w.add_rope_freq_base(fam.rope_base)
    if fam.rope_dims:
        w.add_rope_dimension_count(min(fam.rope_dims, d))
    w.add_expert_count(args.experts)
    w.add_expert_used_count(args.top_k)
    if "expert" in fam.expert_size_key:
        w.add_expert_feed_forward_length(args.moe_inter)
    if fam.sigmoid_router:
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if fam.shared_experts:
        w.add_expert_shared_count(fam.shared_experts)
    if fam.dense_layers:
        w.add_leading_dense_block_count(min(fam.dense_layers, args.layers))
    if fam.weights_norm is not None:
        w.add_expert_weights_norm(fam.weights_norm)
        w.add_expert_group_count(1)
        w.add_expert_group_used_count(1)
    if "expert_weights_scale" in fam.extra:
        w.add_expert_weights_scale(fam.extra["expert_weights_scale"])


def main(argv: list[str] | None = None, family: str = "qwen3moe") -> None:
    import gguf

    args, fam = parse(argv, family)
    rng = np.random.default_rng(0)
    h, e, i, d, n, kv = args.hidden, args.experts, args.moe_inter, args.head_dim, args.heads, args.kv_heads

    def bf16(*shape: int, std: float = 0.02) -> np.ndarray:
        return random_bf16(rng, *shape, std=std)

    def f32(size: int, value: float | None = None) -> np.ndarray:
        if value is not None:
            return np.full(size, value, dtype=np.float32)
        return rng.standard_normal(size, dtype=np.float32) * 0.01

    w = gguf.GGUFWriter(args.out, fam.arch)
    write_header(w, fam, args)
    template = CHATML if "<|im_start|>" in fam.specials else ""
    tokens = add_byte_tokenizer(w, args.vocab, fam.specials, fam.pre, template)
    w.add_bos_token_id(tokens.index(fam.specials[0]))
    w.add_eos_token_id(tokens.index(fam.specials[1]))
    add_embeddings(w, rng, args.vocab, h)
    q_norm, k_norm = {"head": (d, d), "projection": (n * d, kv * d)}.get(fam.qk_norm or "", (0, 0))

    def attention() -> dict[str, np.ndarray]:
        out = {"attn_q.weight": bf16(n * d, h), "attn_k.weight": bf16(kv * d, h),
               "attn_v.weight": bf16(kv * d, h), "attn_output.weight": bf16(h, n * d)}  # fmt: skip
        if fam.qkv_bias:
            out.update({"attn_q.bias": f32(n * d), "attn_k.bias": f32(kv * d), "attn_v.bias": f32(kv * d)})
        if q_norm:
            out.update({"attn_q_norm.weight": f32(q_norm, 1.0), "attn_k_norm.weight": f32(k_norm, 1.0)})
        return out

    dense = {"ffn_gate.weight": bf16(args.dense_inter, h), "ffn_up.weight": bf16(args.dense_inter, h),
             "ffn_down.weight": bf16(h, args.dense_inter)} if fam.dense_layers else {}  # fmt: skip
    s = i * fam.shared_experts
    shared = {"ffn_gate_shexp.weight": bf16(s, h), "ffn_up_shexp.weight": bf16(s, h),
              "ffn_down_shexp.weight": bf16(h, s)} if s else {}  # fmt: skip
    attentions = [attention() for _ in range(2)]  # per parity
    router = [router_rows(rng, e, h, args.router_skew) for _ in range(2)]
    banks: dict[tuple[int, str, str], np.ndarray] = {}  # (parity, part, type) -> bank
    ones = f32(h, 1.0)
    for layer in range(args.layers):
        blk = f"blk.{layer}."
        add_array(w, blk + "attn_norm.weight", ones)
        add_array(w, blk + fam.ffn_norm + ".weight", ones)
        for name, array in attentions[layer % 2].items():
            add_array(w, blk + name, array)
        if layer < fam.dense_layers:
            for name, array in dense.items():
                add_array(w, blk + name, array)
            continue
        add_array(w, blk + "ffn_gate_inp.weight", router[layer % 2])
        if fam.sigmoid_router:
            add_array(w, blk + "exp_probs_b.bias", f32(e))
        for name, array in shared.items():
            add_array(w, blk + name, array)
        add_expert_banks(w, rng, banks, layer, layer % 2, args.expert_type, args.layers, (e, i, h))
    write_out(w)


if __name__ == "__main__":
    main()
