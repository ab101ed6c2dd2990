"""How a decode step draws the next token of each running request, on the device when it can.

The step's mode follows its requests: `greedy` when every one is greedy, `sample` when some draw (their
temperature, top-k, top-p, seed and step staged as device rows; `draw` when none of them has top-k or
top-p, which skips the sort over the vocabulary), `logits` when any needs what only the
host sampler does (penalties, logit bias, logprobs): then every row is sampled on the host from the
step's logits, as the first token after a prefill is.
"""

from __future__ import annotations

from freetoken.runtime.decode_graph import StepOutput
from freetoken.runtime.device_sampling import SamplingRows, filtered
from freetoken.runtime.request import Request, Sampled, sample_each
from freetoken.runtime.sampling import NON_FINITE, NonFiniteLogits


def sampling_mode(requests: list[Request]) -> str:
    if any(r.params.adjusts_logits or r.params.logprobs is not None for r in requests):
        return "logits"
    if all(r.params.greedy for r in requests):
        return "greedy"
    if any(filtered(r.params) for r in requests if not r.params.greedy):
        return "sample"
    return "draw"  # sampled over the whole vocabulary: no sort


def stage_sampling(rows: SamplingRows, requests: list[Request]) -> None:
    """Row i draws for requests[i] with its sampler's seed and step (so a seeded request repeats)."""
    for i, request in enumerate(requests):
        sampler = request.sampler
        rows.set_row(i, sampler.params, sampler.seed, sampler.step)
    rows.upload(len(requests))


def accept_drawn(requests: list[Request], out: StepOutput) -> list[Sampled | Exception]:
    """Each request's token from the step (drawn on the device, else sampled here from its logits); a row
    with NaN/Inf logits is that exception, so its request fails alone."""
    if out.tokens is None or out.finite is None:
        return sample_each(requests, out.logits)
    results: list[Sampled | Exception] = []
    for request, token, finite in zip(requests, out.tokens, out.finite, strict=True):
        if not finite:
            results.append(NonFiniteLogits(NON_FINITE))
            continue
        request.sampler.record(token)
        results.append((token, None))
    return results
