"""`freetoken` (alias `ft`): the Typer app. Commands are registered here and import torch only when run."""

from __future__ import annotations

from typing import Annotated

import typer

from freetoken import __version__
from freetoken.cli.bench import bench_app
from freetoken.cli.convert import convert
from freetoken.cli.errors import CliGroup, reports_errors
from freetoken.cli.help_topics import help_topic
from freetoken.cli.models import ls, models_app
from freetoken.cli.replay import replay_app
from freetoken.cli.run import run
from freetoken.cli.serve import serve
from freetoken.cli.verbosity import configure

app = typer.Typer(
    name="freetoken",
    help="Run large Mixture-of-Experts models on one small GPU: experts live in host RAM, "
    "the GPU caches the ones the router asks for.",
    cls=CliGroup,
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.command("run")(run)
app.command("convert")(convert)
app.command("serve")(serve)
app.add_typer(bench_app, name="bench")
app.add_typer(replay_app, name="replay")
app.add_typer(models_app, name="models")
app.command("ls")(ls)
app.command("help")(reports_errors(help_topic))


def _version(value: bool) -> None:
    if value:
        print(f"freetoken {__version__}")
        raise typer.Exit()


EPILOG = (
    "Exit codes: 0 done; 1 an error (bad input, a model that cannot be found or loaded, a failed "
    "request); 2 a wrong flag or value, found before any work; 130 interrupted (Ctrl-C). Errors are one "
    "line on stderr, `error: ...`. NO_COLOR turns colours off."
)


@app.callback(epilog=EPILOG)
def root(
    version: Annotated[
        bool,
        typer.Option("--version", "-V", callback=_version, is_eager=True, help="Print the version and exit."),
    ] = False,
    verbose: Annotated[
        int,
        typer.Option("--verbose", "-v", count=True, help="Say more: -v what the engine decides, -vv debug."),
    ] = 0,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="Print only answers and errors: no warnings or progress.")
    ] = False,
) -> None:
    """FreeToken command line."""
    configure(verbose, quiet)


def main() -> None:
    app()
