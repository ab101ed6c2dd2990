"""The one place that turns errors into a one-line `error: ...` message and an exit code: FreeToken
errors raised by commands (`reports_errors`), and wrong flag values caught while parsing (`CliGroup`).
Warnings (an ignored bandwidth profile, say) are one `warning: ...` line too."""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import typer
from typer.core import TyperGroup

from freetoken.errors import FreeTokenError

F = TypeVar("F", bound=Callable[..., Any])


def error_exit(message: str, code: int) -> typer.Exit:
    """Print `error: message` on stderr; the Exit to raise with `code`."""
    print(f"error: {' '.join(message.split())}", file=sys.stderr)
    return typer.Exit(code)


def reports_errors(fn: F) -> F:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except FreeTokenError as exc:
            raise error_exit(str(exc), exc.exit_code) from None
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            raise typer.Exit(130) from None

    return wrapper  # type: ignore[return-value]


def flag_of(exc: typer.BadParameter) -> str | None:
    """The flag a parse error is about: its long name (`--top-k` rather than `-k`)."""
    names = list(getattr(exc.param, "opts", None) or ())
    return next((n for n in names if n.startswith("--")), names[0] if names else None)


def warning_line(message: Warning | str, *args: Any, **kwargs: Any) -> None:
    """`warnings.showwarning` for the CLI: the message alone, without the source line it came from."""
    print(f"warning: {' '.join(str(message).split())}", file=sys.stderr)


class CliGroup(TyperGroup):
    """The app's group. A flag with a wrong type or value (found by the parser, or by an option's
    callback raising a FreeTokenError) is one line, `error: --flag: problem`, exit code 2, like every
    other error, instead of the parser's multi-line usage box."""

    def invoke(self, ctx: typer.Context) -> Any:
        with warnings.catch_warnings():
            warnings.showwarning = warning_line
            return self._invoke(ctx)

    def _invoke(self, ctx: typer.Context) -> Any:
        try:
            return super().invoke(ctx)
        except typer.BadParameter as exc:
            flag = flag_of(exc)
            raise error_exit(f"{flag}: {exc.message}" if flag else exc.format_message(), 2) from None
        except FreeTokenError as exc:
            raise error_exit(str(exc), exc.exit_code) from None
