"""A GGUF's SentencePiece vocabulary (`tokenizer.ggml.model` = "llama": Mixtral's, Llama's) as a
`tokenizers` BPE: pieces with scores and no merge list, so the merges are recovered from the scores.

A pair (a, b) merges when a, b and a + b are all pieces; pairs merge best score of a + b first (ties: the
shorter left piece, then the lower ids), which is SentencePiece's BPE: repeatedly join the adjacent pair
whose joined piece scores best. Spaces are "▁", one is prepended (unless the file says
`add_space_prefix` false), and characters no piece covers fall back to their UTF-8 bytes (`<0xNN>`).
"""

from __future__ import annotations

from typing import Any

SPACE = "\u2581"
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def merges_from_scores(tokens: list[str], scores: list[float], mergeable: set[int]) -> list[tuple[str, str]]:
    """Every split of a mergeable piece into two pieces, best piece score first."""
    ids = {token: i for i, token in enumerate(tokens) if i in mergeable}
    found = []
    for merged, index in ids.items():
        for cut in range(1, len(merged)):
            left, right = merged[:cut], merged[cut:]
            if left in ids and right in ids:
                found.append((-scores[index], len(left), ids[left], ids[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def build_spm_tokenizer(
    tokens: list[str], scores: list[float] | None, types: list[int] | None, add_space: bool
) -> Any:
    """-> a tokenizers.Tokenizer; control and user-defined pieces stay whole as added tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    types = types or [NORMAL] * len(tokens)
    scores = scores or [0.0] * len(tokens)
    mergeable = {i for i, kind in enumerate(types) if kind in (NORMAL, USER_DEFINED, UNUSED)}
    unk = next((tokens[i] for i, kind in enumerate(types) if kind == UNKNOWN), None)
    model = models.BPE(
        vocab={token: i for i, token in enumerate(tokens)},
        merges=merges_from_scores(tokens, scores, mergeable),
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
    )
    tokenizer = Tokenizer(model)
    steps = [normalizers.Replace(" ", SPACE)]
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), *steps] if add_space else steps)
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if add_space else [])
    )
    for i, kind in enumerate(types):
        if kind in (CONTROL, UNKNOWN):
            tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)])
        elif kind == USER_DEFINED:
            tokenizer.add_tokens([AddedToken(tokens[i], normalized=False)])
    return tokenizer
