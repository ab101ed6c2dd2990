"""Sampler filters against transformers' logits processors; seeding; parameter checks."""

from __future__ import annotations

import pytest
import torch

from freetoken.errors import FreeTokenError
from freetoken.runtime.sampling import Sampler, SamplingParams


def logits(seed: int = 0, v: int = 50) -> torch.Tensor:
    return torch.randn(v, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax() -> None:
    x = logits()
    assert Sampler(SamplingParams())(x) == int(x.argmax())
    assert Sampler(SamplingParams(temperature=1.5, top_k=1))(x) == int(x.argmax())


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(0.7, 0, 1.0), (1.0, 5, 1.0), (0.8, 0, 0.6), (1.3, 10, 0.9)]
)
def test_filters_match_transformers(temperature: float, top_k: int, top_p: float) -> None:
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    x = logits(3)
    chain = [TemperatureLogitsWarper(temperature)]
    if top_k:
        chain.append(TopKLogitsWarper(top_k))
    if top_p < 1:
        chain.append(TopPLogitsWarper(top_p))
    ref = LogitsProcessorList(chain)(torch.zeros(1, 1, dtype=torch.long), x[None].clone())[0].softmax(-1)
    ours = Sampler(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)).filtered_probs(x)
    torch.testing.assert_close(ours, ref)
    kept = int((ours > 0).sum())
    assert kept < 50 if (top_k or top_p < 1) else kept == 50


def test_seed_reproduces_and_differs() -> None:
    x = logits(5)

    def draw(seed: int) -> list[int]:
        sampler = Sampler(SamplingParams(temperature=1.0, seed=seed))
        return [sampler(x) for _ in range(30)]

    assert draw(1) == draw(1)
    assert draw(1) != draw(2)


def test_samples_follow_the_distribution() -> None:
    x = torch.tensor([0.0, 1.0, 2.0, -10.0])
    sampler = Sampler(SamplingParams(temperature=1.0, seed=0))
    counts = torch.bincount(torch.tensor([sampler(x) for _ in range(4000)]), minlength=4).float() / 4000
    torch.testing.assert_close(counts, x.softmax(-1), atol=0.03, rtol=0)


@pytest.mark.parametrize(
    "kwargs", [{"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -2}, {"max_tokens": 0}]
)
def test_bad_parameters(kwargs: dict) -> None:
    with pytest.raises(FreeTokenError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)
