"""Semantic anchors: the chat template's block boundaries, where agent harnesses cut a context.

Harnesses edit whole blocks: strip a turn's thinking, replace an old tool output, drop an observation.
The prefix before a block's opener survives any edit inside it, and so does the prefix after a block's
closer when what follows changes. So a recurrent-state checkpoint is worth most at two kinds of position:
  before an opener   <think>, <tool_call>, <tool_response>, <|im_start|>   (the block may be edited)
  after a closer     </think>, </tool_call>, </tool_response>, <|im_end|>   (what follows may be)
and harmony's (gpt-oss) messages: before <|start|>, after <|end|> or <|call|> (a tool call's end).
A position p means "the state after tokens [0, p)". The table comes from the tokenizer: each marker
becomes its token-id sequence (one special token in Qwen's vocabularies, several where a tokenizer splits
it), and markers the tokenizer cannot encode as themselves are left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from freetoken.runtime.text.tokenizer import Tokenizer

# kind -> (opener, closer)
CHAT_BLOCKS = {
    "think": ("<think>", "</think>"),
    "tool_call": ("<tool_call>", "</tool_call>"),
    "tool_response": ("<tool_response>", "</tool_response>"),
    "turn": ("<|im_start|>", "<|im_end|>"),
    "message": ("<|start|>", "<|end|>"),  # harmony's
    "call": ("<|start|>", "<|call|>"),
}


@dataclass(frozen=True)
class Anchor:
    position: int
    kind: str  # block kind
    edge: str  # "open" (before the opener) or "close" (after the closer)


@dataclass(frozen=True)
class AnchorTable:
    markers: tuple[tuple[tuple[int, ...], str, str], ...]  # (token ids, kind, edge)

    @classmethod
    def from_tokenizer(
        cls, tokenizer: Tokenizer, blocks: dict[str, tuple[str, str]] = CHAT_BLOCKS
    ) -> AnchorTable:
        markers = []
        for kind, (opener, closer) in blocks.items():
            for text, edge in ((opener, "open"), (closer, "close")):
                ids = tuple(tokenizer.encode(text))
                if ids and tokenizer.decode(list(ids)) == text:
                    markers.append((ids, kind, edge))
        return cls(tuple(markers))

    def find(self, ids: Sequence[int], start: int = 0) -> list[Anchor]:
        """Anchors in ids[start:]: absolute positions, an opener's before it, a closer's after it."""
        found = []
        for i in range(start, len(ids)):
            for marker, kind, edge in self.markers:
                if tuple(ids[i : i + len(marker)]) == marker:
                    found.append(Anchor(i if edge == "open" else i + len(marker), kind, edge))
        return sorted(set(found), key=lambda a: a.position)
