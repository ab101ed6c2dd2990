"""GGUF (qwen3moe): metadata, tokenizer, dequantisation and logits against the HF model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from freetoken.codecs import get_codec
from freetoken.errors import FreeTokenError
from freetoken.formats.gguf_checkpoint import GgufCheckpoint
from freetoken.runtime.engine import build_engine
from freetoken.runtime.text.tokenizer import Tokenizer
from gguf_fixture import dequantised_state_dict, ftw_logits_match, write_gguf
from oracle import rel_err

PROMPT = [5, 77, 301, 12, 9, 250, 33, 401]
# Against the original fp32 model: what each type's rounding costs this (large-weight, random) model.
# Lower-bit types flip routing choices of this model, so they are checked exactly against their own
# dequantisation instead (test_quantised_files_load_exactly).
TOLERANCE = {"F32": 1e-5, "F16": 2e-3, "BF16": 2e-2, "Q8_0": 5e-2}


@pytest.fixture(scope="module")
def hf_logits(tiny_model: tuple[Path, Any]) -> torch.Tensor:
    with torch.no_grad():
        return tiny_model[1](torch.tensor([PROMPT])).logits[0]


@pytest.mark.parametrize("qtype", list(TOLERANCE))
def test_logits_match_hf_within_the_type_tolerance(
    tiny_model: tuple[Path, Any], tmp_path: Path, hf_logits: torch.Tensor, qtype: str
) -> None:
    path = write_gguf(tiny_model[1], tiny_model[0], tmp_path / f"tiny-{qtype}.gguf", qtype)
    engine = build_engine(path, device="cpu", dtype="float32", moe_backend="fused")
    assert engine.config.num_experts == 8 and engine.config.moe_layers == (0, 2)
    ours = engine.forward(engine.new_sequence(), PROMPT, all_logits=True)
    assert rel_err(ours, hf_logits) < TOLERANCE[qtype]
    if qtype == "F32":
        assert torch.equal(ours.argmax(-1), hf_logits.argmax(-1))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_0", "Q4_0", "MXFP4"])
def test_quantised_files_load_exactly(tiny_model: tuple[Path, Any], tmp_path: Path, qtype: str) -> None:
    """transformers given the package's dequantisation of the same file gives our logits to fp32
    precision, and every weight is bit-identical: what low-bit types lose is theirs, not ours."""
    hf = tiny_model[1]
    path = write_gguf(hf, tiny_model[0], tmp_path / f"{qtype}.gguf", qtype)
    sd = dequantised_state_dict(path, hf)
    ref = type(hf)(hf.config).eval()
    ref.load_state_dict(sd)
    engine = build_engine(path, device="cpu", dtype="float32", moe_backend="fused")
    for name, param in engine.model.named_parameters():
        assert torch.equal(param, sd[name]), name
    for layer in (0, 2):  # kept as stored: the pool's blocks dequantise to the package's values
        banks = (engine.pool.gate_up[layer], engine.pool.down[layer])
        gate_up, down = (
            get_codec(codec).dequantize(bank.numpy(), n)
            for codec, bank, n in zip(engine.pool.codec_names(layer), banks, (64, 32), strict=True)
        )
        assert np.array_equal(gate_up, sd[f"model.layers.{layer}.mlp.experts.gate_up_proj"].numpy())
        assert np.array_equal(down, sd[f"model.layers.{layer}.mlp.experts.down_proj"].numpy())
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits[0]
    assert rel_err(engine.forward(engine.new_sequence(), PROMPT, all_logits=True), want) < 1e-4


def test_dequantisation_equals_the_gguf_package(tiny_model: tuple[Path, Any], tmp_path: Path) -> None:
    from gguf.quants import dequantize

    path = write_gguf(tiny_model[1], tiny_model[0], tmp_path / "q8.gguf", "Q8_0")
    ckpt = GgufCheckpoint(path)
    tensor = ckpt.tensors["model.layers.0.mlp.experts.down_proj"]
    assert ckpt.type_name("model.layers.0.mlp.experts.down_proj") == "Q8_0"
    want = dequantize(tensor.data, tensor.tensor_type)
    ours = ckpt.read("model.layers.0.mlp.experts.down_proj")
    assert ours.shape == (8, 64, 32)  # [E, H, I], the pool's down layout
    assert ckpt.plain_form("model.layers.0.mlp.experts.down_proj", as_stored=False) is None  # dequantised
    assert ckpt.plain_form("model.layers.0.mlp.experts.down_proj", as_stored=True) == (
        (8, 64, 34),
        torch.uint8,
    )
    assert np.array_equal(ours.numpy().reshape(want.shape), want)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "IQ4_NL", "Q2_K"])
def test_types_the_package_cannot_write(tmp_path: Path, qtype: str) -> None:
    """Hand-made blocks: random bytes (with sane scales) of a type gguf can dequantise but not quantise."""
    import gguf
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    qt = Q[qtype]
    block, size = gguf.GGML_QUANT_SIZES[qt]
    rows, cols = 4, 512
    raw = np.random.default_rng(0).integers(0, 255, (rows, cols // block * size), dtype=np.uint8)
    w = gguf.GGUFWriter(str(tmp_path / "blocks.gguf"), "qwen3moe")
    w.add_tensor("token_embd.weight", raw, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ckpt = GgufCheckpoint(tmp_path / "blocks.gguf")
    ours = ckpt.read("model.embed_tokens.weight")
    want = dequantize(raw, qt)
    assert ours.shape == (rows, cols)
    np.testing.assert_array_equal(np.nan_to_num(ours.numpy()), np.nan_to_num(want.astype(np.float32)))


def test_tokenizer_and_template_come_from_the_gguf(tiny_model: tuple[Path, Any], tmp_path: Path) -> None:
    path = write_gguf(tiny_model[1], tiny_model[0], tmp_path / "tiny.gguf")
    engine = build_engine(path, device="cpu", dtype="float32")
    ours, ref = engine.tokenizer, Tokenizer.from_dir(tiny_model[0])
    text = "<|im_start|>user\nHello, wörld — 123 tokens!<|im_end|>\n<think>\nhm\n</think>"
    assert ours.encode(text) == ref.encode(text)
    assert ours.decode(ref.encode(text)) == text
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages) == ref.apply_chat_template(messages)
    assert ref.token_to_id("<|im_end|>") in ours.eos_token_ids


def test_gguf_converts_to_ftw_and_matches(tiny_model: tuple[Path, Any], tmp_path: Path) -> None:
    path = write_gguf(tiny_model[1], tiny_model[0], tmp_path / "tiny.gguf", "Q8_0")
    assert ftw_logits_match(path, tmp_path / "ftw", PROMPT)
    a, b = build_engine(path, device="cpu"), build_engine(tmp_path / "ftw", device="cpu")
    text = "Hello <|im_end|>"
    assert a.tokenizer.encode(text) == b.tokenizer.encode(text)


def test_sharded_gguf_loads(tiny_model: tuple[Path, Any], tmp_path: Path, hf_logits: torch.Tensor) -> None:
    first = write_gguf(tiny_model[1], tiny_model[0], tmp_path / "tiny.gguf", split_max_tensors=12)
    assert first.name.startswith("tiny-00001-of-") and len(list(tmp_path.glob("tiny-*.gguf"))) > 2
    engine = build_engine(first, device="cpu", dtype="float32")
    assert rel_err(engine.forward(engine.new_sequence(), PROMPT, all_logits=True), hf_logits) < 1e-5
    next(p for p in tmp_path.glob("tiny-*.gguf") if p != first).unlink()
    with pytest.raises(FreeTokenError, match="is missing"):
        build_engine(first, device="cpu", dtype="float32")


def test_cli_runs_a_gguf(tiny_model: tuple[Path, Any], tmp_path: Path) -> None:
    import json

    from typer.testing import CliRunner

    from freetoken.cli.app import app

    path = write_gguf(tiny_model[1], tiny_model[0], tmp_path / "tiny.gguf", "Q8_0")
    result = CliRunner().invoke(app, ["run", str(path), "-p", "hi", "-n", "4", "-t", "0", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["stats"]["completion_tokens"] >= 1


def test_the_header_reader_agrees_with_the_gguf_package(tiny_model: tuple[Path, Any], tmp_path: Path) -> None:
    """Every key/value (the vocabulary's string and integer arrays included) and every tensor's type,
    shape, bytes and data as the package's own reader gives them; skipping arrays leaves them None."""
    import gguf

    from freetoken.formats.gguf_header import read_header

    path = write_gguf(tiny_model[1], tiny_model[0], tmp_path / "q8.gguf", "Q8_0")
    reader = gguf.GGUFReader(path)
    header = read_header(path)
    want = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert header.fields == want and isinstance(want["tokenizer.ggml.tokens"], list)
    assert [t.name for t in header.tensors] == [t.name for t in reader.tensors]
    ckpt = GgufCheckpoint(path)
    for theirs in reader.tensors:
        ours = next(t for t in ckpt.tensors.values() if t.name == theirs.name)
        assert ours.tensor_type == theirs.tensor_type and ours.n_bytes == int(theirs.n_bytes)
        assert tuple(ours.shape) == tuple(int(d) for d in theirs.shape)
        assert np.array_equal(
            np.asarray(ours.data).view(np.uint8).ravel(), np.asarray(theirs.data).view(np.uint8).ravel()
        )
    assert read_header(path, arrays=False).fields["tokenizer.ggml.tokens"] is None
    (tmp_path / "cut.gguf").write_bytes(path.read_bytes()[:5000])
    with pytest.raises(FreeTokenError, match="not a readable GGUF file"):
        GgufCheckpoint(tmp_path / "cut.gguf")


def test_gpt_4o_pre_tokenizer_splits_as_o200k() -> None:
    """gpt-oss GGUFs name their pre-tokenizer `gpt-4o`: words keep their case run and contraction, numbers
    go in threes, a slash starts a punctuation run."""
    from tokenizers import Regex, pre_tokenizers

    from freetoken.formats.gguf_meta import PRE_TOKENIZER_SPLITS

    split = pre_tokenizers.Split(Regex(PRE_TOKENIZER_SPLITS["gpt-4o"]), behavior="isolated")
    pieces = [piece for piece, _ in split.pre_tokenize_str("Hello WORLD's 1234567 foo/bar\n\n  x")]
    assert pieces == ["Hello", " WORLD's", " ", "123", "456", "7", " foo", "/bar", "\n\n", " ", " x"]


def write_spm_gguf(path: Path) -> list[str]:
    """A GGUF holding only a SentencePiece ("llama") vocabulary: <unk>, <s>, </s>, the 256 byte pieces, then
    pieces of a BPE trained here, scored by their order (as SentencePiece scores BPE pieces)."""
    import gguf
    import numpy as np
    from tokenizers import SentencePieceBPETokenizer

    corpus = ["the cat sat on the mat", "the dog ate the bone", "a cat and a dog", "hello world"] * 20
    corpus += ["naïve café résumé", "numbers 12345 and 678"] * 20
    trained = SentencePieceBPETokenizer()
    trained.train_from_iterator(corpus, vocab_size=120, min_frequency=2, show_progress=False)
    pieces = [t for t, _ in sorted(trained.get_vocab().items(), key=lambda kv: kv[1]) if t != "<unk>"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((w.add_block_count, 1), (w.add_embedding_length, 8), (w.add_head_count, 1)):
        add(value)
    w.add_expert_count(2)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tokens


def test_sentencepiece_vocabulary_encodes_as_transformers_and_llama_cpp(tmp_path: Path) -> None:
    """Mixtral's GGUFs carry a SentencePiece vocabulary with scores and no merges: the merges recovered from
    the scores give transformers' tokens (its GGUF reader, the oracle) and round-trip the text, unknown
    characters falling back to bytes. Where the two readers part, llama.cpp's rule holds: every text piece
    gets a "▁" prefix, also one that starts with a space or follows a special token."""
    from transformers import AutoTokenizer

    from freetoken.formats.gguf_checkpoint import GgufCheckpoint
    from freetoken.formats.gguf_meta import build_tokenizer

    tokens = write_spm_gguf(tmp_path / "spm.gguf")
    ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    ours, config = build_tokenizer(GgufCheckpoint(tmp_path / "spm.gguf"))
    assert (config["bos_token"], config["eos_token"]) == ("<s>", "</s>")
    for text in ["the cat sat", "naïve café ☃ 12345", "hello\nworld", "x", "the  dog ate"]:
        ids = ours.encode(text).ids
        assert ids == ref.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == text
    space, the, cat = (tokens.index(t) for t in ("\u2581", "\u2581the", "\u2581cat"))
    assert ours.encode(" the").ids == [space, the]  # "▁▁the"
    assert ours.encode("<s>the</s> cat").ids == [1, the, 2, space, cat]
    assert ours.encode("☃").ids[1:] == [tokens.index(f"<0x{b:02X}>") for b in "☃".encode()]


def test_a_dense_llama_gguf_is_refused_in_one_line(tmp_path: Path) -> None:
    """`llama` with experts is Mixtral; without, a dense model this engine does not run."""
    import gguf

    from freetoken.formats.gguf_meta import config_dict

    path = tmp_path / "dense.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_head_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(FreeTokenError, match=r"dense\.gguf: GGUF architecture 'llama' without experts"):
        config_dict(GgufCheckpoint(path))


def test_deepseek_v3_pre_tokenizer_splits_in_turn() -> None:
    """DeepSeek-V3 GGUFs (`deepseek-v3`): numbers in threes, then runs of CJK, then words and punctuation."""
    from tokenizers import Regex, pre_tokenizers

    from freetoken.formats.gguf_meta import PRE_TOKENIZER_SPLITS

    splits = [
        pre_tokenizers.Split(Regex(p), behavior="isolated") for p in PRE_TOKENIZER_SPLITS["deepseek-v3"]
    ]
    pieces = [piece for piece, _ in pre_tokenizers.Sequence(splits).pre_tokenize_str("Hi, 1234567 你好world")]
    assert pieces == ["Hi", ",", " ", "123", "456", "7", " ", "你好", "world"]


def test_bf16_experts_are_read_from_the_file_straight_into_a_bf16_pool(
    tiny_model: tuple[Path, Any], tmp_path: Path
) -> None:
    """No conversion: the expert tensors go from the file into their halves of the banks by parallel
    reads; every weight equals the package's reading of the file."""
    hf = tiny_model[1]
    path = write_gguf(hf, tiny_model[0], tmp_path / "bf16.gguf", "BF16")
    ckpt = GgufCheckpoint(path)
    gate = "model.layers.0.mlp.experts.gate_proj"
    names = [n for n in ckpt.names() if ".mlp.experts." in n]
    assert gate in names and ckpt.plain_form(gate, as_stored=False) == ((8, 32, 64), torch.bfloat16)
    sd = dequantised_state_dict(path, hf)
    engine = build_engine(path, device="cpu", dtype="bfloat16", moe_backend="cpu")
    for layer in (0, 2):
        assert torch.equal(
            engine.pool.gate_up[layer].float(), sd[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
        )
        assert torch.equal(engine.pool.down[layer].float(), sd[f"model.layers.{layer}.mlp.experts.down_proj"])
