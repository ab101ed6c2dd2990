"""What the handlers share: the server's settings, the batcher, names; and the edge checks on size."""

from __future__ import annotations

import ipaddress
import time
from dataclasses import dataclass, field

from freetoken.runtime.batcher import Batcher
from freetoken.runtime.text.prompt_bound import PromptBound
from freetoken.serve.errors import ApiError
from freetoken.serve.logprobs_json import TokenPieces

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1", "[::1]")


@dataclass(frozen=True)
class ServeConfig:
    """Built once from the command line (or a test)."""

    api_key: str | None = None
    max_body_bytes: int = 32 << 20
    default_max_tokens: int = 4096
    public_metrics: bool = False  # /metrics and /v1/stats open even with an API key
    # Host header names accepted; None: any (the server is not bound to a loopback address)
    allowed_hosts: tuple[str, ...] | None = LOOPBACK_NAMES
    cors_origins: tuple[str, ...] = ()
    shutdown_timeout_s: float = 30.0


def host_allowlist(bind_host: str, extra: tuple[str, ...]) -> tuple[str, ...] | None:
    """Host header names to accept when bound to `bind_host`: loopback names (and `extra`) on a loopback
    address, against DNS rebinding; on any other address, every name (None)."""
    return (*LOOPBACK_NAMES, *extra) if is_loopback(bind_host) else None


def is_loopback(name: str) -> bool:
    """A loopback name or address literal (127.0.0.0/8, ::1; IPv6 with or without brackets), never a
    DNS name that merely looks like one (`127.evil.example`)."""
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass
class ServeState:
    batcher: Batcher
    model_names: tuple[str, ...]
    config: ServeConfig = field(default_factory=ServeConfig)
    started: float = field(default_factory=time.time)
    draining: bool = False  # shutting down: new requests get 503
    bound: PromptBound = field(init=False)
    pieces: TokenPieces = field(init=False)  # token texts and bytes, for logprobs

    def __post_init__(self) -> None:
        self.bound = PromptBound.of(self.batcher.engine.tokenizer)
        self.pieces = TokenPieces(self.batcher.engine.tokenizer)

    def served_model(self, requested: str | None) -> str:
        """The model a request names (the first served name when it names none); a name this server does
        not serve is a 404 in the protocol's schema (OpenAI's code model_not_found), not silently the
        loaded model."""
        if requested is None:
            return self.model_names[0]
        if requested not in self.model_names:
            served = ", ".join(repr(name) for name in self.model_names)
            raise ApiError(
                404, f"model {requested!r} is not served here (served: {served})", "model", "model_not_found"
            )
        return requested

    def engine_context(self) -> int:
        return self.batcher.engine.max_seq_len

    def vocab_size(self) -> int:
        return self.batcher.engine.config.vocab_size

    def check_fits(self, texts_bytes: int, messages: int = 0) -> None:
        """400 before any tokenizing when the prompt cannot fit the context: at least one token per
        message, and at least the byte bound's tokens for the text."""
        context = self.engine_context()
        if messages >= context:
            raise ApiError(
                400, f"{messages} messages cannot fit the context of {context} tokens", param="messages"
            )
        least = self.bound.min_tokens(texts_bytes)
        if least >= context:
            raise ApiError(
                400,
                f"prompt of at least {least} tokens ({texts_bytes} bytes) leaves no room in the context "
                f"of {context}",
                param="messages",
            )
