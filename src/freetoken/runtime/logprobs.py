"""Log-probabilities of sampled tokens, as OpenAI's `logprobs` report them: the model's own
distribution (log-softmax of the raw logits, before temperature, penalties and filters)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the most likely tokens with theirs, best first


def token_logprobs(logits: torch.Tensor, token_id: int, top: int) -> TokenLogprobs:
    """logits [V] -> the log-probability of `token_id` and the `top` most likely alternatives."""
    logp = torch.log_softmax(logits.detach().float(), dim=-1)
    chosen = float(logp[token_id])
    if top <= 0:
        return TokenLogprobs(token_id, chosen, ())
    values, ids = torch.topk(logp, min(top, logp.shape[-1]))
    return TokenLogprobs(token_id, chosen, tuple(zip(ids.tolist(), values.tolist(), strict=True)))
