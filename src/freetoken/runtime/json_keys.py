"""Typed reading of JSON files that users bring (config.json, generation_config.json, profiles): every
wrong type or value is one line naming the file and the key, never a traceback later on."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from freetoken.errors import FreeTokenError


def read_json(path: Path) -> dict[str, Any]:
    """Read a JSON object, turning every failure into a one-line error naming the file."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FreeTokenError(f"{path}: file not found") from None
    except UnicodeDecodeError:
        raise FreeTokenError(f"{path}: not UTF-8 text") from None
    except OSError as exc:
        raise FreeTokenError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise FreeTokenError(
            f"{path}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    except RecursionError:
        raise FreeTokenError(f"{path}: invalid JSON: nested too deeply") from None
    if not isinstance(value, dict):
        raise FreeTokenError(f"{path}: expected a JSON object")
    return value


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _ints(v: Any, low: int) -> bool:
    return isinstance(v, list) and all(_is_int(i) and i >= low for i in v)


@dataclass(frozen=True)
class Kind:
    """What a key must hold: a description for the message, a check, and the value handed back."""

    expected: str
    check: Callable[[Any], bool]
    convert: Callable[[Any], Any] = lambda v: v


POSITIVE_INT = Kind("a positive integer", lambda v: _is_int(v) and v > 0)
COUNT = Kind("a non-negative integer", lambda v: _is_int(v) and v >= 0)
NUMBER = Kind("a number", _is_number, float)
POSITIVE = Kind("a positive number", lambda v: _is_number(v) and v > 0, float)
NON_NEGATIVE = Kind("a number >= 0", lambda v: _is_number(v) and v >= 0, float)
FRACTION = Kind("a number in (0, 1]", lambda v: _is_number(v) and 0 < v <= 1, float)
SHARE = Kind("a number in [0, 1]", lambda v: _is_number(v) and 0 <= v <= 1, float)
BOOL = Kind("true or false", lambda v: isinstance(v, bool))
TEXT = Kind("a string", lambda v: isinstance(v, str))
OBJECT = Kind("an object", lambda v: isinstance(v, dict))
INDICES = Kind("a list of non-negative integers", lambda v: _ints(v, 0), tuple)
TEXTS = Kind("a list of strings", lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v), tuple)
TOKEN_IDS = Kind(
    "a token id or a list of token ids",
    lambda v: (_is_int(v) and v >= 0) or _ints(v, 0),
    lambda v: tuple(v) if isinstance(v, list) else (v,),
)
REQUIRED: Any = object()  # default of a key that must be present


def shown(value: Any) -> str:
    """A value as it looks in the file, shortened for a one-line message."""
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(frozen=True)
class JsonObject:
    """A parsed JSON object and where it came from (`source`: the file; `prefix`: the path inside it)."""

    raw: dict[str, Any]
    source: str
    prefix: str = ""

    def error(self, key: str, problem: str) -> FreeTokenError:
        return FreeTokenError(f"{self.source}: {self.prefix}{key}: {problem}")

    def get(self, key: str, kind: Kind, default: Any = REQUIRED) -> Any:
        """The key's value, checked and converted. Absent (or null) gives `default`; without one, an
        absent key is an error, and so is null."""
        value = self.raw.get(key)
        if value is None:
            if default is not REQUIRED:
                return default
            if key not in self.raw:
                raise self.error(key, "missing")
        if not kind.check(value):
            raise self.error(key, f"expected {kind.expected}, got {shown(value)}")
        return kind.convert(value)

    def first(self, keys: tuple[str, ...], kind: Kind, default: Any = REQUIRED) -> Any:
        """The first of several spellings of one key that is set (`num_experts` or `num_local_experts`)."""
        for key in keys:
            if self.raw.get(key) is not None:
                return self.get(key, kind)
        if default is REQUIRED:
            raise self.error(" or ".join(keys), "missing")
        return default

    def choice(self, key: str, choices: tuple[str, ...], default: Any = REQUIRED) -> Any:
        value = self.get(key, TEXT, default)
        if value is not default and value not in choices:
            raise self.error(key, f"expected one of {', '.join(choices)}, got {shown(value)}")
        return value

    def child(self, key: str) -> JsonObject:
        """A nested object (absent or null: empty)."""
        return JsonObject(self.get(key, OBJECT, {}), self.source, f"{self.prefix}{key}.")
