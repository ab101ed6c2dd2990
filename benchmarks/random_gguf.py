"""Pieces shared by the random-weight GGUF generators (make_qwen3moe_gguf.py, make_gpt_oss_gguf.py,
make_deepseek_gguf.py): a byte-level BPE vocabulary llama.cpp accepts and its tokenizer fields, the shape
arguments, random bf16 arrays, tensors and the embeddings into a writer."""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np


def byte_vocabulary(size: int, specials: list[str]) -> tuple[list[str], list[int], list[str]]:
    """GPT-2's printable spelling of the 256 bytes, the pairs of a few frequent letters (with their
    merges: llama.cpp refuses a byte-level BPE without any), padding, then `specials` (control tokens)
    -> tokens, token types, merges."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    spelled, extra = {}, 0
    for b in range(256):
        if b in printable:
            spelled[b] = chr(b)
        else:
            spelled[b] = chr(256 + extra)
            extra += 1
    tokens = [spelled[b] for b in range(256)]
    letters = [spelled[b] for b in b"etaoinsrhl "]
    merges = [f"{a} {b}" for a in letters for b in letters]
    tokens += [m.replace(" ", "") for m in merges]
    tokens += [f"<pad{i}>" for i in range(size - len(tokens) - len(specials))]
    return tokens + specials, [1] * (size - len(specials)) + [3] * len(specials), merges


def shape_parser(description: str, **defaults: int) -> argparse.ArgumentParser:
    """`out` and the model's shape options (--layers, --vocab, --hidden, --experts, --top-k, --moe-inter,
    --heads, --kv-heads, --head-dim), each defaulting to the given model's value."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("out")
    for name in (
        "layers",
        "vocab",
        "hidden",
        "experts",
        "top_k",
        "moe_inter",
        "heads",
        "kv_heads",
        "head_dim",
    ):
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=defaults[name])
    ap.add_argument(
        "--router-skew", type=float, default=0.0,
        help="spread of the experts' popularity (router_rows; 0: near-uniform routing)",
    )  # fmt: skip
    return ap


def router_rows(rng: np.random.Generator, experts: int, hidden: int, skew: float) -> np.ndarray:
    """A router weight [E, H] as bf16 bits: row j of std exp(skew · g_j) / sqrt(H) (g ~ N(0, 1), the
    factors' mean 1), so a normed input's logits are about N(0, 1) and a row of larger norm wins the
    top-k more often: routing of a stated skew (0: every row alike, near uniform). Logits of tens (rows of
    std 0.5) saturate a sigmoid router to 1.0 for most experts and leave the choice to the correction bias
    alone: the same experts for every token."""
    if skew < 0:
        raise SystemExit(f"--router-skew {skew}: must be >= 0")
    spread = np.exp(skew * rng.standard_normal(experts, dtype=np.float32))
    rows = rng.standard_normal((experts, hidden), dtype=np.float32)
    rows *= (spread / spread.mean() / np.sqrt(hidden)).astype(np.float32)[:, None]
    return (rows.view(np.uint32) >> 16).astype(np.uint16)


def random_bf16(rng: np.random.Generator, *shape: int, std: float = 0.02) -> np.ndarray:
    """Normal values of `std` as bf16 bits (uint16), for GGUFWriter's raw BF16 tensors."""
    return ((rng.standard_normal(shape, dtype=np.float32) * std).view(np.uint32) >> 16).astype(np.uint16)


def add_byte_tokenizer(writer: Any, size: int, specials: list[str], pre: str, template: str) -> list[str]:
    """Write byte_vocabulary(size, specials) as a gpt2-style tokenizer with `pre`'s pre-tokenizer and the
    chat template into a GGUFWriter; returns the tokens (for special-token ids)."""
    tokens, types, merges = byte_vocabulary(size, specials)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_chat_template(template)
    return tokens


def add_array(writer: Any, name: str, array: np.ndarray, blocks: str | None = None) -> None:
    """A tensor into a GGUFWriter: uint8 arrays as raw blocks of GGML type `blocks` (e.g. "Q4_K"), uint16
    ones as bf16 bits, others as they are."""
    from gguf import GGMLQuantizationType as Q

    if array.dtype == np.uint8:
        assert blocks is not None, f"{name}: raw blocks need their type"
        writer.add_tensor(name, array, raw_dtype=Q[blocks])
    else:
        writer.add_tensor(name, array, raw_dtype=Q.BF16 if array.dtype == np.uint16 else None)


def add_embeddings(writer: Any, rng: np.random.Generator, vocab: int, hidden: int) -> None:
    """token_embd (bf16, std 1), output (bf16, std 0.02) and output_norm (ones). Embeddings of std 0.02
    are outweighed by the random attention's output, which over a random history is nearly the same vector
    for every token (its mean of values): from the second layer on every token's router input would be that
    vector, and routing would collapse onto a few experts. At std 1 each token's own identity stays in the
    residual stream, so random weights route near uniformly."""
    add_array(writer, "token_embd.weight", random_bf16(rng, vocab, hidden, std=1.0))
    add_array(writer, "output_norm.weight", np.ones(hidden, dtype=np.float32))
    add_array(writer, "output.weight", random_bf16(rng, vocab, hidden))


def write_out(writer: Any) -> None:
    """Header, metadata and tensors of a GGUFWriter to its file, with a progress bar; then close it."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=True)
    writer.close()


GGML_TYPES = ("Q8_0", "Q4_K", "Q6_K", "Q5_K", "IQ4_XS", "MXFP4", "IQ3_S", "IQ3_XXS", "Q4_0", "Q5_0", "Q2_K")
GGML_TYPES += ("Q3_K", "IQ2_XXS", "IQ2_XS", "IQ4_NL", "Q4_1", "Q5_1")  # every GGML type of the codec registry
EXPERT_TYPES = ("BF16", *GGML_TYPES, "Q4_K_M")
WEIGHT_STD = 0.015  # what random experts' weights come out at


def block_scale(kind: str, std: float = WEIGHT_STD) -> float:
    """The fp16 (super-)block scale under which random blocks of GGML type `kind` (random quants and
    packed sub-block scales) dequantise to weights of about `std`: measured once on a few blocks."""
    from freetoken.codecs import get_codec

    codec = get_codec(kind)
    probe = codec.random_blocks(np.empty((64, codec.block_bytes), np.uint8), np.random.default_rng(0), 1e-3)
    measured = float(codec.dequantize(probe, codec.block_elements).std())
    return 1e-3 * std / measured


def more_bits(layer: int, layers: int) -> bool:
    """Whether a Q4_K_M file keeps `layer`'s down projection in Q6_K."""
    eighth = layers // 8
    return layer < eighth or layer >= 7 * layers // 8 or (layer - eighth) % 3 == 2


def expert_types(kind: str, layer: int, layers: int) -> tuple[str, str]:
    """(gate/up type, down type) of `layer`'s routed experts under --expert-type `kind`: Q4_K_M's gate
    and up Q4_K, down Q6_K where more_bits says so; any other kind for all three."""
    if kind == "Q4_K_M":
        return "Q4_K", "Q6_K" if more_bits(layer, layers) else "Q4_K"
    return kind, kind


def fitting(kind: str, row: int) -> str:
    """`kind`, or Q8_0 where its blocks do not divide a row of `row` weights (GLM-4.5's 1408-wide down
    projection in a K-quant): llama.cpp's quantizer likewise falls back to a 32-weight block type there."""
    if kind == "BF16":
        return kind
    from freetoken.codecs import get_codec

    return kind if row % get_codec(kind).block_elements == 0 else "Q8_0"


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)  # the Qwen families' chat template, as the generators write it


def add_expert_banks(
    writer: Any, rng: np.random.Generator, banks: dict[tuple[int, str, str], np.ndarray], layer: int,
    share: int, expert_type: str, layers: int, shape: tuple[int, int, int],
) -> None:  # fmt: skip
    """blk.`layer`'s routed experts (gate, up, down of `shape` (E, I, H)) in `expert_type`'s types for that
    layer (expert_types, fitting); banks are drawn once per (share, part, type) and kept in `banks`."""
    e, i, h = shape
    gate_up, down = expert_types(expert_type, layer, layers)
    for part, kind, dims in (
        ("gate", gate_up, (e, i, h)),
        ("up", gate_up, (e, i, h)),
        ("down", down, (e, h, i)),
    ):
        kind = fitting(kind, dims[-1])
        key = (share, part, kind)
        if key not in banks:
            banks[key] = random_experts(rng, kind, *dims)
        add_array(writer, f"blk.{layer}.ffn_{part}_exps.weight", banks[key], kind)


def random_experts(rng: np.random.Generator, kind: str, *shape: int) -> np.ndarray:
    """A bank of `shape` ([E, out, in]) in GGML type `kind`: bf16 bits (std 0.02), or random raw blocks
    with small finite scales (gguf.quants.dequantize defines their values), each block's scales negated
    together at random (Codec.random_blocks' `signed`): unsigned blocks' nonzero mean made every row's
    product share one direction, and routing collapsed within a few layers."""
    if kind == "BF16":
        return random_bf16(rng, *shape)
    from freetoken.codecs import get_codec

    codec = get_codec(kind)
    out = np.empty((*shape[:-1], codec.row_bytes(shape[-1])), dtype=np.uint8)
    return codec.random_blocks(out, rng, block_scale(kind), signed=True)
