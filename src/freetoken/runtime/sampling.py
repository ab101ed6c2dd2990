"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, penalties, logit bias, seeded."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from freetoken.errors import FreeTokenError

# Below this a temperature is greedy: dividing logits by it would overflow to inf (and NaN after softmax).
SAMPLING_EPS = 1e-5
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # any 64 bits, signed or not (sampling reads them as int64)


class NonFiniteLogits(FreeTokenError):
    """The model produced NaN or Inf logits: its weights (or their dtype) are broken, not the request."""


NON_FINITE = "the model produced NaN/Inf logits: its weights are broken (or overflow in this dtype)"


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 (or below SAMPLING_EPS) is greedy; top_k 0 and top_p 1 disable those filters.

    Penalties follow OpenAI: each generated token's logit drops by count·frequency_penalty plus
    presence_penalty once it has appeared; `logit_bias` adds (token id, bias) pairs. `logprobs`: how
    many top alternatives to report beside each sampled token's log-probability (None: none at all).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "frequency_penalty", "presence_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise FreeTokenError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.temperature < 0:
            raise FreeTokenError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise FreeTokenError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise FreeTokenError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_tokens < 1:
            raise FreeTokenError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise FreeTokenError(f"seed must be a 64-bit integer, got {self.seed}")
        if not all(-2 <= p <= 2 for p in (self.frequency_penalty, self.presence_penalty)):
            raise FreeTokenError("frequency_penalty and presence_penalty must be in [-2, 2]")
        if any(not math.isfinite(b) or not -100 <= b <= 100 for _, b in self.logit_bias):
            raise FreeTokenError("logit_bias values must be in [-100, 100]")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise FreeTokenError(f"logprobs must be in [0, 20], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def adjusts_logits(self) -> bool:
        return bool(self.frequency_penalty or self.presence_penalty or self.logit_bias)


class Sampler:
    """Draws one token per call from last-position logits, with `sample_rows` (B = 1, on the logits'
    device): counter-based noise from the request's `seed` and `step` (tokens drawn so far), so a seeded
    request reproduces its tokens whether drawn here or in a batched device draw that stages the row
    from this sampler (`params`, `seed`, `step`) and then calls `record(token)`."""

    def __init__(self, params: SamplingParams) -> None:
        from freetoken.runtime.device_sampling import request_seed  # it imports this module

        self.params = params
        self.seed: int = request_seed(params)  # int64 range
        self.step: int = 0
        self._counts: dict[int, int] = {}  # generated token -> times, for the penalties
        self._rows: dict[torch.device, tuple[torch.Tensor, ...]] = {}  # per-device parameter rows

    def adjusted(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] after the logit bias and the frequency/presence penalties (a copy when changed)."""
        p = self.params
        if not p.adjusts_logits:
            return logits
        out = logits.float().clone()
        vocab = out.shape[-1]
        for token, bias in p.logit_bias:
            if 0 <= token < vocab:
                out[token] += bias
        if self._counts and (p.frequency_penalty or p.presence_penalty):
            ids = torch.tensor(list(self._counts), device=out.device)
            counts = torch.tensor(list(self._counts.values()), dtype=out.dtype, device=out.device)
            out[ids] -= counts * p.frequency_penalty + p.presence_penalty
        return out

    def filtered_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] -> probabilities [V] after temperature, top-k, then top-p (HF's order): the plain
        reference that `sample_rows` (which does the drawing) is tested against."""
        p = self.params
        scores = logits.float() / p.temperature
        if 0 < p.top_k < scores.shape[-1]:
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=True)
            cumulative = sorted_scores.softmax(-1).cumsum(-1)
            # Drop a token when the mass before it already reaches top_p; the first token always stays.
            drop_sorted = (cumulative - sorted_scores.softmax(-1)) >= p.top_p
            drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
            scores = scores.masked_fill(drop, float("-inf"))
        return scores.softmax(-1)

    def __call__(self, logits: torch.Tensor) -> int:
        """logits [V] (any device) -> token id. NonFiniteLogits when the model produced NaN or Inf."""
        from freetoken.runtime.device_sampling import filtered, greedy_rows, sample_rows

        logits = self.adjusted(logits)  # finite exactly when the raw logits are (the changes are finite)
        if self.params.greedy:
            tokens, finite = greedy_rows(logits[None])
        else:
            temperature, top_k, top_p, seed = self._device_rows(logits.device)
            step = torch.tensor([self.step], dtype=torch.int64, device=logits.device)
            rows = temperature, top_k, top_p, seed, step
            tokens, finite = sample_rows(logits[None], *rows, filtered(self.params))
        token, ok = torch.stack((tokens, finite.long()), dim=1)[0].tolist()  # one sync
        if not ok:
            raise NonFiniteLogits(NON_FINITE)
        self.record(token)
        return token

    def record(self, token: int) -> None:
        """Account for a drawn token (here or by a batched device draw): the step and the penalty counts."""
        self.step += 1
        self._counts[token] = self._counts.get(token, 0) + 1

    def _device_rows(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(temperature, top_k, top_p, seed), each [1] on `device`: this request's rows for sample_rows."""
        if device not in self._rows:
            p = self.params
            self._rows[device] = (
                torch.tensor([p.temperature], dtype=torch.float32, device=device),
                torch.tensor([p.top_k], dtype=torch.int64, device=device),
                torch.tensor([p.top_p], dtype=torch.float32, device=device),
                torch.tensor([self.seed], dtype=torch.int64, device=device),
            )
        return self._rows[device]
