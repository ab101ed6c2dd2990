"""Write a random-weight GGUF with DeepSeek-V3's shapes (llama.cpp's `deepseek2` arch) or, with
`--family glm-dsa`, GLM-5's, cut to --layers (8 by default: 3 dense, 5 MoE), for side-by-side runs with
`peer_llamacpp.py` (both engines read the same bytes).

Latent attention as the published model has it (DeepSeek-V3: q and kv LoRA ranks 1536 / 512, 128 heads
of 128 + 64 rope dims and 128 value dims, yarn factor 40; GLM-5: ranks 2048 / 512, 64 heads of 192 + 64
and 256, and each layer's sparse-attention indexer, 32 heads of 128 keeping 2,048 entries), kv_b written
split per head as attn_k_b / attn_v_b, the sigmoid router with its correction bias (DeepSeek-V3 over 8
groups keeping 4), routed_scaling_factor 2.5, one shared expert, the first `--dense-layers` layers dense.
Routed experts in `--expert-type` (Q4_K by default: 6.3 GB a DeepSeek-V3 layer; BF16 would be 22.5 GB)
as random raw blocks with small finite scales; everything else bf16 (std 0.02), norms fp32. Layers of
equal parity share their expert banks (fast to write). The vocabulary is byte-level BPE padded to
--vocab with the family's markers at the end.

  python benchmarks/make_deepseek_gguf.py /dev/shm/dsv3-8.gguf                 # ~36 GB
  python benchmarks/make_deepseek_gguf.py /dev/shm/glm5-8.gguf --family glm-dsa
  python benchmarks/make_deepseek_gguf.py /tmp/tiny.gguf --layers 3 --dense-layers 1 --hidden 256 \\
      --experts 16 --groups 4 --group-topk 2 --moe-inter 256 --inter 384 --heads 4 --q-lora-rank 64 \\
      --kv-lora-rank 32 --vocab 2048
"""

from __future__ import annotations

import argparse

import numpy as np
from random_gguf import (
    add_array,
    add_byte_tokenizer,
    add_embeddings,
    random_bf16,
    random_experts,
    router_rows,
    shape_parser,
    write_out,
)

DEEPSEEK_SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]
DEEPSEEK_TEMPLATE = (
    "{{ '<｜begin▁of▁sentence｜>' }}{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>"
    "{{ m['content'] }}{% else %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)
ROPE = 64  # a head's rope dims (both families); its rope-free key part is --head-dim less these
# per family: the shape defaults and the rest of its published geometry
FAMILIES = {
    "deepseek2": {
        "shape": dict(layers=8, vocab=129280, hidden=7168, experts=256, top_k=8, moe_inter=2048, heads=128,
                      kv_heads=128, head_dim=128 + ROPE),
        "v_head": 128, "inter": 18432, "q_lora": 1536, "groups": (8, 4), "eps": 1e-6, "context": 163840,
        "yarn": 40.0, "pre": "deepseek-v3", "specials": DEEPSEEK_SPECIALS, "template": DEEPSEEK_TEMPLATE,
    },
    "glm-dsa": {  # GLM-5: the same latent attention, wider heads, a sparse-attention indexer in each layer
        "shape": dict(layers=8, vocab=154880, hidden=6144, experts=256, top_k=8, moe_inter=2048, heads=64,
                      kv_heads=64, head_dim=192 + ROPE),
        "v_head": 256, "inter": 12288, "q_lora": 2048, "groups": (1, 1), "eps": 1e-5, "context": 202752,
        "yarn": None, "indexer": (32, 128, 2048), "pre": "glm5",
        "specials": ["<|endoftext|>", "<|user|>", "<|assistant|>", "[gMASK]", "<sop>"], "template": "",
    },
}  # fmt: skip


def main() -> None:
    import gguf

    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--family", choices=sorted(FAMILIES), default="deepseek2")
    fam = FAMILIES[first.parse_known_args()[0].family]
    ap = shape_parser(__doc__, **fam["shape"])
    ap.formatter_class = argparse.RawDescriptionHelpFormatter
    ap.add_argument("--family", choices=sorted(FAMILIES), default="deepseek2")
    ap.add_argument("--expert-type", choices=("BF16", "Q8_0", "Q4_K", "Q6_K"), default="Q4_K")
    ap.add_argument("--dense-layers", type=int, default=3, help="first_k_dense_replace")
    ap.add_argument("--inter", type=int, default=fam["inter"], help="the dense layers' intermediate size")
    ap.add_argument("--q-lora-rank", type=int, default=fam["q_lora"])
    ap.add_argument("--kv-lora-rank", type=int, default=512)
    ap.add_argument("--v-head-dim", type=int, default=fam["v_head"])
    ap.add_argument("--groups", type=int, default=fam["groups"][0], help="n_group")
    ap.add_argument("--group-topk", type=int, default=fam["groups"][1], help="topk_group")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    h, e, i, n = args.hidden, args.experts, args.moe_inter, args.heads
    rank, q_rank, nope, v_head = args.kv_lora_rank, args.q_lora_rank, args.head_dim - ROPE, args.v_head_dim

    def bf16(*shape: int, std: float = 0.02) -> np.ndarray:
        return random_bf16(rng, *shape, std=std)

    w = gguf.GGUFWriter(args.out, args.family)
    w.add_block_count(args.layers)
    w.add_context_length(fam["context"])
    w.add_embedding_length(h)
    w.add_feed_forward_length(args.inter)
    w.add_head_count(n)
    w.add_head_count_kv(1)  # the absorbed form: one latent "head" of keys and values
    w.add_q_lora_rank(q_rank)
    w.add_kv_lora_rank(rank)
    w.add_key_length(rank + ROPE)
    w.add_value_length(rank)
    w.add_key_length_mla(nope + ROPE)
    w.add_value_length_mla(v_head)
    w.add_rope_dimension_count(ROPE)
    w.add_rope_freq_base(10000.0)
    if fam["yarn"]:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(fam["yarn"])
        w.add_rope_scaling_orig_ctx_len(4096)
        w.add_rope_scaling_yarn_log_mul(0.1)
    if "indexer" in fam:
        heads, size, top_k = fam["indexer"]
        w.add_indexer_head_count(heads)
        w.add_indexer_key_length(size)
        w.add_indexer_top_k(top_k)
    w.add_layer_norm_rms_eps(fam["eps"])
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
    specials = fam["specials"]
    tokens = add_byte_tokenizer(w, args.vocab, specials, fam["pre"], fam["template"])
    w.add_bos_token_id(tokens.index(specials[0]))
    w.add_eos_token_id(tokens.index(specials[1]))

    def add(name: str, array: np.ndarray) -> None:  # experts as raw blocks of --expert-type
        add_array(w, name, array, args.expert_type)

    ones = np.ones(h, dtype=np.float32)
    add_embeddings(w, rng, args.vocab, h)
    attention = {  # one set, shared by every layer (fast to write; the reads are the same)
        "attn_q_a.weight": bf16(q_rank, h),
        "attn_q_a_norm.weight": np.ones(q_rank, dtype=np.float32),
        "attn_q_b.weight": bf16(n * (nope + ROPE), q_rank),
        "attn_kv_a_mqa.weight": bf16(rank + ROPE, h),
        "attn_kv_a_norm.weight": np.ones(rank, dtype=np.float32),
        "attn_k_b.weight": bf16(n, rank, nope),  # per head, transposed: [H, r, d_nope]
        "attn_v_b.weight": bf16(n, v_head, rank),  # [H, d_v, r]
        "attn_output.weight": bf16(h, n * v_head),
    }
    if "indexer" in fam:  # its heads' queries from the q latent, one shared key, per-head weights
        heads, size, _ = fam["indexer"]
        attention.update({
            "indexer.attn_q_b.weight": bf16(heads * size, q_rank),
            "indexer.attn_k.weight": bf16(size, h),
            "indexer.k_norm.weight": np.ones(size, dtype=np.float32),
            "indexer.k_norm.bias": np.zeros(size, dtype=np.float32),
            "indexer.proj.weight": bf16(heads, h),
        })  # fmt: skip
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
        add(f"blk.{layer}.ffn_gate_inp.weight", router_rows(rng, e, h, args.router_skew))
        add(f"blk.{layer}.exp_probs_b.bias", (rng.standard_normal(e, dtype=np.float32) * 0.01))
        for name, array in shared.items():
            add(f"blk.{layer}.{name}", array)
        for part, shape in (("gate", (e, i, h)), ("up", (e, i, h)), ("down", (e, h, i))):
            key = (layer % 2, part)
            if key not in banks:
                banks[key] = random_experts(rng, args.expert_type, *shape)
            add(f"blk.{layer}.ffn_{part}_exps.weight", banks[key])
    write_out(w)


if __name__ == "__main__":
    main()
