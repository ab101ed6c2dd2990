"""Synthetic agent sessions, and the requests three agent harnesses would send for them.

A session is a list of `Turn`s: what the agent did in each turn (an optional new user message, its
thinking, one tool call and that call's result). The agent's replies are fixed rather than generated,
so a session is the same every time and only the harness's context edits differ between replays.

`requests_for(session, edit)` turns a session into the chat `messages` a harness sends at each turn.
The edit patterns, applied to the history (the turns before the current one):

- `none`: append-only; every request extends the previous one.
- `openclaw`: reasoning is stripped (`reasoning_content` set to "") from every assistant turn but the
  latest one, so the previous latest turn loses its reasoning when a new turn arrives.
- `opencode`: tool outputs of turns older than the last `window` turns are replaced by `placeholder`.
- `swe-agent`: only the last `window` observations (tool outputs) are kept; each older one is replaced
  by a one-line note, ``Old environment output: (N lines omitted)`` with N the line count of the
  output it replaces (SWE-agent's `last_n_observations`). The tool message itself stays, so tool calls
  keep their results and every request has the same message layout as under `none`.

With one tool call per turn, `opencode`'s window of turns and `swe-agent`'s window of observations pick
the same outputs; the two differ in what takes an output's place. The harness logic knows nothing of
any chat template (a template may itself drop reasoning of turns before the last user message).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from freetoken.errors import FreeTokenError

EDITS = ("none", "openclaw", "opencode", "swe-agent")
DEFAULT_SYSTEM = (
    "You are a coding agent working in a Python repository. Think, then call exactly one tool per turn; "
    "read the tool's result before you decide what to do next."
)

_WORDS = (
    *("the", "function", "returns", "a", "list", "of", "items", "from", "file", "and", "test", "checks"),
    *("each", "value", "before", "it", "writes", "result", "to", "cache", "so", "next", "call", "can"),
    *("read", "without", "parsing", "whole", "module", "again"),
)
_NAMES = ("parser", "engine", "cache", "config", "loader", "router", "tokens", "batch", "stats", "store")
_TASKS = (
    "Fix the failing test in the {0} module and keep the public API unchanged.",
    "The {0} step is slow on large inputs; find out why and make it faster.",
    "Add a check to {0} so a missing file gives a clear error message.",
)
_FOLLOW_UPS = (
    "Also make sure the {0} tests still pass after your change.",
    "Good. Now write a short note in the docs about the {0} change.",
)


@dataclass(frozen=True)
class Turn:
    """What the agent did in one turn; its reply (reasoning plus the tool call) is fixed, not generated."""

    user: str | None  # a new user message this turn (always on the first turn, sometimes later), else None
    reasoning: str  # the assistant's thinking text
    tool_name: str
    tool_args: dict[str, Any]
    tool_output: str  # the tool's result, several lines


def tool_schemas() -> list[dict[str, Any]]:
    """OpenAI-style `tools` for the calls synthetic sessions make."""

    def fn(name: str, description: str, **params: str) -> dict[str, Any]:
        props = {key: {"type": kind} for key, kind in params.items()}
        schema = {"type": "object", "properties": props, "required": list(params)}
        spec = {"name": name, "description": description, "parameters": schema}
        return {"type": "function", "function": spec}

    return [
        fn("read_file", "Read a file of the repository", path="string"),
        fn("grep", "Search the repository for a pattern", pattern="string", path="string"),
        fn("run_tests", "Run the test suite, or one test file", path="string"),
        fn("edit_file", "Replace text in a file", path="string", old="string", new="string"),
    ]


def _sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def _tool_call(rng: random.Random, name: str) -> tuple[str, dict[str, Any]]:
    path = f"src/pkg/{name}.py"
    kind = rng.choice(("read_file", "grep", "run_tests", "edit_file"))
    if kind == "grep":
        return kind, {"pattern": f"def {name}_", "path": "src/pkg"}
    if kind == "run_tests":
        return kind, {"path": f"tests/test_{name}.py"}
    if kind == "edit_file":
        return kind, {"path": path, "old": f"return {name}", "new": f"return list({name})"}
    return kind, {"path": path}


def synthetic_session(turns: int = 8, seed: int = 0, output_tokens: int = 60) -> list[Turn]:
    """A reproducible agent session of `turns` turns (the same text for the same arguments).

    The first turn carries the task; about one later turn in four brings a follow-up user message.
    Each tool output is lines of about eight words, `output_tokens` words in all (a word is roughly
    one token for a real tokenizer; small vocabularies split words further).
    """
    if turns < 1 or output_tokens < 1:
        raise FreeTokenError(
            f"a session needs turns >= 1 and output_tokens >= 1, not {turns}, {output_tokens}"
        )
    rng = random.Random(seed)
    name = rng.choice(_NAMES)
    session = []
    for t in range(turns):
        user = None
        if t == 0:
            user = rng.choice(_TASKS).format(name)
        elif rng.random() < 0.25:
            user = rng.choice(_FOLLOW_UPS).format(name)
        tool_name, tool_args = _tool_call(rng, name)
        reasoning = f"Step {t + 1}: {tool_name}, as {_sentence(rng, 8)}."
        lines, left = [], output_tokens
        while left > 0:
            n = min(8, left)
            lines.append(f"{len(lines) + 1}: {_sentence(rng, n)}")
            left -= n
        session.append(Turn(user, reasoning, tool_name, tool_args, "\n".join(lines)))
    return session


def omitted_note(output: str) -> str:
    """What `swe-agent` puts in place of an old observation."""
    return f"Old environment output: ({len(output.splitlines())} lines omitted)"


def requests_for(
    session: list[Turn],
    edit: str,
    window: int = 3,
    placeholder: str = "[output omitted]",
    system: str = DEFAULT_SYSTEM,
) -> list[list[dict[str, Any]]]:
    """The `messages` the harness `edit` sends at each turn t (one list per turn).

    Request t is: the system message; for every earlier turn i < t its user message (if any), the
    assistant message {content "", reasoning_content, tool_calls [one call]} and the tool message
    {tool_call_id, content}; then turn t's own user message, if any. It asks for turn t's reply.
    `window` (for `opencode` and `swe-agent`) is the number of most recent turns whose outputs stay.
    """
    if edit not in EDITS:
        raise FreeTokenError(f"unknown harness edit {edit!r}; expected one of {', '.join(EDITS)}")
    if window < 0:
        raise FreeTokenError(f"window must be >= 0, got {window}")
    requests = []
    for t in range(len(session)):
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
        for i, turn in enumerate(session[:t]):
            if turn.user is not None:
                messages.append({"role": "user", "content": turn.user})
            reasoning, output = turn.reasoning, turn.tool_output
            old = i < t - window  # outside the last `window` turns of the history
            if edit == "openclaw" and i < t - 1:
                reasoning = ""
            elif edit == "opencode" and old:
                output = placeholder
            elif edit == "swe-agent" and old:
                output = omitted_note(output)
            call_id = f"call_{i}"
            call = {"name": turn.tool_name, "arguments": json.dumps(turn.tool_args)}
            messages.append(
                {
                    "role": "assistant",
                    "content": "",
                    "reasoning_content": reasoning,
                    "tool_calls": [{"id": call_id, "type": "function", "function": call}],
                }
            )
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        if session[t].user is not None:
            messages.append({"role": "user", "content": session[t].user})
        requests.append(messages)
    return requests
