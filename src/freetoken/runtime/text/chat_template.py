"""Render a model's Jinja chat template exactly as Hugging Face tokenizers do.

Chat templates ship with model repositories and are untrusted code, so they run in Jinja's immutable
sandbox with only a few helpers exposed. The output must match the reference renderer byte for byte:
the prompt a model sees at inference time has to be the prompt it was trained on.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from freetoken.errors import FreeTokenError

# The first name is the one templates read; the others are older spellings some clients still send.
REASONING_FIELDS: tuple[str, ...] = ("reasoning_content", "thinking", "reasoning")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; a no-op here."""

    tags = frozenset({"generation"})

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes `<`, `>` and `&`, which would corrupt tool schemas in prompts.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _SafeDict:
    """What templates get as `dict`: construction only, no access to the real type object."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _check_namespace_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with an underscore")


class _SafeNamespace(Namespace):
    """`namespace()` that refuses underscore names, so templates cannot reach interpreter internals."""

    # Jinja's Namespace takes `self` positionally so that `namespace(self=...)` works; keep that contract.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        Namespace.__setitem__(self, name, value)


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _SafeDict()
    env.globals["namespace"] = _SafeNamespace
    return env


_ENV = _make_environment()


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


@lru_cache(maxsize=32)
def compile_chat_template(template: str) -> jinja2.Template:
    """Compile once per distinct template string; a syntax error becomes a FreeTokenError with its line."""
    try:
        return _ENV.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        message = _one_line(exc.message or "")
        raise FreeTokenError(f"chat template syntax error at line {exc.lineno}: {message}") from exc


def _plain(value: Any) -> Any:
    """Rebuild `value` from plain JSON-like types so the sandbox never sees caller objects' methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    # Templates only test such values for presence, so an inert placeholder renders the same.
    return f"<{type(value).__name__}>"


def _with_reasoning_aliases(message: dict) -> dict:
    reasoning = None
    for field in REASONING_FIELDS:
        if message.get(field) is not None:
            reasoning = message[field]
            break
    if reasoning is None:
        return message
    # Key order matters to templates that iterate a message: `thinking` leads unless the message already
    # has it, and `reasoning_content` keeps its position or goes last.
    aliased: dict = {"thinking": reasoning}
    aliased.update(message)
    aliased["reasoning_content"] = reasoning
    return aliased


def normalize_messages(messages: list[dict]) -> list[dict]:
    """Drop None-valued keys (APIs send `content: null`), detach from caller objects, alias reasoning."""
    if not isinstance(messages, list | tuple):
        raise FreeTokenError(f"chat messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise FreeTokenError("chat messages are empty: need at least one message to render a prompt")
    normalized = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise FreeTokenError(f"chat message {index} must be a dict, got {type(message).__name__}")
        kept = {key: value for key, value in message.items() if value is not None}
        normalized.append(_with_reasoning_aliases(_plain(kept)))
    return normalized


def render_chat_template(
    template: str,
    messages: list[dict],
    tools: list[dict] | None = None,
    add_generation_prompt: bool = False,
    **kwargs: Any,
) -> str:
    """Render `messages` (and optional JSON-schema `tools`) through `template`.

    Extra keyword arguments become template variables (special tokens such as `eos_token`, switches such
    as `enable_thinking`). Any failure inside the template, including its own `raise_exception(...)`,
    surfaces as a FreeTokenError carrying the template's message.
    """
    compiled = compile_chat_template(template)
    if tools is not None:
        for index, tool in enumerate(tools):
            if not isinstance(tool, Mapping):
                raise FreeTokenError(f"tool {index} must be a JSON-schema dict, got {type(tool).__name__}")
    documents = kwargs.pop("documents", None)
    variables = _plain(kwargs)
    try:
        return compiled.render(
            messages=normalize_messages(messages),
            tools=_plain(tools),
            documents=_plain(documents),
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except FreeTokenError:
        raise
    except jinja2.TemplateError as exc:
        raise FreeTokenError(f"chat template error: {_one_line(exc.message or type(exc).__name__)}") from exc
    except Exception as exc:  # a template is code: its TypeErrors etc. are input errors, not crashes
        raise FreeTokenError(f"chat template failed: {type(exc).__name__}: {_one_line(str(exc))}") from exc
