"""The cheap token-count bound: never above the real count, for texts that normalization shrinks too."""

from __future__ import annotations

import unicodedata
from pathlib import Path
from typing import Any

import pytest

from freetoken.runtime.text.prompt_bound import COMPOSE_SHRINK, PromptBound
from freetoken.runtime.text.tokenizer import Tokenizer

HANGUL_JAMO = unicodedata.normalize("NFD", "한국어 텍스트 ") * 50  # 3 code points, 9 bytes -> 1 syllable
TEXTS = [
    "plain ascii words " * 200,
    "x" * 5000,
    " " * 3000,
    "数字と漢字のテキスト。" * 100,
    "emoji 🙂🚀 " * 300,
    HANGUL_JAMO,
    unicodedata.normalize("NFD", "é" * 2000),
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model: tuple[Path, Any]) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model[0])


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_bound_never_exceeds_the_real_count(tokenizer: Tokenizer, text: str) -> None:
    bound = PromptBound.of(tokenizer)
    assert bound.shrink in (1, COMPOSE_SHRINK)
    assert 0 < bound.min_tokens(len(text.encode("utf-8"))) <= len(tokenizer.encode(text))


def test_bound_is_useful_for_huge_prompts(tokenizer: Tokenizer) -> None:
    bound = PromptBound.of(tokenizer)
    assert bound.min_tokens(30 << 20) > 100_000  # a 30 MiB prompt is refused without tokenizing


def test_no_bound_where_normalization_can_shrink_without_limit(tiny_model: tuple[Path, Any]) -> None:
    from tokenizers import normalizers

    stripping = Tokenizer.from_dir(tiny_model[0])  # its own instance: the change stays here
    stripping.backend.normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.StripAccents()])
    assert PromptBound.of(stripping).min_tokens(1 << 30) == 0
