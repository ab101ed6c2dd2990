"""Token log-probabilities as the OpenAI APIs spell them: chat's `logprobs.content` entries
({token, logprob, bytes, top_logprobs}) and the legacy completions' parallel arrays."""

from __future__ import annotations

import functools
from typing import Any

from tokenizers import decoders

from freetoken.runtime.logprobs import TokenLogprobs
from freetoken.runtime.text.tokenizer import Tokenizer


@functools.cache
def _byte_level_chars() -> dict[str, int]:
    """Byte-level BPE's printable stand-in character for each byte (the GPT-2 table), inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars = dict(zip(printable, printable, strict=True))
    extra = 0
    for byte in range(256):
        if byte not in chars:
            chars[byte] = 256 + extra
            extra += 1
    return {chr(code): byte for byte, code in chars.items()}


class TokenPieces:
    """Each token id's own bytes and text (a piece that splits a character is `bytes:\\xe2\\x80`)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._byte_level = isinstance(tokenizer.backend.decoder, decoders.ByteLevel)
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        piece = self._cache.get(token_id)
        if piece is None:
            piece = self._cache[token_id] = self._piece(token_id)
        return piece

    def _piece(self, token_id: int) -> tuple[str, list[int]]:
        token = self._tokenizer.id_to_token(token_id)
        if token is None:
            return "", []
        if self._byte_level:
            table = _byte_level_chars()
            raw = b"".join(bytes([table[c]]) if c in table else c.encode("utf-8") for c in token)
        else:
            raw = self._tokenizer.decode([token_id]).encode("utf-8")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:  # part of a character: named by its bytes, as OpenAI does
            text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return text, list(raw)


def chat_entries(pieces: TokenPieces, items: list[TokenLogprobs]) -> list[dict[str, Any]]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = pieces(token_id)
        return {"token": text, "logprob": logprob, "bytes": raw}

    return [
        {**entry(item.token_id, item.logprob), "top_logprobs": [entry(t, lp) for t, lp in item.top]}
        for item in items
    ]


def chat_logprobs(pieces: TokenPieces, items: list[TokenLogprobs]) -> dict[str, Any]:
    return {"content": chat_entries(pieces, items), "refusal": None}


def completion_logprobs(pieces: TokenPieces, items: list[TokenLogprobs], offset: int = 0) -> dict[str, Any]:
    """{tokens, token_logprobs, top_logprobs, text_offset}; `offset`: characters of text before these."""
    tokens, offsets = [], []
    for item in items:
        offsets.append(offset)
        text = pieces(item.token_id)[0]
        tokens.append(text)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [item.logprob for item in items],
        "top_logprobs": [{pieces(t)[0]: lp for t, lp in item.top} for item in items],
        "text_offset": offsets,
    }
