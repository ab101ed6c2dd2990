"""Open a GGUF model: its config, its tokenizer and its weights (dequantised to the pool dtype)."""

from __future__ import annotations

from pathlib import Path

from freetoken.formats.gguf_checkpoint import GgufCheckpoint
from freetoken.formats.gguf_meta import build_tokenizer, config_dict
from freetoken.runtime.config import ModelConfig
from freetoken.runtime.models import get_architecture
from freetoken.runtime.text.tokenizer import Tokenizer


def is_gguf(path: Path) -> bool:
    return Path(path).is_file() and Path(path).suffix == ".gguf"


def open_gguf(path: Path) -> tuple[ModelConfig, Tokenizer, GgufCheckpoint]:
    ckpt = GgufCheckpoint(path)
    raw = config_dict(ckpt)
    config = get_architecture(raw["model_type"]).parse_config(raw, str(path))
    backend, tok_config = build_tokenizer(ckpt)
    special = {k: v for k, v in tok_config.items() if k.endswith("_token") and v is not None}
    eos = (
        [int(ckpt.get("tokenizer.ggml.eos_token_id"))]
        if ckpt.get("tokenizer.ggml.eos_token_id") is not None
        else []
    )
    tokenizer = Tokenizer(
        backend,
        special_tokens=special,
        eos_token_ids=eos,
        chat_template=tok_config.get("chat_template"),
        source=Path(path),
    )
    return config, tokenizer, ckpt
