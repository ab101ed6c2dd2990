"""Token ids as completions prompts, logprobs parameters, and logit biases that force special tokens."""

from __future__ import annotations

from hypothesis import strategies as st

from .bodies import BODIES, CHAT_TOOL, one_of_values, post
from .core import CHAT, COMPLETIONS, VOCAB, HostileRequest
from .wrong_values import ANY_JSON

TOKEN_ID_PROMPTS = [
    [-1],
    [VOCAB + 8],
    [10**9],
    [2**31],
    [2**63],
    [2**64],
    [-(2**63) - 1],
    [1, "a"],
    [1.5],
    [1.0],
    [True],
    [None],
    [],
    [[1, 2]],
    [[1], [2]],
    [[]],
    ["a", "b"],
    [0] * 2000,
    [1] * 1023,
    list(range(VOCAB)),
]
TOKEN_IDS = {
    COMPLETIONS: [
        (("prompt",), one_of_values(TOKEN_ID_PROMPTS)),
        (("prompt",), st.lists(st.integers(), min_size=1, max_size=8)),
        (("prompt",), st.lists(st.integers(0, VOCAB - 1) | ANY_JSON, min_size=1, max_size=8)),
    ]
}

# ------------------------------------------------------------------------------------------ logprobs

LOGPROBS = {
    CHAT: [
        (("logprobs",), st.booleans() | one_of_values(["yes", 1, 0, None, [], {}])),
        (("top_logprobs",), st.integers(0, 20) | one_of_values([-1, 21, 2**70, 1.5, "5", True, None])),
        (("logprobs",), st.just(True)),  # with a valid top_logprobs drawn as the second mutation
    ],
    COMPLETIONS: [
        (("logprobs",), st.integers(0, 5) | one_of_values([-1, 6, 21, 2**70, True, "1", 1.5, None])),
    ],
}

# ----------------------------------------------------------------------------------- forced tokens

SPECIAL_IDS = range(
    VOCAB - 1, VOCAB + 8
)  # <|endoftext|> <|im_start|> <|im_end|> <think> </think> <tool_call> ...
FORCING = st.dictionaries(
    st.sampled_from(SPECIAL_IDS).map(str) | st.integers(0, VOCAB - 2).map(str),
    st.sampled_from([100, 100, 50, 10, -100]),
    min_size=1,
    max_size=5,
)


@st.composite
def forced_tokens(draw: st.DrawFn) -> HostileRequest:
    """Valid OpenAI requests whose logit_bias makes the model write special tokens (think and tool-call
    tags, turn markers) in any order: the output parser and logprobs see what no model writes on purpose."""
    path = draw(st.sampled_from([CHAT, COMPLETIONS]))
    body = draw(BODIES[path])
    body["logit_bias"] = draw(FORCING)
    body.pop("max_completion_tokens", None)
    body["max_tokens"] = draw(st.integers(1, 16))
    body["temperature"] = draw(st.sampled_from([0.0, 1.0, 2.0]))
    if path == CHAT:
        if draw(st.booleans()):
            body["logprobs"], body["top_logprobs"] = True, draw(st.integers(0, 20))
        if draw(st.booleans()):
            body["tools"] = [draw(CHAT_TOOL)]
            body.pop("tool_choice", None)
    elif draw(st.booleans()):
        body["logprobs"] = draw(st.integers(0, 20))
    return post("forced_tokens", path, body)
