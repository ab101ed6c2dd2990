"""Write a random-weight GGUF with DeepSeek-V3's shapes (llama.cpp's `deepseek2` arch), cut to --layers
(8 by default: 3 dense, 5 MoE), for side-by-side runs with `peer_llamacpp.py` (both engines read the same
bytes).

Latent attention as the published model has it (q and kv LoRA ranks 1536 / 512, 128 heads of 128 + 64
rope dims, kv_b written split per head as attn_k_b / attn_v_b, yarn factor 40), the sigmoid router with
its correction bias over 8 groups keeping 4, routed_scaling_factor 2.5, one shared expert, the first
`--dense-layers` layers dense. Routed experts in `--expert-type` (Q4_K by default: 6.3 GB a layer; BF16
would be 22.5 GB) as random raw blocks with small finite scales; everything else bf16 (std 0.02), norms
fp32. Layers of equal parity share their expert banks (fast to write). The vocabulary is byte-level BPE
padded to --vocab with DeepSeek's markers at the end.

  python benchmarks/make_deepseek_gguf.py /dev/shm/dsv3-8.gguf                 # ~36 GB
  python benchmarks/make_deepseek_gguf.py /tmp/tiny.gguf --layers 3 --dense-layers 1 --hidden 256 \\
      --experts 16 --groups 4 --group-topk 2 --moe-inter 256 --inter 384 --heads 4 --q-lora-rank 64 \\
      --kv-lora-rank 32 --vocab 2048
"""

from __future__ import annotations

import numpy as np
from make_qwen3moe_gguf import BLOCK_SCALE
from random_gguf import add_array, add_byte_tokenizer, add_embeddings, random_bf16, shape_parser, write_out

from freetoken.codecs import get_codec

SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]
TEMPLATE = (
    "{{ '<｜begin▁of▁sentence｜>' }}{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>"
    "{{ m['content'] }}{% else %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)
NOPE, ROPE, V_HEAD = 128, 64, 128  # per-head dims: the key's rope-free and rope parts, the value


def main() -> None:
    import gguf

    ap = shape_parser(
        __doc__.splitlines()[0], layers=8, vocab=129280, hidden=7168, experts=256, top_k=8, moe_inter=2048,
        heads=128, kv_heads=128, head_dim=NOPE + ROPE,
    )  # fmt: skip
    ap.add_argument("--expert-type", choices=("BF16", "Q8_0", "Q4_K", "Q6_K"), default="Q4_K")
    ap.add_argument("--dense-layers", type=int, default=3, help="first_k_dense_replace")
    ap.add_argument("--inter", type=int, default=18432, help="the dense layers' intermediate size")
    ap.add_argument("--q-lora-rank", type=int, default=1536)
    ap.add_argument("--kv-lora-rank", type=int, default=512)
    ap.add_argument("--groups", type=int, default=8, help="n_group")
    ap.add_argument("--group-topk", type=int, default=4, help="topk_group")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    h, e, i, n = args.hidden, args.experts, args.moe_inter, args.heads
    rank, q_rank = args.kv_lora_rank, args.q_lora_rank

    def bf16(*shape: int, std: float = 0.02) -> np.ndarray:
        return random_bf16(rng, *shape, std=std)

    def experts(*shape: int) -> np.ndarray:
        if args.expert_type == "BF16":
            return bf16(*shape)
        codec = get_codec(args.expert_type)
        out = np.empty((*shape[:-1], codec.row_bytes(shape[-1])), dtype=np.uint8)
        return codec.random_blocks(out, rng, BLOCK_SCALE[args.expert_type])

    w = gguf.GGUFWriter(args.out, "deepseek2")
    w.add_block_count(args.layers)
    w.add_context_length(163840)
    w.add_embedding_length(h)
    w.add_feed_forward_length(args.inter)
    w.add_head_count(n)
    w.add_head_count_kv(1)  # the absorbed form: one latent "head" of keys and values
    w.add_q_lora_rank(q_rank)
    w.add_kv_lora_rank(rank)
    w.add_key_length(rank + ROPE)
    w.add_value_length(rank)
    w.add_key_length_mla(NOPE + ROPE)
    w.add_value_length_mla(V_HEAD)
    w.add_rope_dimension_count(ROPE)
    w.add_rope_freq_base(10000.0)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(40.0)
    w.add_rope_scaling_orig_ctx_len(4096)
    w.add_rope_scaling_yarn_log_mul(0.1)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(e)
    w.add_expert_used_count(args.top_k)
    w.add_expert_feed_forward_length(i)
    w.add_expert_shared_count(1)
    w.add_leading_dense_block_count(args.dense_layers)
    w.add_expert_weights_scale(2.5)
    w.add_expert_weights_norm(True)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_group_count(args.groups)
    w.add_expert_group_used_count(args.group_topk)
    tokens = add_byte_tokenizer(w, args.vocab, SPECIALS, "deepseek-v3", TEMPLATE)
    w.add_bos_token_id(tokens.index(SPECIALS[0]))
    w.add_eos_token_id(tokens.index(SPECIALS[1]))

    def add(name: str, array: np.ndarray) -> None:
        add_array(w, name, array, args.expert_type)

    ones = np.ones(h, dtype=np.float32)
    add_embeddings(w, rng, args.vocab, h)
    attention = {  # one set, shared by every layer (fast to write; the reads are the same)
        "attn_q_a.weight": bf16(q_rank, h),
        "attn_q_a_norm.weight": np.ones(q_rank, dtype=np.float32),
        "attn_q_b.weight": bf16(n * (NOPE + ROPE), q_rank),
        "attn_kv_a_mqa.weight": bf16(rank + ROPE, h),
        "attn_kv_a_norm.weight": np.ones(rank, dtype=np.float32),
        "attn_k_b.weight": bf16(n, rank, NOPE),  # per head, transposed: [H, r, d_nope]
        "attn_v_b.weight": bf16(n, V_HEAD, rank),  # [H, d_v, r]
        "attn_output.weight": bf16(h, n * V_HEAD),
    }
    dense = {"ffn_gate.weight": bf16(args.inter, h), "ffn_up.weight": bf16(args.inter, h),
             "ffn_down.weight": bf16(h, args.inter)}  # fmt: skip
    shared = {"ffn_gate_shexp.weight": bf16(i, h), "ffn_up_shexp.weight": bf16(i, h),
              "ffn_down_shexp.weight": bf16(h, i)}  # fmt: skip
    banks: dict[tuple[int, str], np.ndarray] = {}  # (parity, part) -> bank
    for layer in range(args.layers):
        add(f"blk.{layer}.attn_norm.weight", ones)
        add(f"blk.{layer}.ffn_norm.weight", ones)
        for name, array in attention.items():
            add(f"blk.{layer}.{name}", array)
        if layer < args.dense_layers:
            for name, array in dense.items():
                add(f"blk.{layer}.{name}", array)
            continue
        add(f"blk.{layer}.ffn_gate_inp.weight", bf16(e, h, std=0.5))
        add(f"blk.{layer}.exp_probs_b.bias", (rng.standard_normal(e, dtype=np.float32) * 0.01))
        for name, array in shared.items():
            add(f"blk.{layer}.{name}", array)
        for part, shape in (("gate", (e, i, h)), ("up", (e, i, h)), ("down", (e, h, i))):
            key = (layer % 2, part)
            if key not in banks:
                banks[key] = experts(*shape)
            add(f"blk.{layer}.ffn_{part}_exps.weight", banks[key])
    write_out(w)


if __name__ == "__main__":
    main()
