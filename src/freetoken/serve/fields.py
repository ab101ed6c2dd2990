"""Which top-level request fields each endpoint takes: nothing is ignored silently.

A field is implemented (the handler reads it), accepted and ignored (listed here and in the README:
fields that change nothing a local server does, such as `user` or `store`), accepted only at its neutral
value (e.g. `echo: false`: clients send defaults explicitly), or refused with a 400 that names it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from freetoken.serve.errors import bad


def _is(*values: Any) -> Callable[[Any], bool]:
    return lambda v: any(v == x and type(v) is type(x) for x in values)


@dataclass(frozen=True)
class Fields:
    implemented: frozenset[str]
    ignored: frozenset[str] = frozenset()
    neutral: tuple[tuple[str, Callable[[Any], bool], str], ...] = ()  # (name, accepts, what is supported)

    def check(self, body: dict[str, Any]) -> None:
        neutral = {name: (accepts, what) for name, accepts, what in self.neutral}
        for name, value in body.items():
            if name in self.implemented or name in self.ignored or value is None:
                continue
            if name in neutral:
                accepts, what = neutral[name]
                if accepts(value):
                    continue
                raise bad(name, f"not supported by this server ({what})")
            raise bad(name, "unknown or unsupported parameter")


_SAMPLING = frozenset(
    {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream", "stream_options"}
    | {"logprobs", "frequency_penalty", "presence_penalty", "logit_bias", "ignore_eos"}
)
OPENAI_IGNORED = frozenset(
    {"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"}
)

CHAT = Fields(
    implemented=_SAMPLING
    | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "chat_template_kwargs"},
    ignored=OPENAI_IGNORED | {"parallel_tool_calls"},
    neutral=(
        ("response_format", lambda v: v == {"type": "text"}, "only {'type': 'text'}"),
        ("modalities", lambda v: v == ["text"], "only ['text']"),
        ("functions", _is([]), "use tools"),
        ("function_call", _is("none", "auto"), "use tool_choice"),
    ),
)

COMPLETIONS = Fields(
    implemented=_SAMPLING | {"prompt"},
    ignored=OPENAI_IGNORED,
    neutral=(
        ("echo", _is(False), "only echo: false"),
        ("suffix", _is(""), "no suffix"),
        ("best_of", _is(1), "only best_of: 1"),
    ),
)

_ANTHROPIC_PROMPT = frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking"})
MESSAGES = Fields(
    implemented=_ANTHROPIC_PROMPT
    | {"max_tokens", "stop_sequences", "stream", "temperature", "top_p", "top_k"},
    ignored=frozenset({"metadata", "service_tier"}),
)
COUNT_TOKENS = Fields(implemented=_ANTHROPIC_PROMPT)
