"""One sequence's state: its KV cache and the tokens it holds, plus what a request streams back."""

from __future__ import annotations

from dataclasses import dataclass, field

from freetoken.runtime.kv.cache import KVCache
from freetoken.runtime.kv.state_checkpoints import StateCheckpoints
from freetoken.runtime.logprobs import TokenLogprobs

PREFILL, DECODE = 0, 1  # the phase of a forward pass (as routing traces record it)


@dataclass
class Sequence:
    kv: KVCache
    token_ids: list[int] = field(default_factory=list)  # exactly the tokens whose K/V are cached
    checkpoints: StateCheckpoints | None = None  # recurrent states saved along it (hybrid models)

    def common_prefix(self, ids: list[int]) -> int:
        n = 0
        for a, b in zip(self.token_ids, ids, strict=False):
            if a != b:
                break
            n += 1
        return n

    def truncate(self, length: int) -> None:
        del self.token_ids[length:]
        self.kv.truncate(length)

    def release(self) -> None:
        """Give the sequence's KV slot back to the engine; the sequence is not used afterwards."""
        self.kv.release()


@dataclass(frozen=True)
class GenerationStats:
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV was reused instead of recomputed
    completion_tokens: int
    prefill_s: float
    decode_s: float
    ttft_s: float

    @property
    def prefill_tok_s(self) -> float:
        computed = self.prompt_tokens - self.cached_tokens
        return computed / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        # The first token comes from the prefill; each later one costs one decode step.
        steps = max(self.completion_tokens - 1, 0)
        return steps / self.decode_s if self.decode_s > 0 else 0.0

    def as_dict(self) -> dict[str, float | int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "prefill_s": round(self.prefill_s, 6),
            "decode_s": round(self.decode_s, 6),
            "ttft_s": round(self.ttft_s, 6),
            "prefill_tok_s": round(self.prefill_tok_s, 2),
            "decode_tok_s": round(self.decode_tok_s, 2),
        }


@dataclass(frozen=True)
class TokenEvent:
    """What one step streams for one request. The final event has `finish_reason` and `stats`."""

    request_id: int
    token_id: int | None
    text: str
    finish_reason: str | None = None  # "stop" | "length"
    stats: GenerationStats | None = None
    logprobs: TokenLogprobs | None = None  # when the request asked for them

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
