"""Fixtures for the tokenizer and chat-template tests: the demo tokenizer, ours and transformers'."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from freetoken.runtime.text.demo_tokenizer import write_demo_tokenizer
from freetoken.runtime.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("demo_tok")
    write_demo_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def ours(demo_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(demo_dir)


@pytest.fixture(scope="module")
def theirs(demo_dir: Path) -> Any:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(demo_dir)
