"""Sampler filters against transformers' logits processors; seeding; parameter checks."""

from __future__ import annotations

import pytest
import torch

from freetoken.errors import FreeTokenError
from freetoken.runtime.logprobs import token_logprobs
from freetoken.runtime.sampling import NonFiniteLogits, Sampler, SamplingParams


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
    "kwargs",
    [
        {"temperature": -1},
        {"temperature": float("nan")},
        {"top_p": 0},
        {"top_p": 1.5},
        {"top_k": -2},
        {"max_tokens": 0},
        {"seed": 2**64},
        {"seed": -(2**63) - 1},
        {"frequency_penalty": 3.0},
        {"presence_penalty": float("inf")},
        {"logprobs": 21},
    ],
)
def test_bad_parameters(kwargs: dict) -> None:
    with pytest.raises(FreeTokenError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("temperature", [3e-39, 1e-300, 5e-324, 1e-6])
def test_tiny_temperatures_are_greedy(temperature: float) -> None:
    x = logits(3)
    assert Sampler(SamplingParams(temperature=temperature))(x) == int(x.argmax())


def test_extreme_seeds_are_accepted() -> None:
    for seed in (0, 2**64 - 1, -(2**63)):
        Sampler(SamplingParams(temperature=1.0, seed=seed))(logits())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_logits_are_named(bad: float) -> None:
    x = logits()
    x[7] = bad
    with pytest.raises(NonFiniteLogits, match="NaN/Inf"):
        Sampler(SamplingParams())(x)


def test_penalties_and_bias_follow_openai() -> None:
    """logit[j] - count[j]*frequency - (count[j] > 0)*presence + bias[j], checked on greedy picks."""
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, logit_bias=((3, 2.0), (9, -100.0)))
    sampler = Sampler(params)
    x = logits(5)
    counts = torch.zeros_like(x)
    for _ in range(12):
        reference = x.clone()
        reference[3] += 2.0
        reference[9] -= 100.0
        reference -= counts * 0.5 + (counts > 0).float() * 0.25
        token = sampler(x)
        assert token == int(reference.argmax())
        counts[token] += 1
    assert counts.count_nonzero() > 1  # the penalties moved the pick away from the first one


def test_token_logprobs_are_log_softmax() -> None:
    x = logits(9)
    ref = torch.log_softmax(x, -1)
    got = token_logprobs(x, 4, 3)
    assert got.logprob == pytest.approx(float(ref[4]), abs=1e-6)
    assert [t for t, _ in got.top] == ref.topk(3).indices.tolist()
    assert [v for _, v in got.top] == pytest.approx(ref.topk(3).values.tolist(), abs=1e-6)
    assert token_logprobs(x, 4, 0).top == ()


def test_a_stop_token_reports_no_logprobs() -> None:
    from types import SimpleNamespace

    from freetoken.runtime.request import sample

    x = logits(11)
    best = int(x.argmax())
    params = SamplingParams(logprobs=2)
    request = SimpleNamespace(sampler=Sampler(params), params=params, stop_ids=frozenset())
    token, lp = sample(request, x)  # type: ignore[arg-type]
    assert token == best and lp is not None and lp.top[0][0] == best
    request = SimpleNamespace(sampler=Sampler(params), params=params, stop_ids=frozenset({best}))
    assert sample(request, x) == (best, None)  # type: ignore[arg-type]
