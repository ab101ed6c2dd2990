"""A cheap lower bound on how many tokens a text takes, to refuse a prompt that cannot fit the context
before tokenizing it (tokenizing megabytes costs seconds and gigabytes).

No token covers more bytes than the longest one in the vocabulary, so n bytes need at least
n / longest tokens. A normalizer may shrink the text first: NFC/NFKC compose at most three code points
into one, from at most 9 bytes to 3, so the bound divides by 3 more; any other normalizer (stripping
accents, replacing) can shrink without limit, and then there is no bound.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import decoders, normalizers

from freetoken.runtime.text.tokenizer import Tokenizer

_COMPOSING = (normalizers.NFC, normalizers.NFKC)
COMPOSE_SHRINK = 3


@dataclass(frozen=True)
class PromptBound:
    longest_token_bytes: int
    shrink: int | None  # how far normalization can shrink the text; None: unbounded (no bound)

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> PromptBound:
        backend = tokenizer.backend
        byte_level = isinstance(backend.decoder, decoders.ByteLevel)
        longest = 1
        for token in backend.get_vocab(with_added_tokens=True):
            # byte-level: one character per byte; otherwise the UTF-8 of the piece is at least its bytes
            longest = max(longest, len(token) if byte_level else len(token.encode("utf-8", "replace")))
        normalizer = backend.normalizer
        shrink = 1 if normalizer is None else COMPOSE_SHRINK if isinstance(normalizer, _COMPOSING) else None
        return cls(longest, shrink)

    def min_tokens(self, nbytes: int) -> int:
        """At least this many tokens encode a text of `nbytes` UTF-8 bytes (0 when nothing is known)."""
        if self.shrink is None:
            return 0
        return -(-nbytes // (self.longest_token_bytes * self.shrink))
