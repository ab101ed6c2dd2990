"""`freetoken replay`: routing traces against placement policies, agent sessions against the engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from freetoken.cli.errors import reports_errors

replay_app = typer.Typer(
    help="Replay routing traces against cache policies, or agent sessions against the engine."
)
DEFAULT_POLICIES = "lru,lru-per-layer,static,prefill-pinned,lfu,lookahead,belady"


@replay_app.command("routing")
@reports_errors
def routing(
    traces: Annotated[list[Path], typer.Argument(help="Trace files written by --record-routing.")],
    policy: Annotated[
        str, typer.Option("--policy", help=f"Comma-separated policies: {DEFAULT_POLICIES}.")
    ] = DEFAULT_POLICIES,
    capacity: Annotated[
        str,
        typer.Option(
            "--capacity",
            help="Cache sizes: fractions of the pool '0.11,0.37', slot counts '64,128', or ranges "
            "'0.1:0.9:0.1'.",
        ),
    ] = "0.1:0.9:0.1",
    warm: Annotated[
        bool,
        typer.Option("--warm", help="Start from the runtime's warm cache (an equal share of each layer)."),
    ] = False,
    plot_path: Annotated[
        Path | None, typer.Option("--plot", help="Draw decode miss rate vs capacity per policy (PNG).")
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object instead of a table.")
    ] = False,
) -> None:
    """Miss rates of expert placement policies on identical routing traces at equal capacity."""
    from freetoken.replay.report import parse_capacities, plot, print_table, run_matrix
    from freetoken.replay.trace import load_trace

    loaded = [(str(path), load_trace(path)) for path in traces]
    first = loaded[0][1]
    capacities = parse_capacities(capacity, first.num_layers * first.num_experts)
    policies = [p.strip() for p in policy.split(",") if p.strip()]
    rows = run_matrix(loaded, policies, capacities, warm)
    title = (
        f"{first.meta.get('model', '?')}: {sum(len(t) for _, t in loaded)} token rows, "
        f"{first.num_layers} MoE layers × {first.num_experts} experts, top-{first.top_k}"
    )
    if plot_path is not None:
        plot(rows, plot_path, title)
    if as_json:
        print(json.dumps({"traces": [n for n, _ in loaded], "meta": first.meta, "rows": rows}, indent=2))
        return
    print_table(rows, title)
    if plot_path is not None:
        typer.echo(f"plot written to {plot_path}", err=True)
