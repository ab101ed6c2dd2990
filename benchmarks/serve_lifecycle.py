"""Lifecycle checks of `freetoken serve`: disconnects, oversized bodies, signals, a busy port.

    python benchmarks/serve_lifecycle.py                  # all checks, a table of pass/fail
    python benchmarks/serve_lifecycle.py --only a --only sigterm-drain --json

Each check starts its own `freetoken serve MODEL` child processes (a, b and d share one default
server; it is restarted when a check leaves it busy) and reports rows of measured value, limit and
pass/fail. A check that cannot measure (the server refuses a flag, a request times out) reports
`fail` with what it saw; every wait has a timeout and every child is killed at the end, Ctrl-C too.

  a stream-disconnect     streamed request (max_tokens 900, ignore_eos) cut after a few events:
                          seconds until /v1/stats requests.running == 0 (≤ 1 s), polled every 10 ms
  b nonstream-disconnect  the same with stream: false, cut 0.5 s after sending (≤ 1 s)
  c body-limit            --max-body-mib 1, a 30 MiB body with Content-Length, then chunked: status
                          413, seconds to the status line (≤ 1 s), server RSS growth (≤ 100 MiB)
  d huge-prompt           default limit (32 MiB), a ~30 MiB message: status 400 within 2 s, while a
                          small concurrent request (max_tokens 4) completes within 2 s
  e sigterm-drain         --shutdown-timeout 5, a long stream in flight, SIGTERM after 1 s: exit 0
                          within 7 s, the stream ends with an error event, a new request is refused
  f second-signal         the same, a second SIGTERM 0.5 s after the first: exit within 2 s of it
  g sigint-idle           an idle server exits 0 within 2 s of SIGINT
  h port-in-use           --port of a listening socket: exit 2, quickly (faster than a normal start
                          to /health, i.e. before the model loads), stderr one line `error: …`

Exit status: 0 when every row passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict

from lifecycle_base import Context, Pool, Row
from lifecycle_requests import (
    check_body_limit,
    check_huge_prompt,
    check_nonstream_disconnect,
    check_stream_disconnect,
)
from lifecycle_signals import check_port_in_use, check_second_signal, check_sigint_idle, check_sigterm_drain
from rich.console import Console
from rich.table import Table
from serve_process import exit_on_sigterm, kill_all_servers

CHECKS: list[tuple[str, str, Callable[[Context], list[Row]]]] = [
    ("a", "stream-disconnect", check_stream_disconnect),
    ("b", "nonstream-disconnect", check_nonstream_disconnect),
    ("c", "body-limit", check_body_limit),
    ("d", "huge-prompt", check_huge_prompt),
    ("e", "sigterm-drain", check_sigterm_drain),
    ("f", "second-signal", check_second_signal),
    ("g", "sigint-idle", check_sigint_idle),
    ("h", "port-in-use", check_port_in_use),
]


def selected(only: list[str]) -> list[tuple[str, str, Callable[[Context], list[Row]]]]:
    if not only:
        return CHECKS
    wanted = {w.strip().lower() for value in only for w in value.split(",") if w.strip()}
    known = {letter for letter, _, _ in CHECKS} | {name for _, name, _ in CHECKS}
    unknown = wanted - known
    if unknown:
        names = ", ".join(f"{letter}/{name}" for letter, name, _ in CHECKS)
        raise SystemExit(f"unknown check(s): {', '.join(sorted(unknown))} (known: {names})")
    return [c for c in CHECKS if c[0] in wanted or c[1] in wanted]


def print_table(rows: list[Row], console: Console) -> None:
    table = Table(title="serve lifecycle")
    for col, justify in (("check", "left"), ("metric", "left"), ("value", "right"), ("limit", "right")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    table.add_column("result", justify="center")
    table.add_column("note", overflow="fold", max_width=60)
    for r in rows:
        value = "n/a" if r.value is None else str(r.value)
        result = "[green]pass[/green]" if r.ok else "[red]fail[/red]"
        table.add_row(r.check, r.metric, value, r.limit, result, r.note)
    console.print(table)
    passed = sum(r.ok for r in rows)
    console.print(f"{passed}/{len(rows)} rows pass", highlight=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", default=[], help="a check's letter or name (repeatable)")
    ap.add_argument("--model", default="demo", help="model to serve (default: demo)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    checks = selected(args.only)
    stream = sys.stderr if args.json else sys.stdout
    console = Console(stderr=args.json, width=None if stream.isatty() else 150)
    exit_on_sigterm()
    ctx = Context(args.model, console, quiet=args.json, pool=Pool(args.model))
    rows: list[Row] = []
    interrupted = False
    try:
        for letter, check_name, fn in checks:
            label = f"{letter} {check_name}"
            ctx.log(f"running {label}…")
            t0 = time.monotonic()
            try:
                rows += fn(ctx)
            except KeyboardInterrupt:
                raise
            except Exception as exc:  # a check that cannot measure is a failed check, not a crash
                rows.append(Row(label, "ran", f"{type(exc).__name__}", "no error", False, str(exc)[:300]))
            ctx.log(f"  {label}: {time.monotonic() - t0:.1f} s")
    except KeyboardInterrupt:
        interrupted = True
    finally:
        ctx.pool.close()
        kill_all_servers()
    if args.json:
        doc = {"model": args.model, "interrupted": interrupted, "rows": [asdict(r) for r in rows]}
        doc["passed"] = sum(r.ok for r in rows)
        doc["failed"] = len(rows) - doc["passed"]
        print(json.dumps(doc, indent=2, default=str))
    else:
        print_table(rows, console)
        if interrupted:
            console.print("[yellow]interrupted: partial results[/yellow]")
    return 0 if rows and all(r.ok for r in rows) and not interrupted else 1


if __name__ == "__main__":
    sys.exit(main())
