"""Write a random-weight GGUF with gpt-oss-20b's shapes (llama.cpp's `gpt-oss` arch), for side-by-side
decode runs with `peer_llamacpp.py` (both engines read the same bytes).

Experts are random MXFP4 blocks (e8m0 scales near 2^-5, so weights stay small) with fp32 biases, as the
published model keeps them; attention, router and embeddings are bf16 (std 0.02), sinks and norms fp32.
Layers of equal parity share their arrays (fast to write, small to hold). The vocabulary is byte-level
BPE (the 256 bytes, padding up to --vocab, harmony's markers at the end), so the output projection costs
what the real model's does.

  python benchmarks/make_gpt_oss_gguf.py /dev/shm/gpt-oss-24.gguf --layers 24
  python benchmarks/make_gpt_oss_gguf.py /tmp/tiny.gguf --layers 2 --hidden 256 --vocab 2048 --experts 8
"""

from __future__ import annotations

import numpy as np
from random_gguf import (
    add_array,
    add_byte_tokenizer,
    add_embeddings,
    random_bf16,
    router_rows,
    shape_parser,
    write_out,
)

from freetoken.codecs import get_codec

HARMONY = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>", "<|constrain|>"]
TEMPLATE = (
    "{%- for m in messages -%}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)


def main() -> None:
    import gguf

    args = shape_parser(
        __doc__.splitlines()[0], layers=24, vocab=201088, hidden=2880, experts=32, top_k=4, moe_inter=2880,
        heads=64, kv_heads=8, head_dim=64,
    ).parse_args()  # fmt: skip
    rng = np.random.default_rng(0)
    h, e, i, d = args.hidden, args.experts, args.moe_inter, args.head_dim
    mxfp4 = get_codec("MXFP4")

    def bf16(*shape: int, std: float = 0.02) -> np.ndarray:
        return random_bf16(rng, *shape, std=std)

    def f32(*shape: int, std: float = 0.02) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32) * std

    def blocks(*shape: int) -> np.ndarray:  # [..., rows, row bytes] of MXFP4
        out = np.empty((*shape[:-1], mxfp4.row_bytes(shape[-1])), dtype=np.uint8)
        return mxfp4.random_blocks(out, rng, 2**-5)

    w = gguf.GGUFWriter(args.out, "gpt-oss")
    w.add_block_count(args.layers)
    w.add_context_length(131072)
    w.add_embedding_length(h)
    w.add_feed_forward_length(i)
    w.add_head_count(args.heads)
    w.add_head_count_kv(args.kv_heads)
    w.add_key_length(d)
    w.add_value_length(d)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(150000.0)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(32.0)
    w.add_rope_scaling_orig_ctx_len(4096)
    w.add_sliding_window(128)
    w.add_expert_count(e)
    w.add_expert_used_count(args.top_k)
    w.add_expert_feed_forward_length(i)
    tokens = add_byte_tokenizer(w, args.vocab, HARMONY, "gpt-4o", TEMPLATE)
    w.add_eos_token_id(tokens.index("<|return|>"))

    def add(name: str, array: np.ndarray) -> None:
        add_array(w, name, array, "MXFP4")

    add_embeddings(w, rng, args.vocab, h)
    parity = []
    for _ in range(2):
        parity.append({
            "attn_norm.weight": np.ones(h, dtype=np.float32),
            "post_attention_norm.weight": np.ones(h, dtype=np.float32),
            "attn_q.weight": bf16(args.heads * d, h), "attn_q.bias": f32(args.heads * d),
            "attn_k.weight": bf16(args.kv_heads * d, h), "attn_k.bias": f32(args.kv_heads * d),
            "attn_v.weight": bf16(args.kv_heads * d, h), "attn_v.bias": f32(args.kv_heads * d),
            "attn_output.weight": bf16(h, args.heads * d), "attn_output.bias": f32(h),
            "attn_sinks.weight": f32(args.heads, std=1.0),
            "ffn_gate_inp.weight": router_rows(rng, e, h, args.router_skew), "ffn_gate_inp.bias": f32(e),
            "ffn_gate_exps.weight": blocks(e, i, h), "ffn_gate_exps.bias": f32(e, i),
            "ffn_up_exps.weight": blocks(e, i, h), "ffn_up_exps.bias": f32(e, i),
            "ffn_down_exps.weight": blocks(e, h, i), "ffn_down_exps.bias": f32(e, h),
        })  # fmt: skip
    for layer in range(args.layers):
        for name, array in parity[layer % 2].items():
            add(f"blk.{layer}.{name}", array)  # uint8: the experts' MXFP4 blocks
    write_out(w)


if __name__ == "__main__":
    main()
