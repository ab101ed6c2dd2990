"""`freetoken replay`: routing traces against placement policies, agent sessions against the engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from freetoken.cli.errors import reports_errors
from freetoken.cli.options import DeviceOpt

replay_app = typer.Typer(
    help="Replay routing traces against cache policies, or agent sessions against the engine."
)
DEFAULT_POLICIES = "lru,lru-prefetch,lru-per-layer,static,prefill-pinned,lfu,lookahead,belady"


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


@replay_app.command("session")
@reports_errors
def session(
    file: Annotated[
        Path | None, typer.Argument(help="A session JSONL (one request per line); or use --generate.")
    ] = None,
    generate: Annotated[
        str | None,
        typer.Option(
            "--generate",
            help="Replay a built-in synthetic agent session edited as a harness does: none, openclaw "
            "(thinking stripped but the latest), opencode (old tool outputs replaced), swe-agent (only the "
            "last observations kept).",
        ),
    ] = None,
    turns: Annotated[int, typer.Option("--turns", min=1, help="Turns of a generated session.")] = 8,
    window: Annotated[int, typer.Option("--window", min=0, help="Recent turns a harness keeps whole.")] = 3,
    output_tokens: Annotated[int, typer.Option("--output-tokens", min=1, help="Words per tool output.")] = 60,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, help="Tokens per generated reply.")] = 16,
    write: Annotated[Path | None, typer.Option("--write", help="Also save the session JSONL here.")] = None,
    url: Annotated[
        str | None, typer.Option("--url", help="A running `freetoken serve` (else the engine runs here).")
    ] = None,
    api_key: Annotated[str | None, typer.Option("--api-key", envvar="FREETOKEN_API_KEY")] = None,
    model: Annotated[str, typer.Option("--model", help="Model for the in-process engine.")] = "demo",
    device: DeviceOpt = "auto",
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object instead of a table.")
    ] = False,
) -> None:
    """Per turn of an agent session: prompt, cached and re-prefilled tokens, TTFT, decode tok/s."""
    from freetoken.errors import FreeTokenError
    from freetoken.replay.harness import EDITS, requests_for, synthetic_session
    from freetoken.replay.session import read_session, replay_against_server, replay_in_process, write_session

    if (file is None) == (generate is None):
        raise FreeTokenError("give a session FILE or --generate EDIT, one of the two")
    if generate is not None:
        if generate not in EDITS:
            raise FreeTokenError(f"--generate {generate!r}: expected one of {', '.join(EDITS)}")
        history = synthetic_session(turns, output_tokens=output_tokens)
        requests = [
            {"messages": m, "max_tokens": max_tokens} for m in requests_for(history, generate, window=window)
        ]
        if write is not None:
            write_session(write, [r["messages"] for r in requests], None, max_tokens)
    else:
        assert file is not None
        requests = read_session(file)
    if url is not None:
        reports = replay_against_server(url, requests, api_key=api_key)
    else:
        from freetoken.cli.session import load_engine
        from freetoken.runtime.config import MoeConfig

        engine = load_engine(model, device, "auto", MoeConfig(), quiet=as_json)
        try:
            reports = replay_in_process(engine, requests)
        finally:
            engine.close()
    rows = [r.__dict__ for r in reports]
    if as_json:
        print(json.dumps({"session": str(file) if file else generate, "turns": rows}, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"session {file or generate}: {len(rows)} turns")
    for col in ("turn", "prompt", "cached", "re-prefilled", "new", "TTFT ms", "decode tok/s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["turn"]),
            str(r["prompt_tokens"]),
            str(r["cached_tokens"]),
            str(r["reprefilled_tokens"]),
            "—" if r["new_tokens"] < 0 else str(r["new_tokens"]),
            f"{r['ttft_s'] * 1000:.1f}",
            f"{r['decode_tok_s']:.1f}",
        )
    Console().print(table)
