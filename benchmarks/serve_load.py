"""Sustained load on `freetoken serve`: C streaming chat clients for D seconds — throughput, latency,
errors, and whether the server's memory stays flat.

    python benchmarks/serve_load.py                                  # serve demo, 16 clients, 180 s
    python benchmarks/serve_load.py --duration 20 --concurrency 4
    python benchmarks/serve_load.py --serve-arg="--max-running-requests 8" --json
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --pid 12345 --api-key KEY

Each client loops: POST /v1/chat/completions with `stream: true`, a short random user message,
max_tokens (64) and temperature 0.7, read to `data: [DONE]`. A request is an error when the status
is not 200, when an `error` event or object appears in the stream, or when the connection breaks or
ends without [DONE]. Requests still in flight at the end of the duration are finished and counted.

Every 5 s the server's RSS (VmRSS of --pid, or of the server started here) is sampled. The sample at
10 s is the baseline (start-up and first-request allocations are over by then); `drift` is the
largest distance of a later sample from it and `range` the spread (max − min) of the later samples,
both in % of the baseline. A server that leaks per request shows a drift that grows with --duration.
The prefix cache (--prefix-cache-tokens, 65536 by default) also grows RSS until it is full, which
is not a leak: its size is sampled beside RSS and shown; --serve-arg="--prefix-cache-tokens 0"
takes it out of the picture.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import random
import shlex
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table
from serve_client import CHAT_PATH, Client, SseStream, chat_body, cut, parse_url
from serve_process import Server, ServerError, exit_on_sigterm, rss_mib

VOCABULARY = (
    "apple river stone cloud garden engine window silver market forest letter mountain candle rocket "
    "thunder meadow harbor lantern puzzle velvet compass orchard tunnel whisper falcon copper island "
    "mirror saddle violin glacier pepper temple ribbon canyon marble beacon"
)
WORDS = VOCABULARY.split()
SAMPLE_EVERY_S = 5.0
BASELINE_AT_S = 10.0


def user_message(rng: random.Random) -> str:
    words = rng.choices(WORDS, k=rng.randint(4, 16))
    return f"Tell me about the {' '.join(words)}."


@dataclass
class Tally:
    """One client's results; merged after the run."""

    ok: int = 0
    chunks: int = 0
    latencies: list[float] = field(default_factory=list)  # seconds, successful requests
    ttfts: list[float] = field(default_factory=list)  # seconds to the first content chunk
    errors: Counter[str] = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)
    in_flight: bool = False

    def error(self, kind: str, detail: str) -> None:
        self.errors[kind] += 1
        if self.errors[kind] == 1:  # the first of each kind
            self.examples.append(f"{kind}: {detail[:200]}")


def _has_content(doc: Any) -> bool:
    if not isinstance(doc, dict):
        return False
    for choice in doc.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
            return True
    return False


class LoadClient:
    """One keep-alive connection, reopened after any failure, issuing streamed chat requests."""

    def __init__(self, index: int, args: argparse.Namespace, target: Client) -> None:
        self.rng = random.Random(args.seed * 1000 + index)
        self.args, self.target = args, target
        self.conn: http.client.HTTPConnection | None = None
        self.tally = Tally()
        self.model = args.served_name

    def run(self, stop_at: float, stop: threading.Event) -> None:
        while not stop.is_set() and time.monotonic() < stop_at:
            self.tally.in_flight = True
            errors = sum(self.tally.errors.values())
            try:
                self.one()
            finally:
                self.tally.in_flight = False
            if sum(self.tally.errors.values()) > errors:
                time.sleep(0.1)  # a refusing server is not hammered in a tight loop

    def one(self) -> None:
        args, tally = self.args, self.tally
        body = chat_body(
            user_message(self.rng), args.max_tokens, True, model=self.model, temperature=args.temperature
        )
        payload = json.dumps(body).encode()
        headers = self.target.headers({"Content-Type": "application/json", "Accept": "text/event-stream"})
        t0 = time.monotonic()
        try:
            if self.conn is None:
                self.conn = self.target.connect(args.request_timeout)
            self.conn.request("POST", CHAT_PATH, body=payload, headers=headers)
            resp = self.conn.getresponse()
            if resp.status != 200:
                detail = resp.read().decode("utf-8", errors="replace")
                tally.error(f"HTTP {resp.status}", detail)
                self._close()
                return
            stream, chunks, first, done = SseStream(self.conn, resp), 0, None, False
            for event in stream.events():
                if event.done:
                    done = True
                    break
                if event.is_error:
                    tally.error("error event", event.data)
                    self._close()
                    return
                if _has_content(event.json()):
                    chunks += 1
                    first = first if first is not None else time.monotonic() - t0
            if not done:
                tally.error("no [DONE]", "the stream ended without data: [DONE]")
                self._close()
                return
            resp.read()  # the rest of the chunked body, so the connection can be reused
            if resp.will_close:
                self._close()
        except (OSError, http.client.HTTPException) as exc:
            tally.error("connection", f"{type(exc).__name__}: {exc}")
            self._close()
            return
        tally.ok += 1
        tally.chunks += chunks
        tally.latencies.append(time.monotonic() - t0)
        if first is not None:
            tally.ttfts.append(first)

    def _close(self) -> None:
        if self.conn is not None:
            cut(self.conn)
            self.conn = None


def percentile(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(p / 100 * len(ordered)) - 1))]


def rss_summary(samples: list[tuple[float, float]]) -> dict[str, Any]:
    """first/min/max/last, and the drift and range after the baseline sample at 10 s."""
    if not samples:
        return {"first_mib": None}
    values = [v for _, v in samples]
    out: dict[str, Any] = {
        "first_mib": values[0],
        "min_mib": min(values),
        "max_mib": max(values),
        "last_mib": values[-1],
        "baseline_at_s": None,
        "baseline_mib": None,
        "drift_pct": None,
        "range_pct": None,
    }
    after = [(t, v) for t, v in samples if t >= BASELINE_AT_S - 0.5]
    if len(after) >= 2:
        (t_base, base), later = after[0], [v for _, v in after]
        out |= {
            "baseline_at_s": round(t_base, 1),
            "baseline_mib": base,
            "drift_pct": 100 * max(abs(v - base) for v in later) / base,
            "range_pct": 100 * (max(later) - min(later)) / base,
        }
    return out


def growth_per_cached_token(rss: dict[str, Any], cached: list[tuple[float, int | None]]) -> float | None:
    """RSS growth after the baseline over the prefix-cache tokens added meanwhile, KiB per token: about
    the KV bytes of one token when the cache explains the growth."""
    base = [v for t, v in cached if t >= BASELINE_AT_S - 0.5 and v is not None]
    if rss.get("baseline_mib") is None or len(base) < 2 or base[-1] <= base[0]:
        return None
    return (rss["last_mib"] - rss["baseline_mib"]) * 1024 / (base[-1] - base[0])


def served_name(client: Client, fallback: str) -> str:
    """The first id of GET /v1/models (what a client would send as `model`), else `fallback`."""
    try:
        status, doc = client.get_json("/v1/models")
        return str(doc["data"][0]["id"]) if status == 200 else fallback
    except (OSError, http.client.HTTPException, LookupError, TypeError):
        return fallback


def prefix_tokens(client: Client) -> int | None:
    """Tokens held by the server's prefix cache (/v1/stats prefix_cache.stored_tokens), if it says."""
    doc = client.stats()
    value = (doc or {}).get("prefix_cache", {}).get("stored_tokens")
    return value if isinstance(value, int) else None


def server_totals(client: Client) -> dict[str, Any] | None:
    doc = client.stats()
    if not doc:
        return None
    requests, tokens = doc.get("requests", {}), doc.get("tokens", {})
    return {k: requests.get(k) for k in ("submitted", "finished", "cancelled", "rejected", "failed")} | {
        "generated_tokens": tokens.get("generated")
    }


def run_load(args: argparse.Namespace, target: Client, pid: int | None, console: Console) -> dict[str, Any]:
    monitor = Client(target.host, target.port, timeout=5.0, api_key=target.api_key, scheme=target.scheme)
    before = server_totals(monitor)
    args.served_name = served_name(monitor, args.model)
    clients = [LoadClient(i, args, target) for i in range(args.concurrency)]
    stop = threading.Event()
    t0 = time.monotonic()
    stop_at = t0 + args.duration
    threads = [
        threading.Thread(target=c.run, args=(stop_at, stop), name=f"client-{i}", daemon=True)
        for i, c in enumerate(clients)
    ]
    for thread in threads:
        thread.start()
    samples: list[tuple[float, float]] = []
    cached: list[tuple[float, int | None]] = []  # the prefix cache's tokens, which legitimately take RSS
    interrupted = False
    next_sample = t0
    drain_deadline = stop_at + args.request_timeout + 5
    try:
        while any(t.is_alive() for t in threads) and time.monotonic() < drain_deadline:
            now = time.monotonic()
            if now >= next_sample:
                value = rss_mib(pid) if pid is not None else None
                if value is not None:
                    samples.append((now - t0, value))
                cached.append((now - t0, prefix_tokens(monitor)))
                next_sample += SAMPLE_EVERY_S
                if not args.json:
                    done = sum(c.tally.ok for c in clients)
                    errors = sum(sum(c.tally.errors.values()) for c in clients)
                    rss = f"{value:.0f} MiB" if value is not None else "n/a"
                    console.print(
                        f"[dim]{now - t0:6.1f} s  requests {done}  errors {errors}  rss {rss}[/dim]",
                        highlight=False,
                    )
            time.sleep(max(0.01, min(0.2, next_sample - time.monotonic())))
    except KeyboardInterrupt:
        interrupted = True
        stop.set()
    wall = time.monotonic() - t0
    if pid is not None:
        value = rss_mib(pid)
        if value is not None:
            samples.append((wall, value))
    cached.append((wall, prefix_tokens(monitor)))
    stop.set()
    unfinished = sum(1 for c in clients if c.tally.in_flight)
    after = server_totals(monitor)
    tallies = [c.tally for c in clients]
    latencies = [x for t in tallies for x in t.latencies]
    ttfts = [x for t in tallies for x in t.ttfts]
    errors: Counter[str] = Counter()
    for t in tallies:
        errors.update(t.errors)
    ok, chunks = sum(t.ok for t in tallies), sum(t.chunks for t in tallies)
    server = None
    if before and after:
        server = {k: (after[k] or 0) - (before[k] or 0) for k in after}
        server["generated_tok_s"] = server["generated_tokens"] / wall if wall else None
    rss = rss_summary(samples)
    rss["growth_kib_per_cached_token"] = growth_per_cached_token(rss, cached)
    return {
        "model": args.model,
        "concurrency": args.concurrency,
        "duration_s": args.duration,
        "max_tokens": args.max_tokens,
        "wall_s": wall,
        "interrupted": interrupted,
        "unfinished": unfinished,
        "requests": ok + sum(errors.values()),
        "ok": ok,
        "errors": sum(errors.values()),
        "error_kinds": dict(errors),
        "error_examples": list(dict.fromkeys(e for t in tallies for e in t.examples))[:5],
        "chunks": chunks,
        "chunks_per_s": chunks / wall if wall else None,
        "requests_per_s": ok / wall if wall else None,
        "latency_p50_s": percentile(latencies, 50),
        "latency_p99_s": percentile(latencies, 99),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "rss": rss,
        "rss_samples": [(round(t, 1), round(v, 1)) for t, v in samples],
        "prefix_cache_tokens": [(round(t, 1), v) for t, v in cached],
        "server": server,
    }


def _fmt(value: Any, spec: str, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def print_table(doc: dict[str, Any], console: Console) -> None:
    rss = doc["rss"]
    caption = (
        f"{doc['concurrency']} clients, {doc['duration_s']:g} s, max_tokens {doc['max_tokens']}, "
        f"RSS every {SAMPLE_EVERY_S:g} s"
    )
    table = Table(title=f"serve load: {doc['model']}", caption=caption)
    table.add_column("metric")
    table.add_column("value", justify="right")
    kinds = ", ".join(f"{k} {v}" for k, v in doc["error_kinds"].items())
    rows = [
        ("requests done", f"{doc['ok']}"),
        ("errors", f"{doc['errors']}" + (f" ({kinds})" if kinds else "")),
        ("wall s", _fmt(doc["wall_s"], ".1f")),
        ("requests / s", _fmt(doc["requests_per_s"], ".2f")),
        ("chunks / s", _fmt(doc["chunks_per_s"], ".1f")),
        ("latency p50 s", _fmt(doc["latency_p50_s"], ".3f")),
        ("latency p99 s", _fmt(doc["latency_p99_s"], ".3f")),
        ("first chunk p50 s", _fmt(doc["ttft_p50_s"], ".3f")),
        ("first chunk p99 s", _fmt(doc["ttft_p99_s"], ".3f")),
    ]
    if doc["server"]:
        rows.append(("server generated tok / s", _fmt(doc["server"]["generated_tok_s"], ".1f")))
        rows.append(("server failed / rejected", f"{doc['server']['failed']} / {doc['server']['rejected']}"))
    rows += [
        ("rss first MiB", _fmt(rss.get("first_mib"), ".1f")),
        ("rss min / max MiB", f"{_fmt(rss.get('min_mib'), '.1f')} / {_fmt(rss.get('max_mib'), '.1f')}"),
        ("rss last MiB", _fmt(rss.get("last_mib"), ".1f")),
        (f"rss baseline MiB (at {BASELINE_AT_S:g} s)", _fmt(rss.get("baseline_mib"), ".1f")),
        ("rss drift after baseline", _fmt(rss.get("drift_pct"), ".2f", " %")),
        ("rss range after baseline", _fmt(rss.get("range_pct"), ".2f", " %")),
    ]
    cached = [v for _, v in doc["prefix_cache_tokens"] if v is not None]
    if cached:
        rows.append(("prefix cache tokens first → last", f"{cached[0]} → {cached[-1]}"))
        per_token = rss.get("growth_kib_per_cached_token")
        rows.append(("rss growth per cached token", _fmt(per_token, ".2f", " KiB")))
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    for example in doc["error_examples"]:
        console.print(f"[red]error[/red] {example}", highlight=False)
    if doc["interrupted"]:
        console.print("[yellow]interrupted: partial results[/yellow]")
    if doc["unfinished"]:
        console.print(f"[yellow]{doc['unfinished']} request(s) still unfinished at the end[/yellow]")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo", help="model to serve (and to name in requests)")
    ap.add_argument("--concurrency", "-c", type=int, default=16)
    ap.add_argument("--duration", "-d", type=float, default=180.0, help="seconds of load")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--url", help="attach to a running server (e.g. http://127.0.0.1:8000)")
    ap.add_argument("--pid", type=int, help="with --url: the server's process id, for RSS samples")
    ap.add_argument("--api-key", help="sent as Authorization: Bearer (and passed to a server started here)")
    ap.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help='extra flags for the server started here, split like a shell: --serve-arg="--port 9000"',
    )
    ap.add_argument("--request-timeout", type=float, default=120.0, help="socket timeout per request, s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    console = Console(stderr=args.json)
    exit_on_sigterm()

    server: Server | None = None
    try:
        if args.url:
            scheme, host, port = parse_url(args.url)
            target = Client(host, port, timeout=args.request_timeout, api_key=args.api_key, scheme=scheme)
            pid = args.pid
            if args.serve_arg:
                console.print("[yellow]--serve-arg is ignored with --url[/yellow]")
        else:
            extra = [a for value in args.serve_arg for a in shlex.split(value)]
            if not args.json:
                console.print(f"starting freetoken serve {args.model} {' '.join(extra)}".rstrip())
            try:
                server = Server.start(args.model, extra, api_key=args.api_key)
            except ServerError as exc:
                console.print(f"[red]error:[/red] {exc}", highlight=False)
                return 1
            target = Client(server.host, server.port, timeout=args.request_timeout, api_key=args.api_key)
            pid = server.pid
            if not args.json:
                console.print(f"ready in {server.ready_s:.1f} s on port {server.port} (pid {pid})")
        doc = run_load(args, target, pid, console)
        if server is not None:
            doc["server_ready_s"] = server.ready_s
            doc["server_alive_after"] = server.alive()
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/yellow]")
        return 130
    finally:
        if server is not None:
            server.stop()
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print_table(doc, console)
    return 0 if doc["errors"] == 0 and not doc["interrupted"] else 1


if __name__ == "__main__":
    sys.exit(main())
