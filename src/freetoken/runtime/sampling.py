"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, seeded."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from freetoken.errors import FreeTokenError
from freetoken.runtime.config import read_json


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; top_k 0 and top_p 1 disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise FreeTokenError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise FreeTokenError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise FreeTokenError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_tokens < 1:
            raise FreeTokenError(f"max_tokens must be >= 1, got {self.max_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


class Sampler:
    """Draws one token per call from last-position logits; owns its random generator (seeded per request)."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator = torch.Generator(device="cpu")
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def filtered_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] -> probabilities [V] after temperature, top-k, then top-p (HF's order)."""
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
        """logits [V] (any device) -> token id."""
        if self.params.greedy:
            return int(torch.argmax(logits))
        probs = self.filtered_probs(logits.detach().to("cpu"))
        return int(torch.multinomial(probs, 1, generator=self.generator))


def generation_defaults(model_dir: Path) -> dict[str, float | int]:
    """Sampling defaults a model ships in generation_config.json (temperature, top_p, top_k), if any."""
    path = Path(model_dir) / "generation_config.json"
    if not path.exists():
        return {}
    raw = read_json(path)
    out: dict[str, float | int] = {}
    if raw.get("do_sample") is False:
        return {"temperature": 0.0}
    for key, cast in (("temperature", float), ("top_p", float), ("top_k", int)):
        if raw.get(key) is not None:
            out[key] = cast(raw[key])
    return out
