"""Write a random-weight GGUF with Qwen3.6-35B-A3B's published shapes in llama.cpp's `qwen35moe` layout
(what its converter writes for Qwen3.5/3.6-MoE), for side-by-side runs with `peer_llamacpp.py`.

40 layers, each fourth full (gated) attention and the others gated DeltaNet (attn_qkv, attn_gate,
ssm_alpha/beta, ssm_a = −exp(A_log), ssm_dt.bias, the convolution [C, W], ssm_norm, ssm_out), every layer
256 routed experts top-8 of 512 wide and one shared expert of 512 behind its sigmoid gate. Routed experts
in `--expert-type` (BF16, any GGML type of the codec registry as random raw blocks, or Q4_K_M's per-layer
mix); everything else bf16, norms and gains fp32 (the zero-centred norms stored as 1 + w, as the converter
writes them). Layers of equal index mod 4 share their arrays (fast to write; the bytes read are the same).

Routing, stated: `--router-skew S` (random_gguf.router_rows) scales each expert's router row by exp(S·g),
g ~ N(0, 1), so a row of larger norm wins the top-k more often. Measured (docs/benchmarks.md): a global LRU
over 37 % of the experts misses about 62 % of routed experts at S = 0 (near uniform) and 16 % at S = 0.5,
the paper's trace of Qwen3.6-35B-A3B. A run's own miss rate is reported beside it, not assumed.

  python benchmarks/make_qwen35_gguf.py /dev/shm/q36-q4km.gguf --expert-type Q4_K_M --router-skew 0.5
  python benchmarks/make_qwen35_gguf.py /tmp/small.gguf --layers 4 --hidden 256 --experts 16 \\
      --moe-inter 128 --heads 4 --kv-heads 2 --head-dim 64 --linear-heads 4 --linear-dim 32 --vocab 4096
"""

from __future__ import annotations

import argparse

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

SPECIALS = ["<|endoftext|>", "<|im_end|>", "<|im_start|>", "<think>", "</think>", "<tool_call>",
            "</tool_call>", "<tool_response>", "</tool_response>"]  # fmt: skip
INTERVAL = 4  # every fourth layer full attention
CONV = 4  # the DeltaNet convolution's width


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = shape_parser(
        __doc__, layers=40, vocab=248320, hidden=2048, experts=256, top_k=8, moe_inter=512, heads=16,
        kv_heads=2, head_dim=256,
    )  # fmt: skip
    ap.formatter_class = argparse.RawDescriptionHelpFormatter
    ap.add_argument("--linear-heads", type=int, default=16, help="DeltaNet key heads (value heads: twice)")
    ap.add_argument("--linear-dim", type=int, default=128, help="DeltaNet key and value head size")
    ap.add_argument("--shared-inter", type=int, default=512, help="the shared expert's size")
    ap.add_argument("--expert-type", choices=EXPERT_TYPES, default="BF16")
    return ap.parse_args(argv)


def write_header(w: object, args: argparse.Namespace) -> None:
    """The hyperparameters llama.cpp's qwen35moe reads (as its converter writes them)."""
    nk, d = args.linear_heads, args.linear_dim
    w.add_block_count(args.layers)
    w.add_context_length(262144)
    w.add_embedding_length(args.hidden)
    w.add_head_count(args.heads)
    w.add_head_count_kv(args.kv_heads)
    w.add_key_length(args.head_dim)
    w.add_value_length(args.head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e7)
    w.add_rope_dimension_count(args.head_dim // 4)
    w.add_rope_dimension_sections([11, 11, 10, 0])
    w.add_expert_count(args.experts)
    w.add_expert_used_count(args.top_k)
    w.add_expert_feed_forward_length(args.moe_inter)
    w.add_expert_shared_feed_forward_length(args.shared_inter)
    w.add_ssm_conv_kernel(CONV)
    w.add_ssm_state_size(d)
    w.add_ssm_group_count(nk)
    w.add_ssm_time_step_rank(2 * nk)
    w.add_ssm_inner_size(2 * nk * d)
    w.add_full_attention_interval(INTERVAL)


def main(argv: list[str] | None = None) -> None:
    import gguf

    args = parse(argv)
    rng = np.random.default_rng(0)
    h, e, i, s = args.hidden, args.experts, args.moe_inter, args.shared_inter
    n, kv, hd = args.heads, args.kv_heads, args.head_dim
    nk, d = args.linear_heads, args.linear_dim
    nv, qkv = 2 * nk, 4 * nk * d  # value heads; q, k (nk · d each) and v (nv · d) rows

    def bf16(*shape: int, std: float = 0.02) -> np.ndarray:
        return random_bf16(rng, *shape, std=std)

    def f32(*shape: int, value: float | None = None, std: float = 0.01) -> np.ndarray:
        if value is not None:
            return np.full(shape, value, dtype=np.float32)
        return rng.standard_normal(shape, dtype=np.float32) * std

    w = gguf.GGUFWriter(args.out, "qwen35moe")
    write_header(w, args)
    tokens = add_byte_tokenizer(w, args.vocab, SPECIALS, "qwen35", CHATML)
    w.add_bos_token_id(tokens.index(SPECIALS[0]))
    w.add_eos_token_id(tokens.index(SPECIALS[1]))
    add_embeddings(w, rng, args.vocab, h)

    def delta_net() -> dict[str, np.ndarray]:
        return {
            "attn_qkv.weight": bf16(qkv, h), "attn_gate.weight": bf16(nv * d, h),
            "ssm_beta.weight": bf16(nv, h), "ssm_alpha.weight": bf16(nv, h),
            "ssm_a": -np.exp(f32(nv, std=0.5)), "ssm_dt.bias": f32(nv, std=0.5),
            "ssm_conv1d.weight": f32(qkv, CONV, std=0.3), "ssm_norm.weight": f32(d, value=1.0),
            "ssm_out.weight": bf16(h, nv * d),
        }  # fmt: skip

    def attention() -> dict[str, np.ndarray]:
        return {
            "attn_q.weight": bf16(2 * n * hd, h), "attn_k.weight": bf16(kv * hd, h),
            "attn_v.weight": bf16(kv * hd, h), "attn_output.weight": bf16(h, n * hd),
            "attn_q_norm.weight": f32(hd, value=1.0), "attn_k_norm.weight": f32(hd, value=1.0),
        }  # fmt: skip

    kinds = max(1, min(args.layers, INTERVAL))
    mixers = [attention() if (k + 1) % INTERVAL == 0 else delta_net() for k in range(kinds)]
    routers = [router_rows(rng, e, h, args.router_skew) for _ in range(kinds)]
    shared = {"ffn_gate_shexp.weight": bf16(s, h), "ffn_up_shexp.weight": bf16(s, h),
              "ffn_down_shexp.weight": bf16(h, s), "ffn_gate_inp_shexp.weight": bf16(1, h)}  # fmt: skip
    banks: dict[tuple[int, str, str], np.ndarray] = {}  # (layer mod 4, part, type) -> bank
    ones = f32(h, value=1.0)
    for layer in range(args.layers):
        blk, k = f"blk.{layer}.", layer % kinds
        add_array(w, blk + "attn_norm.weight", ones)
        add_array(w, blk + "post_attention_norm.weight", ones)
        for name, array in mixers[k].items():
            add_array(w, blk + name, array)
        add_array(w, blk + "ffn_gate_inp.weight", routers[k])
        for name, array in shared.items():
            add_array(w, blk + name, array)
        add_expert_banks(w, rng, banks, layer, k, args.expert_type, args.layers, (e, i, h))
    write_out(w)


if __name__ == "__main__":
    main()
