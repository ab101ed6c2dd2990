"""Tokenizer loading, encode/decode parity with transformers, and streaming detokenization."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from freetoken.errors import FreeTokenError
from freetoken.runtime.text.demo_tokenizer import SPECIAL_TOKENS, write_demo_tokenizer
from freetoken.runtime.text.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello, world! The weather is nice today.",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\nfour\n</think>\n\n4<|im_end|>",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>',
    "Crème brûlée, naïve café, São Paulo, Ελληνικά, русский",
    "中文测试：你好，世界！日本語のテキスト。한국어 문장.",
    "emoji 😀🎉👩‍💻🇫🇷 and symbols ∑∫√ ≠ ≤ €",
    "  leading spaces\n\n\ttabs and\r\nnewlines<|endoftext|>",
    "",
]


def test_vocab_size(tmp_path: Path, ours: Tokenizer, theirs) -> None:
    size = write_demo_tokenizer(tmp_path)
    assert 512 <= size <= 1024
    assert size == ours.vocab_size == len(theirs)


def test_write_is_deterministic(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    write_demo_tokenizer(a)
    write_demo_tokenizer(b)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()


def test_special_tokens_marked_special(demo_dir: Path, ours: Tokenizer) -> None:
    added = json.loads((demo_dir / "tokenizer.json").read_text(encoding="utf-8"))["added_tokens"]
    assert [t["content"] for t in added] == list(SPECIAL_TOKENS)
    assert all(t["special"] for t in added)
    ids = {ours.token_to_id(t) for t in SPECIAL_TOKENS}
    assert None not in ids and ids <= ours.special_token_ids
    assert ours.token_to_id("not-a-token") is None


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(text: str, ours: Tokenizer, theirs) -> None:
    expected = theirs(text, add_special_tokens=False).input_ids
    assert ours.encode(text) == expected
    assert ours.encode(text, add_special_tokens=True) == theirs(text).input_ids
    assert ours.decode(expected) == theirs.decode(expected) == text


def test_special_tokens_encode_as_single_ids(ours: Tokenizer) -> None:
    ids = ours.encode("<|im_start|>user<think></think><|im_end|>")
    assert ids[0] == ours.token_to_id("<|im_start|>")
    assert ours.token_to_id("<think>") in ids and ours.token_to_id("</think>") in ids
    assert ids[-1] == ours.token_to_id("<|im_end|>")


def test_decode_skip_special_tokens(ours: Tokenizer, theirs) -> None:
    ids = ours.encode(TEXTS[1])
    assert "<think>" in ours.decode(ids)
    skipped = ours.decode(ids, skip_special_tokens=True)
    assert skipped == theirs.decode(ids, skip_special_tokens=True)
    assert "<|im_start|>" not in skipped and "<think>" not in skipped and "What is 2+2?" in skipped


def test_eos_ids(ours: Tokenizer) -> None:
    assert ours.token_to_id("<|im_end|>") in ours.eos_token_ids


def test_eos_ids_union_of_configs(tmp_path: Path) -> None:
    write_demo_tokenizer(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 5]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 5, "bos_token_id": 1}))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.eos_token_ids == (3, 5, tok.token_to_id("<|im_end|>"))


def test_token_dicts_and_jinja_file(tmp_path: Path) -> None:
    write_demo_tokenizer(tmp_path)
    config_file = tmp_path / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["eos_token"] = {"__type": "AddedToken", "content": "<|endoftext|>", "special": True}
    config_file.write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").write_text("{{ eos_token }}|{{ messages[0].content }}")
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.token_to_id("<|endoftext|>") in tok.eos_token_ids
    got = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert got == "<|endoftext|>|hi"
    assert got == ref.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)


def test_missing_template_is_an_error(tmp_path: Path) -> None:
    write_demo_tokenizer(tmp_path)
    config_file = tmp_path / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    del config["chat_template"]
    config_file.write_text(json.dumps(config))
    tok = Tokenizer.from_dir(tmp_path)
    assert not tok.has_chat_template
    with pytest.raises(FreeTokenError, match="chat_template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_missing_tokenizer_json_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(FreeTokenError, match=str(tmp_path / "tokenizer.json")):
        Tokenizer.from_dir(tmp_path)


def _stream(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = False) -> tuple[list[str], str]:
    det = tok.detokenizer(skip_special_tokens=skip_special_tokens)
    pieces = [det.push(i) for i in ids]
    return pieces, det.flush()


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip", [False, True])
def test_streaming_equals_decode(text: str, skip: bool, ours: Tokenizer) -> None:
    ids = ours.encode(text)
    pieces, tail = _stream(ours, ids, skip_special_tokens=skip)
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) + tail == ours.decode(ids, skip_special_tokens=skip)
    assert tail == ""  # valid text: nothing left once the last token is in


def test_streaming_holds_back_partial_characters(ours: Tokenizer) -> None:
    ids = ours.encode("😀")
    assert len(ids) > 1  # the demo vocab has no merge for this emoji, so its bytes arrive separately
    pieces, tail = _stream(ours, ids)
    assert pieces[:-1] == [""] * (len(ids) - 1)
    assert pieces[-1] == "😀" and tail == ""

    det = ours.detokenizer()
    assert det.push(ids[0]) == ""
    assert det.flush() == ours.decode(ids[:1]) == "\ufffd"  # flush returns the held-back tail


def test_streaming_window_stays_small(ours: Tokenizer) -> None:
    det = ours.detokenizer()
    text = "The quick brown fox jumps over the lazy dog. " * 200
    out = [det.push(i) for i in ours.encode(text)]
    assert "".join(out) + det.flush() == text
    det2 = ours.detokenizer()
    for i in ours.encode(text):
        det2.push(i)
        assert len(det2._ids) <= 4  # decoding cost per token is bounded, not O(sequence length)


def test_out_of_vocab_ids(ours: Tokenizer) -> None:
    hello = ours.encode("hello")
    padded = [ours.vocab_size + 7, *hello, 10**9, -1]
    assert ours.decode(padded) == "hello"
    pieces, tail = _stream(ours, padded)
    assert "".join(pieces) + tail == "hello"
    assert pieces[0] == "" and pieces[-1] == ""


def test_modules_import_without_torch() -> None:
    code = (
        "import sys; import freetoken.runtime.text.tokenizer, freetoken.runtime.text.demo_tokenizer; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    src = Path(__file__).resolve().parents[3] / "src"
    env = {"PYTHONPATH": str(src)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
