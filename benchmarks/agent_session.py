"""A coding agent's session through both servers' chat endpoints — ours (`ft serve`) and llama.cpp's
`llama-server` — on one GGUF at one expert budget: per turn, the prompt tokens, the time to first token
and the decode tok/s of each, and each turn's decode over its first turn's.

    python benchmarks/agent_session.py q36.gguf --llama-server BIN --budget 0.375 --json
    python benchmarks/agent_session.py q36.gguf --turns 2000,4000 --gen 32 --device cpu   # ours only

The session grows as an agent harness grows it: a system prompt with the tools' descriptions and a task,
then per turn the assistant's answer (its `<think>` part stripped, as harnesses drop thinking from the
history they send back) and a tool result long enough to bring the context to that turn's target
(`--turns`, tokens; by default 3 turns to 56k, 60k and 65k). With `--subagent`, the last turn runs beside
a second request of its own context (a subagent's: a quarter of turn 1's), both streamed at once. Both
servers are asked the same messages with the same sampling (temperature 1, `--seed`); each keeps its
own prefix cache. Context targets are reached by filler text, its tokens a word measured first on each
server (two one-token requests); the tokens actually sent are each server's `usage.prompt_tokens`,
reported. Budgets: the share of expert bytes on the GPU, placed as peer_llamacpp.py places them
(`--moe-cache-ratio` for ours, `-ncmoe` whole layers for llama.cpp).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from serve_client import Client
from serve_process import Server, free_port

WORDS = ("file", "test", "error", "line", "module", "return", "value", "config", "build", "path", "class",
         "import", "function", "output", "string", "index", "thread", "cache", "layer", "token")  # fmt: skip
SYSTEM = "You are a coding agent. Tools: read_file(path), grep(pattern, path), run(command). Answer briefly."


def filler(rng: random.Random, words: int) -> str:
    """`words` words of a tool's output (a line break every 12)."""
    out = [rng.choice(WORDS) for _ in range(words)]
    return " ".join(w + ("\n" if i % 12 == 11 else "") for i, w in enumerate(out))


def strip_thinking(text: str) -> str:
    return re.sub(r"<think>.*?</think>\s*", "", text, flags=re.S).strip()


def stream_turn(client: Client, messages: list[dict[str, str]], gen: int, seed: int) -> dict[str, Any]:
    """One streamed chat completion -> prompt tokens, TTFT, decode tok/s (tokens after the first over the
    time after it) and the answer's text."""
    body = {"messages": messages, "max_tokens": gen, "stream": True, "temperature": 1.0, "seed": seed,
            "stream_options": {"include_usage": True}}  # fmt: skip
    start = time.perf_counter()
    stream = client.stream("/v1/chat/completions", body, timeout=3600)
    if stream.status != 200:
        raise SystemExit(f"{client.host}:{client.port}: HTTP {stream.status}: {stream.body()[:300]!r}")
    first = last = None
    pieces: list[str] = []
    usage: dict[str, Any] = {}
    chunks = 0
    for event in stream.events():
        if event.done:
            break
        doc = event.json() or {}
        usage = doc.get("usage") or usage
        for choice in doc.get("choices", []):
            text = (choice.get("delta") or {}).get("content") or ""
            if text:
                now = time.perf_counter()
                first = first or now
                last = now
                chunks += 1
                pieces.append(text)
    stream.close()
    tokens = int(usage.get("completion_tokens", chunks))
    decode = (tokens - 1) / (last - first) if first and last and last > first and tokens > 1 else None
    return {
        "prompt_tokens": usage.get("prompt_tokens"),
        "ttft_s": (first - start) if first else None,
        "completion_tokens": tokens,
        "decode_tok_s": decode,
        "text": "".join(pieces),
    }


def session(client: Client, targets: list[int], gen: int, seed: int, subagent: bool) -> list[dict[str, Any]]:
    """The growing session against one server -> a row per turn (and the subagent's beside the last)."""
    rng = random.Random(seed)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Fix the failing test."}]
    per_word, sent = tokens_per_word(client, messages, rng)
    rows = []
    for n, target in enumerate(targets):
        result = filler(rng, max(int((target - sent) / per_word), 16))
        messages.append({"role": "user", "content": f"<tool_response>\n{result}\n</tool_response>"})
        side: dict[str, Any] = {}
        worker = None
        if subagent and n == len(targets) - 1:
            words = int(targets[0] / 4 / per_word)  # a subagent's own context: a quarter of turn 1's
            task = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": filler(rng, words)}]
            other = Client(client.host, client.port, timeout=client.timeout)
            worker = threading.Thread(target=run_into, args=(side, other, task, gen, seed))
            worker.start()
        row = stream_turn(client, messages, gen, seed + n)
        if worker is not None:
            worker.join()
            row["subagent"] = {k: v for k, v in side.items() if k != "text"}
        sent = row["prompt_tokens"] or target
        messages.append({"role": "assistant", "content": strip_thinking(row.pop("text"))})
        rows.append(row)
    first = rows[0]["decode_tok_s"]
    for row in rows:
        row["decode_over_turn_1"] = row["decode_tok_s"] / first if first and row["decode_tok_s"] else None
    return rows


def tokens_per_word(client: Client, messages: list[dict[str, str]], rng: random.Random) -> tuple[float, int]:
    """(the server's tokens a filler word, the messages' own tokens): two one-token requests, the messages
    alone, then with 500 words more."""
    base = stream_turn(client, messages, 1, 0)["prompt_tokens"] or 0
    probe = [*messages, {"role": "user", "content": filler(rng, 500)}]
    more = stream_turn(client, probe, 1, 0)["prompt_tokens"] or base + 500
    return max((more - base) / 500, 0.1), base


def run_into(
    out: dict[str, Any], client: Client, messages: list[dict[str, str]], gen: int, seed: int
) -> None:
    """stream_turn's row into `out` (a thread's target; a failure is recorded, not lost with the thread)."""
    try:
        out.update(stream_turn(client, messages, gen, seed))
    except BaseException as exc:  # SystemExit included: a thread would drop it silently
        out["error"] = str(exc)


def moe_layers(gguf: Path) -> tuple[int, int]:
    """(MoE layers, leading dense layers) of a GGUF, as peer_llamacpp.py counts them."""
    import gguf as gg

    reader = gg.GGUFReader(str(gguf))
    names = {t.name for t in reader.tensors}
    blocks = sorted({int(n.split(".")[1]) for n in names if n.startswith("blk.")})
    moe = [b for b in blocks if {f"blk.{b}.ffn_gate_exps.weight", f"blk.{b}.ffn_gate_up_exps.weight"} & names]
    return len(moe), (moe[0] if moe else 0)


def llama_server(
    binary: Path, gguf: Path, budget: float, context: int, threads: int
) -> tuple[subprocess.Popen[bytes], int]:
    """Start llama-server with `budget` of the expert layers on the GPU (-ncmoe the rest) and two slots (the
    main session and a subagent; each gets half of -c, so -c is twice `context`) -> (process, port), once
    healthy."""
    layers, dense = moe_layers(gguf)
    host_layers = dense + round((1 - budget) * layers)
    port = free_port()
    args = [str(binary), "-m", str(gguf), "--port", str(port), "-ngl", "99", "-ncmoe", str(host_layers),
            "-c", str(2 * context), "-t", str(threads), "--jinja", "-np", "2"]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    client = Client("127.0.0.1", port, timeout=2.0)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"llama-server exited: {proc.stderr.read()[-500:] if proc.stderr else b''!r}")
        try:
            if client.get_json("/health")[0] == 200:
                return proc, port
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("llama-server never became healthy")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", type=Path)
    ap.add_argument(
        "--llama-server", type=Path, default=None, help="llama.cpp's server binary (else ours only)"
    )
    ap.add_argument("--budget", type=float, default=0.375, help="share of the expert bytes on the GPU")
    ap.add_argument("--turns", default="56000,60000,65000", help="each turn's context target, tokens")
    ap.add_argument("--gen", type=int, default=128, help="tokens each turn decodes")
    ap.add_argument(
        "--subagent", action="store_true", help="a concurrent second request beside the last turn"
    )
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if not args.gguf.is_file():
        raise SystemExit(f"{args.gguf}: no such file")
    targets = [int(t) for t in args.turns.split(",")]
    context = max(targets) + 4 * args.gen + 2048
    result: dict[str, Any] = {"gguf": str(args.gguf), "budget": args.budget, "turns": targets}
    ours_args = ["--device", args.device, "--context-length", str(context), "--max-running-requests", "2"]
    if args.budget < 1:
        ours_args += ["--moe-backend", "hybrid", "--moe-cache-ratio", str(args.budget)]
    with Server.start(str(args.gguf), ours_args, timeout=1800) as server:
        result["freetoken"] = session(
            server.client(timeout=3600), targets, args.gen, args.seed, args.subagent
        )
    if args.llama_server is not None:
        proc, port = llama_server(args.llama_server, args.gguf, args.budget, context, args.threads)
        try:
            client = Client("127.0.0.1", port, timeout=3600)
            result["llama_cpp"] = session(client, targets, args.gen, args.seed, args.subagent)
        finally:
            proc.kill()
    if args.json:
        print(json.dumps(result))
        return
    for name in ("freetoken", "llama_cpp"):
        for n, row in enumerate(result.get(name, []), 1):
            ratio = row["decode_over_turn_1"] or 0.0
            print(f"{name:9s} turn {n}: prompt {row['prompt_tokens']} ttft {row['ttft_s'] or 0:.2f} s "
                  f"decode {row['decode_tok_s'] or 0:.1f} tok/s ({ratio:.2f} of turn 1)")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
