"""OpenAI request bodies read into what the engine takes: sampling parameters, chat messages, tools.

Every check names the field it refuses (400); see fields.py for which fields exist at all.
"""

from __future__ import annotations

from typing import Any

from freetoken.runtime.sampling import SEED_RANGE, SamplingParams
from freetoken.serve.errors import bad, get, in_range, join_text_blocks
from freetoken.serve.state import ServeState

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOPS = 4
MAX_TOP_LOGPROBS = 20


def sampling(
    body: dict[str, Any], state: ServeState, default_max: int, logprobs: int | None
) -> SamplingParams:
    """`logprobs`: the alternatives per token the endpoint asked for (None: no logprobs)."""
    stop = get(body, "stop", (str, list), default=[])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stop) or len(stop) > MAX_STOPS:
        raise bad("stop", f"expected a string or an array of at most {MAX_STOPS} strings")
    if get(body, "n", int, default=1) != 1:
        raise bad("n", "only n = 1 is supported")
    limit = None
    for name in ("max_completion_tokens", "max_tokens"):
        value = get(body, name, int, default=None)
        if value is not None and value < 1:
            raise bad(name, f"{value} must be >= 1")
        limit = limit or value
    seed = get(body, "seed", int, default=None)
    in_range("seed", seed, *SEED_RANGE)
    return SamplingParams(
        temperature=in_range("temperature", get(body, "temperature", float, default=1.0), 0.0, 2.0) or 0.0,
        top_p=in_range("top_p", get(body, "top_p", float, default=1.0), 1e-9, 1.0) or 1.0,
        top_k=int(in_range("top_k", get(body, "top_k", int, default=0), 0, 1 << 30) or 0),
        seed=seed,
        max_tokens=min(limit or default_max, state.engine_context()),
        stop=tuple(stop),
        ignore_eos=get(body, "ignore_eos", bool, default=False),  # an extension, as in vLLM
        frequency_penalty=_penalty(body, "frequency_penalty"),
        presence_penalty=_penalty(body, "presence_penalty"),
        logit_bias=logit_bias(body, state),
        logprobs=logprobs,
    )


def _penalty(body: dict[str, Any], name: str) -> float:
    return in_range(name, get(body, name, float, default=0.0), -2.0, 2.0) or 0.0


def logit_bias(body: dict[str, Any], state: ServeState) -> tuple[tuple[int, float], ...]:
    bias = get(body, "logit_bias", dict, default={})
    out = []
    for key in bias:
        name = f"logit_bias.{key}"
        if not (key.isascii() and key.isdigit() and len(key) < 12) or int(key) >= state.vocab_size():
            raise bad(name, f"not a token id of this model (0 .. {state.vocab_size() - 1})")
        value = in_range(name, get(bias, key, float, where="logit_bias."), -100.0, 100.0)
        out.append((int(key), float(value or 0.0)))
    return tuple(out)


def chat_logprobs(body: dict[str, Any]) -> int | None:
    top = get(body, "top_logprobs", int, default=None)
    in_range("top_logprobs", top, 0, MAX_TOP_LOGPROBS)
    if not get(body, "logprobs", bool, default=False):
        if top:
            raise bad("top_logprobs", "needs logprobs: true")
        return None
    return top or 0


def completion_logprobs(body: dict[str, Any]) -> int | None:
    top = get(body, "logprobs", int, default=None)
    return None if top is None else int(in_range("logprobs", top, 0, MAX_TOP_LOGPROBS))  # type: ignore[arg-type]


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = get(body, "messages", list)
    if not messages:
        raise bad("messages", "at least one message is required")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]."
        if not isinstance(message, dict):
            raise bad(f"messages[{i}]", "expected an object")
        role = get(message, "role", str, where=where)
        if role not in ROLES:
            raise bad(f"{where}role", f"{role!r} is not one of {', '.join(ROLES)}")
        content = get(message, "content", (str, list), default="", where=where)
        if isinstance(content, list):
            content = join_text_blocks(content, f"{where}content", "only text parts are supported")
        item: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
        calls = get(message, "tool_calls", list, default=None, where=where)
        if calls:
            item["tool_calls"] = [_tool_call(call, f"{where}tool_calls[{j}]") for j, call in enumerate(calls)]
        reasoning = get(message, "reasoning_content", str, default=None, where=where)
        if reasoning is not None:
            item["reasoning_content"] = reasoning
        call_id = get(message, "tool_call_id", str, default=None, where=where)
        if call_id is not None:
            item["tool_call_id"] = call_id
        out.append(item)
    return out


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise bad(where, "expected {id, type: function, function: {name, arguments}}")
    fn = call["function"]
    name = get(fn, "name", str, where=f"{where}.function.")
    arguments = get(fn, "arguments", (str, dict), default="{}", where=f"{where}.function.")
    call_id = get(call, "id", str, default=None, where=f"{where}.")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def chat_tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = get(body, "tools", list, default=None)
    choice = get(body, "tool_choice", (str, dict), default="auto")
    if isinstance(choice, str) and choice not in ("none", "auto", "required"):
        raise bad("tool_choice", f"{choice!r} is not none, auto, required or {{type: function, ...}}")
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
            raise bad(f"tools[{i}]", "expected {type: function, function: {name, parameters}}")
        if tool.get("type", "function") != "function":
            raise bad(f"tools[{i}].type", "only function tools are supported")
        fn = tool["function"]
        get(fn, "name", str, where=f"tools[{i}].function.")
        get(fn, "description", str, default="", where=f"tools[{i}].function.")
        parameters = get(fn, "parameters", dict, default=None, where=f"tools[{i}].function.")
        check_schema(parameters, f"tools[{i}].function.parameters")
    if choice == "none" or not tools:
        return None
    return tools


def check_schema(schema: dict[str, Any] | None, where: str) -> None:
    """A tool's parameters: a JSON-schema object (type object when given, properties an object)."""
    if schema is None:
        return
    if schema.get("type", "object") != "object":
        raise bad(f"{where}.type", f"expected 'object', got {schema.get('type')!r}")
    if not isinstance(schema.get("properties", {}), dict):
        raise bad(f"{where}.properties", "expected an object")
    if not isinstance(schema.get("required", []), list):
        raise bad(f"{where}.required", "expected an array")


def token_ids(prompt: list[Any], vocab_size: int) -> list[int]:
    """A prompt given as token ids: integers in the vocabulary."""
    for i, token in enumerate(prompt):
        if not isinstance(token, int) or isinstance(token, bool):
            raise bad(f"prompt[{i}]", "expected a string or an array of token ids")
        if not 0 <= token < vocab_size:
            raise bad(f"prompt[{i}]", f"token id {token} is outside the vocabulary (0 .. {vocab_size - 1})")
    return list(prompt)
