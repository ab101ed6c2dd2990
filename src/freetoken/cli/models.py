"""`freetoken models` (alias `ls`): list the models FreeToken can run, and `models rm` FreeToken's own."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from freetoken.cli.errors import CliGroup, reports_errors
from freetoken.errors import FreeTokenError

PATHS = "freetoken.models.paths"  # ctx.meta key: the PATHs of `ft models PATH...`

ListJsonOpt = Annotated[bool, typer.Option("--json", help="Print a JSON list instead of a table.")]
PathsArg = Annotated[
    list[str] | None,
    typer.Argument(
        help="List these folders or .gguf files (or the models inside a folder) instead.", show_default=False
    ),
]


class ModelsGroup(CliGroup):
    """`ft models [PATH]...` lists, `ft models rm NAME` removes: the first word that is not an option
    picks a subcommand only when it names one; otherwise every such word is a PATH to list."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        words = [a for a in args if not a.startswith("-")]
        if not words or words[0] in self.commands:
            return super().parse_args(ctx, args)
        options, paths, after_dashes = [], [], False
        for arg in args:
            if after_dashes or not arg.startswith("-"):
                paths.append(arg)
            elif arg == "--":
                after_dashes = True
            else:
                options.append(arg)
        ctx.meta[PATHS] = paths
        return super().parse_args(ctx, options)


models_app = typer.Typer(
    cls=ModelsGroup,
    invoke_without_command=True,
    subcommand_metavar="[PATH]... | rm NAME",
    help="List the models FreeToken can run: the local Hugging Face cache and FreeToken's own models "
    "($FREETOKEN_HOME/models), or the PATHs given; `rm NAME` removes one of FreeToken's own.",
)


def stdin_is_terminal() -> bool:
    return sys.stdin.isatty()


def human_bytes(n: int | None) -> str:
    if n is None:
        return "—"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def print_models(paths: list[str], as_json: bool) -> None:
    from freetoken.runtime.loading.model_catalog import list_models

    try:
        entries = list_models(paths)
    except OSError as exc:  # a folder it may not list; unreadable entries are listed with their reason
        raise FreeTokenError(f"{exc.filename}: cannot read ({exc.strerror or exc})") from None
    if as_json:
        print(json.dumps([e.as_json() for e in entries], indent=2))
        return
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    if not entries:
        from freetoken.env import models_dir
        from freetoken.runtime.loading.model_catalog import hf_cache_dir

        where = ", ".join(paths) if paths else f"{hf_cache_dir()}, {models_dir()}"
        print(f"no models found in {where}", file=sys.stderr)
        return
    table = Table(caption="check: from the config or GGUF header only; `ft run` reads the weights")
    for column in ("name", "format", "architecture", "size", "experts", "expert types", "check"):
        table.add_column(column, justify="right" if column in ("size", "experts") else "left")
    for e in entries:
        runs = Text("header ok", style="green") if e.supported else Text(f"no: {e.reason}", style="red")
        cells = [e.name, e.format or "—", e.architecture or "—"]
        cells += [human_bytes(e.size_bytes), human_bytes(e.expert_bytes), " ".join(e.expert_types) or "—"]
        table.add_row(*(Text(c) for c in cells), runs)
    Console().print(table)


@models_app.callback()
@reports_errors
def models(ctx: typer.Context, as_json: ListJsonOpt = False) -> None:
    """List the models FreeToken can run: the local Hugging Face cache and $FREETOKEN_HOME/models, or
    the PATHs given (`ft models PATH...`); for each, what to pass to `ft run`, its format,
    architecture, size, expert bytes and how they are stored (GGUF types, FTW codecs), and whether
    FreeToken supports it by what its config or GGUF header says (or why not; the weights are read by
    `ft run`)."""
    if ctx.invoked_subcommand is None:
        print_models(ctx.meta.get(PATHS, []), as_json)


@reports_errors
def ls(paths: PathsArg = None, as_json: ListJsonOpt = False) -> None:
    """List the models FreeToken can run (the same as `ft models`)."""
    print_models(paths or [], as_json)


def not_own(name: str, in_hf_cache: bool) -> FreeTokenError:
    from freetoken.env import models_dir
    from freetoken.runtime.loading.model_catalog import own_models
    from freetoken.runtime.loading.model_ref import close_matches

    own = f"{name}: not one of FreeToken's own models (those in {models_dir()})"
    own += "; `ft models rm` removes only those"
    if in_hf_cache:
        return FreeTokenError(f"{own}; this one is in the Hugging Face cache: use `hf cache rm`")
    close = close_matches(name, [n for e in own_models() for n in (e.name, e.path.name)])
    return FreeTokenError(f"{own}; did you mean {', '.join(close)}?" if close else own)


@models_app.command("rm")
@reports_errors
def rm(
    name: Annotated[str, typer.Argument(help="A model listed with source freetoken (`ft models --json`).")],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Remove without asking.")] = False,
) -> None:
    """Remove one of FreeToken's own models (a folder or .gguf file in $FREETOKEN_HOME/models)."""
    from freetoken.runtime.loading.model_catalog import hf_cache_models, remove_own_model
    from freetoken.runtime.loading.model_ref import find_own_model

    entry = find_own_model(name)
    if entry is None:
        raise not_own(name, any(e.name == name for e in hf_cache_models()))
    if not yes:
        if not stdin_is_terminal():
            raise FreeTokenError(f"{name}: not removing {entry.path} without --yes (no terminal to ask on)")
        if not typer.confirm(f"remove {entry.path} ({human_bytes(entry.size_bytes)})?", default=False):
            print("not removed", file=sys.stderr)
            return
    remove_own_model(entry)
    print(f"removed {entry.path}")
