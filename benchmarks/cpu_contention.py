"""CPU decode on a shared machine: quiet, beside a 1-thread busy loop, and two processes side by side —
FreeToken (`--device cpu`, `--moe-backend cpu`) and, given `--llama-bench`, llama.cpp on the same GGUF
with the same threads. Prints a table (or `--json`): decode tok/s per case and its share of the quiet
speed.

    python benchmarks/cpu_contention.py --gguf q16.gguf --llama-bench .peers/llama-build-cpu/bin/llama-bench

Side-by-side FreeToken processes load first, then start decoding together (a file barrier).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from peer_llamacpp import freetoken_bench, llama_bench

from freetoken.runtime.measure.cpu_share import allowed_cores


def worker(args: argparse.Namespace) -> None:
    """One FreeToken process: load, signal ready, wait for go, decode; print its tok/s as JSON."""
    from freetoken.runtime.engine import build_engine

    engine = build_engine(
        args.gguf,
        device="cpu",
        dtype=args.dtype,
        moe_backend="cpu",
        max_seq_len=256,
        cpu_threads=args.threads,
    )
    freetoken_bench(engine, 8, 4)  # warm
    if args.barrier:
        Path(f"{args.barrier}.ready.{os.getpid()}").touch()
        while not Path(f"{args.barrier}.go").exists():
            time.sleep(0.01)
    tok_s = freetoken_bench(engine, 8, args.gen)["decode_tok_s"]
    print(json.dumps({"decode_tok_s": tok_s, "threads_now": engine.cpu_threads.current}), flush=True)


def freetoken_runs(args: argparse.Namespace, processes: int) -> list[float]:
    """tok/s of each of `processes` FreeToken workers decoding at the same time."""
    with tempfile.TemporaryDirectory() as tmp:
        barrier = str(Path(tmp) / "b")
        cmd = [sys.executable, __file__, "--worker", "--gguf", str(args.gguf), "--threads", str(args.threads),
               "--gen", str(args.gen), "--dtype", args.dtype, "--barrier", barrier]  # fmt: skip
        procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for _ in range(processes)]
        while len(list(Path(tmp).glob("b.ready.*"))) < processes:
            if any(p.poll() is not None for p in procs):
                raise SystemExit("a FreeToken worker died while loading")
            time.sleep(0.05)
        Path(f"{barrier}.go").touch()
        return [json.loads(p.communicate()[0].strip().splitlines()[-1])["decode_tok_s"] for p in procs]


def llama_runs(args: argparse.Namespace, processes: int) -> list[float]:
    """llama-bench's tg tok/s for each of `processes` runs started together."""
    if processes == 1:
        return [llama_bench(args.llama_bench, args.gguf, "cpu", 0, args.threads, 0, args.gen)["decode_tok_s"]]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(processes) as pool:
        runs = [
            pool.submit(llama_bench, args.llama_bench, args.gguf, "cpu", 0, args.threads, 0, args.gen)
            for _ in range(processes)
        ]
        return [r.result()["decode_tok_s"] for r in runs]


def case(run: Any, args: argparse.Namespace, name: str) -> dict[str, Any]:
    if name == "quiet":
        return {"case": name, "tok_s": run(args, 1)}
    if name == "busy loop":
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(0.5)
            return {"case": name, "tok_s": run(args, 1)}
        finally:
            busy.kill()
    return {"case": name, "tok_s": run(args, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--llama-bench", type=Path)
    ap.add_argument("--threads", type=int, default=len(allowed_cores()))
    ap.add_argument("--gen", type=int, default=48)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--barrier", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    engines = {"freetoken": freetoken_runs} | ({"llama.cpp": llama_runs} if args.llama_bench else {})
    rows = []
    for engine, run in engines.items():
        cases = [case(run, args, name) for name in ("quiet", "busy loop", "two side by side")]
        quiet = cases[0]["tok_s"][0]
        for c in cases:
            rows.append({"engine": engine, **c, "share_of_quiet": [t / quiet for t in c["tok_s"]]})
    doc = {
        "gguf": str(args.gguf),
        "threads": args.threads,
        "gen": args.gen,
        "dtype": args.dtype,
        "rows": rows,
    }
    if args.json:
        print(json.dumps(doc, indent=1))
        return
    print(f"{args.gguf.name} · {args.threads} threads · tg{args.gen} · {args.dtype}")
    print(f"{'engine':>10} {'case':>17} {'decode tok/s':>20} {'of quiet':>14}")
    for r in rows:
        tok = " / ".join(f"{t:.1f}" for t in r["tok_s"])
        share = " / ".join(f"{s:.0%}" for s in r["share_of_quiet"])
        print(f"{r['engine']:>10} {r['case']:>17} {tok:>20} {share:>14}")


if __name__ == "__main__":
    main()
