"""Write a random-weight GGUF with Qwen3-30B-A3B's shapes (llama.cpp's `qwen3moe` arch), for side-by-side
runs with `peer_llamacpp.py` (both engines read the same bytes).

Routed experts in `--expert-type`: BF16 (std 0.02), Q8_0, Q4_K, Q6_K as random raw blocks with small
finite scales (gguf.quants.dequantize defines their values), or Q4_K_M's layout: gate/up Q4_K in every
layer, down Q6_K in the layers llama.cpp's quantizer gives more bits (the first and last eighth, and
every third layer between) and Q4_K elsewhere. Attention, router and embeddings are bf16, norms fp32.
Layers of equal parity share their arrays (fast to write). The vocabulary is byte-level BPE padded to
--vocab with Qwen's special tokens at the end, so the output projection costs what the real one does.

  python benchmarks/make_qwen3moe_gguf.py /dev/shm/q30-q4km.gguf --layers 24 --expert-type Q4_K_M
  python benchmarks/make_qwen3moe_gguf.py /tmp/small.gguf --layers 16 --hidden 1024 --experts 64 \\
      --moe-inter 512 --heads 16 --head-dim 64 --vocab 32000
"""

from __future__ import annotations

import numpy as np
from random_gguf import add_array, add_byte_tokenizer, add_embeddings, random_bf16, shape_parser, write_out

from freetoken.codecs import get_codec

QWEN_SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
]  # fmt: skip
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# fp16 scales giving weights of std ~0.015 from random quants and sub-block scales
BLOCK_SCALE = {"Q8_0": 2e-4, "Q4_K": 5e-5, "Q6_K": 1.2e-5}
EXPERT_TYPES = ("BF16", "Q8_0", "Q4_K", "Q6_K", "Q4_K_M")


def more_bits(layer: int, layers: int) -> bool:
    """Whether a Q4_K_M file keeps `layer`'s down projection in Q6_K."""
    eighth = layers // 8
    return layer < eighth or layer >= 7 * layers // 8 or (layer - eighth) % 3 == 2


def expert_types(kind: str, layer: int, layers: int) -> tuple[str, str]:
    """(gate/up type, down type) of `layer`'s routed experts."""
    if kind == "Q4_K_M":
        return "Q4_K", "Q6_K" if more_bits(layer, layers) else "Q4_K"
    return kind, kind


def main() -> None:
    import gguf

    ap = shape_parser(
        __doc__.splitlines()[0], layers=24, vocab=151936, hidden=2048, experts=128, top_k=8, moe_inter=768,
        heads=32, kv_heads=4, head_dim=128,
    )  # fmt: skip
    ap.add_argument("--expert-type", choices=EXPERT_TYPES, default="BF16")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    h, e, i, d = args.hidden, args.experts, args.moe_inter, args.head_dim

    def bf16(*shape: int, std: float = 0.02) -> np.ndarray:
        return random_bf16(rng, *shape, std=std)

    def experts(kind: str, *shape: int) -> np.ndarray:
        if kind == "BF16":
            return bf16(*shape)
        codec = get_codec(kind)
        out = np.empty((*shape[:-1], codec.row_bytes(shape[-1])), dtype=np.uint8)
        return codec.random_blocks(out, rng, BLOCK_SCALE[kind])

    w = gguf.GGUFWriter(args.out, "qwen3moe")
    w.add_block_count(args.layers)
    w.add_context_length(40960)
    w.add_embedding_length(h)
    w.add_feed_forward_length(6144)
    w.add_head_count(args.heads)
    w.add_head_count_kv(args.kv_heads)
    w.add_key_length(d)
    w.add_value_length(d)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_expert_count(e)
    w.add_expert_used_count(args.top_k)
    w.add_expert_feed_forward_length(i)
    tokens = add_byte_tokenizer(w, args.vocab, QWEN_SPECIALS, "qwen2", TEMPLATE)
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_bos_token_id(tokens.index("<|endoftext|>"))

    def add(name: str, array: np.ndarray, kind: str | None = None) -> None:
        add_array(w, name, array, kind)

    ones = np.ones(h, dtype=np.float32)
    add_embeddings(w, rng, args.vocab, h)
    dense = [
        {
            "attn_q.weight": bf16(args.heads * d, h),
            "attn_k.weight": bf16(args.kv_heads * d, h),
            "attn_v.weight": bf16(args.kv_heads * d, h),
            "attn_output.weight": bf16(h, args.heads * d),
            "ffn_gate_inp.weight": bf16(e, h, std=0.5),
        }
        for _ in range(2)
    ]
    banks: dict[tuple[int, str, str], np.ndarray] = {}  # (parity, part, type) -> bank
    for layer in range(args.layers):
        for name in ("attn_norm.weight", "ffn_norm.weight"):
            add(f"blk.{layer}.{name}", ones)
        for name in ("attn_q_norm.weight", "attn_k_norm.weight"):
            add(f"blk.{layer}.{name}", np.ones(d, dtype=np.float32))
        for name, array in dense[layer % 2].items():
            add(f"blk.{layer}.{name}", array)
        gate_up, down = expert_types(args.expert_type, layer, args.layers)
        for part, kind, shape in (
            ("gate", gate_up, (e, i, h)),
            ("up", gate_up, (e, i, h)),
            ("down", down, (e, h, i)),
        ):
            key = (layer % 2, part, kind)
            if key not in banks:
                banks[key] = experts(kind, *shape)
            add(f"blk.{layer}.ffn_{part}_exps.weight", banks[key], kind)
    write_out(w)


if __name__ == "__main__":
    main()
