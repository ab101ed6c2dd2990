"""`freetoken bench bw`: measure B_P and B_H on this machine and cache the profile.

Exit codes: 0 measured (or a fresh profile kept, with --max-age); 1 an error; 3 with --validate, the
backend the layer-step measurements picked was not the fastest in the real decode (the saved profile
then recommends the fastest).
"""

from __future__ import annotations

import re
from typing import Annotated

import typer

from freetoken.cli.errors import reports_errors
from freetoken.cli.options import JsonOpt
from freetoken.runtime.config import MAX_CPU_THREADS, flag_error

bench_app = typer.Typer(help="Measure this machine.", no_args_is_help=True)
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_age(text: str) -> float:
    """'90', '30m', '12h', '7d' -> seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if not match:
        raise flag_error("--max-age", f"expected a number with an optional unit s, m, h or d, got {text!r}")
    return float(match.group(1)) * _UNITS[match.group(2) or "s"]


@bench_app.command("bw")
@reports_errors
def bw(
    model: Annotated[
        str | None, typer.Option("--model", help="Take expert shapes from this model folder or config.json.")
    ] = None,
    preset: Annotated[
        str,
        typer.Option(
            "--preset",
            help="Expert shapes of a known model: qwen3-30b-a3b, qwen3-235b-a22b, qwen3.6-35b-a3b, demo.",
        ),
    ] = "qwen3-30b-a3b",
    threads: Annotated[
        int | None,
        typer.Option(
            "--threads",
            min=1,
            max=MAX_CPU_THREADS,
            help="CPU kernel threads (default: all cores, less 1 beside a GPU).",
        ),
    ] = None,
    reps: Annotated[
        int, typer.Option("--reps", min=1, help="Repetitions per measurement (best is kept).")
    ] = 5,
    max_age: Annotated[
        str | None,
        typer.Option("--max-age", help="Skip when this machine's profile is younger (e.g. 7d): for cron."),
    ] = None,
    validate: Annotated[
        bool,
        typer.Option(
            "--validate",
            help="Decode for real with offload, cpu and hybrid; the fastest becomes the recommendation.",
        ),
    ] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing but errors.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Measure B_P (expert fills), B_H (the CPU expert kernel) and both at once; recommend a backend."""
    from freetoken.cli.bench_report import run_bench

    code = run_bench(
        model=model,
        preset=preset,
        threads=threads,
        reps=reps,
        max_age_s=parse_age(max_age) if max_age else None,
        validate=validate,
        quiet=quiet,
        as_json=as_json,
    )
    if code:
        raise typer.Exit(code)
