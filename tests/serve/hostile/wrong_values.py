"""Values of the wrong type, numbers out of range, and non-finite numbers, per field."""

from __future__ import annotations

from hypothesis import strategies as st

from .bodies import TEXT, at_fields, one_of_values
from .core import CHAT, COMPLETIONS, COUNT, DELETE, MESSAGES, VOCAB, Raw

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), TEXT)
ANY_JSON = st.recursive(
    SCALARS, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(TEXT, kids, max_size=3), max_leaves=8
)
WRONG = ANY_JSON | st.just(DELETE)

NUMBERS = ["temperature", "top_p", "top_k", "seed", "n", "max_tokens"]
WRONG_TYPE = {
    CHAT: at_fields(
        [
            *((f,) for f in NUMBERS),
            ("max_completion_tokens",),
            ("messages",),
            ("model",),
            ("stop",),
            ("stream",),
            ("stream_options",),
            ("tools",),
            ("tool_choice",),
            ("chat_template_kwargs",),
            ("chat_template_kwargs", "enable_thinking"),
            ("ignore_eos",),
            ("messages", 0),
            ("messages", -1, "role"),
            ("messages", -1, "content"),
            ("messages", -1, "name"),
            ("messages", -1, "reasoning_content"),
            ("messages", -1, "tool_calls"),
        ],
        ANY_JSON,
    ),
    COMPLETIONS: at_fields(
        [*((f,) for f in NUMBERS), ("prompt",), ("model",), ("stop",), ("stream",), ("ignore_eos",)], ANY_JSON
    ),
    MESSAGES: at_fields(
        [
            *((f,) for f in ("temperature", "top_p", "top_k", "max_tokens")),
            ("model",),
            ("messages",),
            ("system",),
            ("stop_sequences",),
            ("stream",),
            ("tools",),
            ("tool_choice",),
            ("thinking",),
            ("messages", -1, "role"),
            ("messages", -1, "content"),
            ("messages", -1, "content", 0),
            ("messages", -1, "content", 0, "text"),
        ],
        WRONG,
    ),
    COUNT: at_fields(
        [("model",), ("messages",), ("system",), ("tools",), ("messages", -1, "content")], WRONG
    ),
}
# missing fields that the protocol requires: chat without messages, completions without prompt
WRONG_TYPE[CHAT] += [(("messages",), st.just(DELETE))]
WRONG_TYPE[COMPLETIONS] += [(("prompt",), st.just(DELETE))]

HUGE = [2**31, 2**32, 2**63 - 1, 2**63, 2**64, 2**70, 10**30, -(2**63) - 1]
LENGTH = one_of_values([0, -1, -(2**31), *HUGE])
TEMPERATURE = one_of_values([3e-39, 1e-300, 5e-324, 1e-45, -1, -1e-300, 2.000001, 1e308, 1e30])
TOP_P = one_of_values([0, 0.0, 2, -0.5, 1e-300, 5e-324, 1.0000001, 1e308])
TOP_K = one_of_values([-1, 2**31, *HUGE])
SEED = one_of_values([-1, *HUGE])
N = one_of_values([2, 0, -1, 128, 2**70])
PENALTY = one_of_values([2, -2, 2.0000001, -2.0000001, 1e308, -1e308, 5e-324])
LOGIT_BIAS = one_of_values(
    [
        {"5": 1e308},
        {"5": -101},
        {"5": 100, "6": -100},
        {"-1": 1},
        {str(2**70): 1},
        {"99999999999": 1},
        {"1e3": 1},
        {" 5": 1},
        {"05": 1},
        {"٣": 1},
        {"": 1},
        {"5": True},
        {"5": "1"},
        {"5": [1]},
        {str(VOCAB + 8): 1},
        {str(i): 100 for i in range(VOCAB + 8)},
        {str(i): -100 for i in range(VOCAB + 8)},
        [],
        "5",
    ]
)
OPENAI_RANGES = [
    (("max_tokens",), LENGTH),
    (("temperature",), TEMPERATURE),
    (("top_p",), TOP_P),
    (("top_k",), TOP_K),
    (("seed",), SEED),
    (("n",), N),
    (("frequency_penalty",), PENALTY),
    (("presence_penalty",), PENALTY),
    (("logit_bias",), LOGIT_BIAS),
]
OUT_OF_RANGE = {
    CHAT: [*OPENAI_RANGES, (("max_completion_tokens",), LENGTH)],
    COMPLETIONS: OPENAI_RANGES,
    MESSAGES: [
        (("max_tokens",), LENGTH),
        (("temperature",), TEMPERATURE | st.just(1.5)),
        (("top_p",), TOP_P),
        (("top_k",), TOP_K),
    ],
}

NON_FINITE_TEXT = [
    b"NaN",
    b"Infinity",
    b"-Infinity",
    b"1e999",
    b"-1e999",
    b"1e-999",
    b"-0",
    b"-0.0",
    b"1E+400",
]
NON_FINITE = st.sampled_from([Raw(t) for t in NON_FINITE_TEXT]) | st.sampled_from(
    [float("nan"), float("inf"), float("-inf"), 2.5, 1e2, 1.0]
)
NUMERIC = {
    CHAT: [*NUMBERS, "max_completion_tokens", "top_logprobs"],
    COMPLETIONS: [*NUMBERS, "logprobs"],
    MESSAGES: ["temperature", "top_p", "top_k", "max_tokens"],
}
NON_FINITE_FIELDS = {path: at_fields([(f,) for f in names], NON_FINITE) for path, names in NUMERIC.items()}
