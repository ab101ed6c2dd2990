"""Write a random-weight DeepSeek-V4-Flash checkpoint as DeepSeek publishes it — safetensors under the
published names (`layers.N.attn.wq_a.weight`, `layers.N.ffn.experts.E.w1.weight` with its `.scale`, ...),
routed experts in FP4 (e2m1 codes two to a byte, an e8m0 scale byte per 32 inputs), the config in the
published spelling — cut to `--layers`, for `peer_llamacpp.py` beside llama.cpp on the same weights:
llama.cpp's converter (`make llama-cpp-converter`, then `tests/llama_cpp_convert.py` with
`DeepseekV4ForCausalLM`) turns the folder into a GGUF with the experts as MXFP4 blocks, and
`llama-quantize` into Q4_K_M.

The tensor names come from a tiny model of the same layer kinds saved by transformers (what DeepSeek's
names are under `model.`), each tensor's shape from the model at the requested dims on the meta device
(nothing is materialised but the random bytes written, a layer at a time: a V4-Flash layer's experts are
3.2 GB in FP4). Values: experts zero-mean FP4 of std about 0.015, router rows of logits about N(0, 1) with
`--router-skew` (random_gguf.router_rows), the hash-routed layers' token-id tables random, embeddings of
std 1, other matrices bf16 of std 0.02, norms and scales one, biases, sinks and bases zero. Attention and
the shared experts stay bf16 (the published file keeps some of them FP8; the converter reads either).

  python benchmarks/make_deepseek_v4.py /dev/shm/v4flash --layers 4 --router-skew 0.5
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from random_gguf import byte_vocabulary, random_bf16, router_rows

from freetoken.runtime.models.deepseek_v4_names import published_name

EXPERT = re.compile(r"model\.layers\.\d+\.ffn\.experts\.\d+\.(w1|w2|w3)\.weight")  # as transformers saves
FP4_SCALE = 119  # e8m0 byte: 2^(119 - 127) = 1/256; e2m1 magnitudes uniform over 0..6 then give std ~0.011
# V4-Flash's shape, beside transformers' defaults for DeepseekV4Config (its published layer kinds: the
# first layers hash-routed, compressed layers after sliding ones), and its yarn rope on compressed layers
FLASH: dict[str, Any] = dict(
    rope_parameters={
        "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.125},
        "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "partial_rotary_factor": 0.125,
                     "factor": 16.0, "original_max_position_embeddings": 65536},
    },
)  # fmt: skip


SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% else %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)


def write_tokenizer(folder: Path, size: int) -> None:
    """A byte-level BPE of exactly `size` tokens (random_gguf.byte_vocabulary: bytes, a few merges,
    padding, DeepSeek's control tokens last) as tokenizer.json and its config, so the converter's
    vocabulary is the model's and no token moves when it pads."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens, _, merges = byte_vocabulary(size, SPECIALS)
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ")) for m in merges])
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIALS[0],
              "eos_token": SPECIALS[1], "chat_template": TEMPLATE, "add_bos_token": False}  # fmt: skip
    (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="the folder to write (config.json, model-*.safetensors)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--router-skew", type=float, default=0.0, help="random_gguf.router_rows' skew")
    ap.add_argument("--shape", default="{}", help="JSON of DeepseekV4Config fields to override (tests)")
    return ap.parse_args(argv)


def published_names(config: Any) -> list[str]:
    """The tensor names DeepSeek's files use for a model of `config`'s layer kinds (under `model.`, as
    transformers saves them): from a tiny model of the same kinds, saved."""
    import torch
    from safetensors import safe_open
    from transformers import DeepseekV4ForCausalLM

    tiny = dict(hidden_size=64, moe_intermediate_size=32, intermediate_size=32, q_lora_rank=16,
                o_lora_rank=16, o_groups=2, num_attention_heads=2, head_dim=32, index_n_heads=2,
                index_head_dim=16, vocab_size=64, qk_rope_head_dim=4)  # fmt: skip
    small = type(config)(**{**config.to_dict(), **tiny})
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        DeepseekV4ForCausalLM(small).save_pretrained(tmp)
        names: list[str] = []
        for path in sorted(Path(tmp).glob("*.safetensors")):
            with safe_open(str(path), "pt") as f:
                names += list(f.keys())
    return names


def tensor(
    name: str, shape: tuple[int, ...], rng: np.random.Generator, skew: float, experts: int
) -> dict[str, Any]:
    """The published tensors for one saved name of `shape` -> {published name: tensor}."""
    import torch

    out = published_name(name)
    if ".ffn.experts." in out:  # [R, C] as FP4: codes two to a byte, a scale byte per 32 inputs
        rows, cols = shape
        base = out.removesuffix(".weight")
        codes = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
        scale = torch.full((rows, cols // 32), FP4_SCALE, dtype=torch.uint8)
        return {f"{base}.weight": torch.from_numpy(codes), f"{base}.scale": scale}
    if out.endswith("tid2eid"):  # [V, K]: each token's K distinct experts
        table = np.argsort(rng.random((shape[0], experts), dtype=np.float32), axis=1)[:, : shape[1]]
        return {out: torch.from_numpy(table.astype(np.int64))}
    if out.endswith("ffn.gate.weight"):
        bits = router_rows(rng, shape[0], shape[1], skew)
        return {out: torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)}
    if out == "embed.weight" or len(shape) == 2:
        std = 1.0 if out == "embed.weight" else 0.02
        return {out: torch.from_numpy(random_bf16(rng, *shape, std=std).view(np.int16)).view(torch.bfloat16)}
    if "norm" in out or out.endswith("scale"):
        return {out: torch.ones(shape, dtype=torch.float32)}
    return {out: torch.zeros(shape, dtype=torch.float32)}  # biases, sinks, bases, position biases


def main(argv: list[str] | None = None) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    from freetoken.runtime.models.deepseek_v4_config import older_spelling
    from freetoken.runtime.models.deepseek_v4_names import DEEPSEEK_V4_EXPERTS

    args = parse(argv)
    config = DeepseekV4Config(**{**FLASH, "num_hidden_layers": args.layers, **json.loads(args.shape)})
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in DeepseekV4ForCausalLM(config).state_dict().items()}
    rng = np.random.default_rng(0)
    args.out.mkdir(parents=True, exist_ok=True)
    by_shard: dict[str, list[str]] = {}
    for name in published_names(config):
        parts = name.split(".")
        shard = f"layer{parts[2]}" if parts[1] == "layers" else "rest"
        by_shard.setdefault(shard, []).append(name)
    index: dict[str, str] = {}
    inter, hidden = config.moe_intermediate_size, config.hidden_size
    for shard, names in by_shard.items():
        file = f"model-{shard}.safetensors"
        tensors: dict[str, Any] = {}
        for name in names:
            per_expert = EXPERT.fullmatch(name)
            if per_expert:  # w1 / w3: [I, H]; w2: [H, I]
                shape = (hidden, inter) if per_expert.group(1) == "w2" else (inter, hidden)
            else:
                canonical = DEEPSEEK_V4_EXPERTS.canonical(name)
                shape = shapes[canonical] if canonical in shapes else shapes[name]
            tensors.update(tensor(name, shape, rng, args.router_skew, config.n_routed_experts))
        save_file(tensors, str(args.out / file), metadata={"format": "pt"})
        index.update(dict.fromkeys(tensors, file))
        print(f"{file}: {len(tensors)} tensors", flush=True)
    (args.out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    raw = config.to_dict()
    bos = config.vocab_size - len(SPECIALS)  # write_tokenizer's control tokens are the last ones
    raw.update(architectures=["DeepseekV4ForCausalLM"], bos_token_id=bos, eos_token_id=bos + 1)
    (args.out / "config.json").write_text(json.dumps(older_spelling(raw), indent=1))
    write_tokenizer(args.out, config.vocab_size)


if __name__ == "__main__":
    main()
