"""`freetoken` (alias `ft`): the Typer app. Commands are registered here and import torch only when run."""

from __future__ import annotations

from typing import Annotated

import typer

from freetoken import __version__
from freetoken.cli.bench import bench_app
from freetoken.cli.convert import convert
from freetoken.cli.errors import CliGroup
from freetoken.cli.replay import replay_app
from freetoken.cli.run import run
from freetoken.cli.serve import serve

app = typer.Typer(
    name="freetoken",
    help="Run large Mixture-of-Experts models on one small GPU: experts live in host RAM, "
    "the GPU caches the ones the router asks for.",
    cls=CliGroup,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.command("run")(run)
app.command("convert")(convert)
app.command("serve")(serve)
app.add_typer(bench_app, name="bench")
app.add_typer(replay_app, name="replay")


def _version(value: bool) -> None:
    if value:
        print(f"freetoken {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        bool,
        typer.Option("--version", "-V", callback=_version, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    """FreeToken command line."""


def main() -> None:
    app()
