"""Hostile traffic at a running `freetoken serve`: N requests drawn from the fuzz strategies, one at a time.

    freetoken serve demo --port 8000 --api-key k &
    python benchmarks/serve_fuzz.py --url http://127.0.0.1:8000 --api-key k --pid $! [-n 3000] [--json]

The requests are the ones tests/serve/test_fuzz.py sends (tests/serve/hostile/: valid bodies, wrong
types, out-of-range and non-finite numbers, lone surrogates, deep nesting, malformed JSON, unknown
fields and blocks, wrong content types, methods and paths; some streamed), each sent as soon as it is
drawn. Reported: requests per class and per status, the 5xx (and other protocol failures: a 4xx outside
the error schema, a stream cut short), the server's RSS (VmRSS of --pid) at the start, its peak over
samples every 250 requests, and at the end, and whether a plain chat request still answers afterwards.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from hypothesis import HealthCheck, Phase, given, seed, settings
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "serve"))
from hostile import MINIMAL, Answer, HostileRequest, hostile_requests, post, send, verdict

SAMPLE_EVERY = 250


def rss_mb(pid: int | None) -> float | None:
    """Resident set size of `pid` in MB (VmRSS of /proc/PID/status), None without a pid or a process."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def fire(
    host: str, port: int, api_key: str | None, n: int, seed_value: int | None, pid: int | None
) -> dict[str, Any]:
    per_class: dict[str, Counter[str]] = {}
    statuses: Counter[str] = Counter()
    failures: dict[str, dict[str, Any]] = {}  # first line of a distinct failure -> its first example
    rss = [rss_mb(pid)]
    sent = 0

    def record(request: HostileRequest, problem: str, status: str) -> None:
        key = problem.split(":")[0] + ": " + problem.partition(": ")[2][:120]
        entry = failures.setdefault(key, {"count": 0, "problem": problem[:500], "example": repr(request)})
        entry["count"] += 1
        per_class[request.kind]["failures"] += 1

    @settings(
        max_examples=n,
        derandomize=seed_value is None,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(hostile_requests())
    def one(request: HostileRequest) -> None:
        nonlocal sent
        tally = per_class.setdefault(request.kind, Counter())
        tally["sent"] += 1
        try:
            answer = send(request, host, port, api_key)
        except Exception as exc:  # a dropped connection or a timeout is a finding, not a stop
            status = f"{type(exc).__name__}"
            statuses[status] += 1
            record(request, f"{status}: {exc}", status)
        else:
            status = str(answer.status)
            statuses[status] += 1
            tally[f"{status[0]}xx"] += 1
            problem = verdict(request, answer)
            if problem is not None:
                record(request, problem, status)
        sent += 1
        if sent % SAMPLE_EVERY == 0:
            rss.append(rss_mb(pid))

    if seed_value is not None:
        one = seed(seed_value)(one)
    t0 = time.perf_counter()
    one()
    wall_s = time.perf_counter() - t0
    rss.append(rss_mb(pid))
    after = plain_request_ok(host, port, api_key)
    known = [r for r in rss if r is not None]
    return {
        "sent": sent,
        "wall_s": wall_s,
        "per_s": sent / wall_s if wall_s else 0.0,
        "per_class": {k: dict(v) for k, v in sorted(per_class.items())},
        "statuses": dict(sorted(statuses.items())),
        "server_errors": sum(v for k, v in statuses.items() if k.startswith("5")),
        "no_answer": sum(v for k, v in statuses.items() if not k.isdigit()),
        "failures": sorted(failures.values(), key=lambda f: -f["count"]),
        "rss_mb": {
            "start": known[0] if known else None,
            "peak": max(known) if known else None,
            "end": known[-1] if known else None,
            "samples": rss,
        },
        "plain_request_ok": after,
    }


def plain_request_ok(host: str, port: int, api_key: str | None) -> bool:
    """Whether a plain chat request answers 200 with a completion, and /health answers ok."""
    try:
        answer: Answer = send(
            post("after", "/v1/chat/completions", MINIMAL["/v1/chat/completions"]), host, port, api_key
        )
        health = send(HostileRequest("after", "GET", "/health"), host, port, api_key)
        doc = json.loads(answer.body)
        return (
            answer.status == 200
            and doc["object"] == "chat.completion"
            and json.loads(health.body)["status"] == "ok"
        )
    except Exception:
        return False


def mb(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", help="sent as Authorization: Bearer on every request")
    ap.add_argument("-n", "--requests", type=int, default=3000)
    ap.add_argument("--seed", type=int, help="draw with this seed (default: the fixed derandomized sequence)")
    ap.add_argument("--pid", type=int, help="the server's process id, to sample its RSS")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    url = urlsplit(args.url)
    doc = fire(url.hostname or "127.0.0.1", url.port or 80, args.api_key, args.requests, args.seed, args.pid)
    doc = {"url": args.url, **doc}
    if args.json:
        print(json.dumps(doc, indent=2))
        return
    console = Console()
    classes = Table(title=f"serve fuzz: {doc['sent']} requests at {args.url}")
    for col in ("class", "sent", "2xx", "4xx", "5xx", "failures"):
        classes.add_column(col, justify="right")
    for name, tally in doc["per_class"].items():
        classes.add_row(name, *(str(tally.get(k, 0)) for k in ("sent", "2xx", "4xx", "5xx", "failures")))
    console.print(classes)
    codes = Table(title="answers")
    codes.add_column("status", justify="right")
    codes.add_column("count", justify="right")
    for status, count in doc["statuses"].items():
        codes.add_row(status, str(count))
    console.print(codes)
    rss = doc["rss_mb"]
    summary = Table(title="summary")
    summary.add_column("what")
    summary.add_column("value", justify="right")
    for what, value in (
        ("5xx", str(doc["server_errors"])),
        ("no answer (dropped, timed out)", str(doc["no_answer"])),
        ("distinct failures", str(len(doc["failures"]))),
        ("RSS start / peak / end MB", f"{mb(rss['start'])} / {mb(rss['peak'])} / {mb(rss['end'])}"),
        ("plain request answers afterwards", "yes" if doc["plain_request_ok"] else "NO"),
        ("wall s", f"{doc['wall_s']:.1f}"),
        ("requests/s", f"{doc['per_s']:.1f}"),
    ):
        summary.add_row(what, value)
    console.print(summary)
    for failure in doc["failures"]:
        text = f"{failure['count']}x {failure['problem']}\n    {failure['example']}"
        console.print(text, markup=False, highlight=False)


if __name__ == "__main__":
    main()
