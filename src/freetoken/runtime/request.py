"""A generation request's state, and what accepting one sampled token does to it.

The scheduler (runtime/scheduler.py) drives both `run` and `serve` through these, so both stop,
detokenise and report the same way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from freetoken.runtime.logprobs import TokenLogprobs, token_logprobs
from freetoken.runtime.sampling import Sampler, SamplingParams
from freetoken.runtime.sequence import GenerationStats, Sequence, TokenEvent
from freetoken.runtime.text.stopping import StopStrings
from freetoken.runtime.text.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(eq=False)  # compared by identity: a request is one object
class Request:
    id: int
    prompt_ids: list[int]
    params: SamplingParams
    sampler: Sampler
    detok: IncrementalDetokenizer
    stops: StopStrings
    stop_ids: frozenset[int]
    output_ids: list[int] = field(default_factory=list)
    next_token: int | None = None  # sampled, not yet fed to the model
    cached_tokens: int = 0
    t_start: float = 0.0
    t_first: float = 0.0
    finished: bool = False
    seq: Sequence | None = None  # its own sequence when several run at once


def new_request(
    request_id: int,
    prompt_ids: list[int],
    params: SamplingParams,
    tokenizer: Tokenizer,
    eos_ids: frozenset[int],
) -> Request:
    stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_ids)
    return Request(
        id=request_id,
        prompt_ids=list(prompt_ids),
        params=params,
        sampler=Sampler(params),
        detok=tokenizer.detokenizer(),
        stops=StopStrings(params.stop),
        stop_ids=stop_ids,
    )


Sampled = tuple[int, TokenLogprobs | None]  # a token drawn for a request, with its log-probabilities


def sample(request: Request, logits: torch.Tensor) -> Sampled:
    """Draw the next token from last-position logits [V], with its log-probabilities when asked for (a
    stop token is not part of the answer: none for it)."""
    token = request.sampler(logits)
    top = request.params.logprobs
    if top is None or token in request.stop_ids:
        return token, None
    return token, token_logprobs(logits, token, top)


def sample_each(requests: list[Request], logits: torch.Tensor) -> list[Sampled | Exception]:
    """Sample row i of logits [B, V] for requests[i]; a row whose sampling fails (non-finite logits) is
    that exception, so its request fails alone."""
    out: list[Sampled | Exception] = []
    for request, row in zip(requests, logits, strict=True):
        try:
            out.append(sample(request, row))
        except Exception as exc:
            out.append(exc)
    return out


def accept_token(
    request: Request, token: int, first: bool, room: bool, logprobs: TokenLogprobs | None = None
) -> TokenEvent:
    """Record `token` (sampled for `request`); `room`: the context can take one more position.

    Returns the event to stream: its text (held back while it may be the start of a stop string), and
    on the last one the finish reason and the stats.
    """
    now = time.perf_counter()
    if first:
        request.t_first = now
    request.output_ids.append(token)
    reason = None
    if token in request.stop_ids:
        reason, text = "stop", ""
    else:
        text = request.stops.push(request.detok.push(token))
        if request.stops.stopped:
            reason = "stop"
        elif len(request.output_ids) >= request.params.max_tokens or not room:
            reason = "length"
    if reason is None:
        request.next_token = token
        return TokenEvent(request.id, token, text, logprobs=logprobs)
    if not request.stops.stopped:
        text += request.stops.push(request.detok.flush()) + request.stops.flush()
    request.finished = True
    request.next_token = None
    stats = GenerationStats(
        prompt_tokens=len(request.prompt_ids),
        cached_tokens=request.cached_tokens,
        completion_tokens=len(request.output_ids),
        prefill_s=request.t_first - request.t_start,
        decode_s=now - request.t_first,
        ttft_s=request.t_first - request.t_start,
    )
    return TokenEvent(request.id, token, text, finish_reason=reason, stats=stats, logprobs=logprobs)
