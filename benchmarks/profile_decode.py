"""Where one decode step's time goes: wall time per step beside the GPU's time, so the host's share
shows (the target: the GPU waits on the host < 10% of a step at batch 1), then the profiler's kernel
table. With CUDA graphs the GPU's time is the last step's graph replayed back to back (its own gaps
between kernels are GPU time, not host time); without, the kernels' summed busy time.

    python benchmarks/profile_decode.py --spec qwen3-30b-a3b --layers 24 --device cuda --backend fused
    python benchmarks/profile_decode.py --spec demo --device cpu --json
    python benchmarks/profile_decode.py --model q24.gguf --device cuda --batch 1,8 --json

Steps run through the scheduler, as `ft run` and `ft serve` run them (sampling, detokenising and stop
matching included); on CUDA with `fused` each step is one graph replay.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from torch.profiler import ProfilerActivity, profile

from freetoken.runtime.devices import sync_device
from freetoken.runtime.engine import Engine, build_engine
from freetoken.runtime.kv.prefix_cache import PrefixCache
from freetoken.runtime.loading.demo import DEMO_SPEC, QWEN3_30B_A3B_SPEC, write_random_model
from freetoken.runtime.sampling import SamplingParams
from freetoken.runtime.scheduler import Scheduler

SPECS = {"demo": DEMO_SPEC, "qwen3-30b-a3b": QWEN3_30B_A3B_SPEC}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", choices=sorted(SPECS), default="demo")
    ap.add_argument("--model", type=Path, help="a model to load instead of writing a random --spec one")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--backend", default="fused")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", default="1", help="batch sizes, comma-separated: each profiled in turn")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--rows", type=int, default=15, help="rows of the kernel table")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    spec = SPECS[args.spec] if not args.layers else replace(SPECS[args.spec], num_layers=args.layers)
    if args.model:
        engine = build_engine(args.model, args.device, args.dtype, args.backend, max_seq_len=1024)
    else:
        with tempfile.TemporaryDirectory(prefix="ft-prof-") as tmp:
            engine = build_engine(
                write_random_model(Path(tmp) / "m", spec), args.device, "auto", args.backend
            )
    name = args.model.name if args.model else args.spec
    docs = [profile_batch(engine, int(b), args, name) for b in args.batch.split(",")]
    if args.json:
        print(json.dumps(docs if len(docs) > 1 else docs[0], indent=1))


def profile_batch(engine: Engine, batch: int, args: argparse.Namespace, name: str) -> dict[str, Any]:
    """Wall and GPU-busy time per step of `batch` requests decoding together; prints the kernel table
    unless --json."""
    engine.reset()
    engine.reserve_slots(batch)
    scheduler = Scheduler(engine, PrefixCache(0), max_running=batch)
    params = SamplingParams(max_tokens=3 * args.steps + 20, ignore_eos=True)
    vocab = engine.config.vocab_size
    for b in range(batch):
        scheduler.add([(11 * b + 3 * i + 1) % min(500, vocab) for i in range(64)], params, lambda event: None)
    for _ in range(6):  # prefill, then the graphs captured
        scheduler.step()

    def steps(n: int) -> float:
        sync_device(engine.device)
        start = time.perf_counter()
        for _ in range(n):
            scheduler.step()
        sync_device(engine.device)
        return (time.perf_counter() - start) / n

    wall = steps(args.steps)
    replay = engine.decoder.replay_ms() if engine.decoder else None  # the graph alone, no host between
    cuda = engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        steps(args.steps)
    while scheduler.has_work():  # finish the requests, so the next batch starts from free slots
        scheduler.step()
    table = prof.key_averages()
    gpu = sum(e.self_device_time_total for e in table) / 1e6 / args.steps if cuda else wall
    doc = {
        "model": name, "layers": engine.config.num_layers, "device": str(engine.device),
        "backend": engine.backend, "batch": batch, "step_ms": wall * 1e3, "gpu_busy_ms": gpu * 1e3,
        "kernels_idle_share": max(0.0, 1 - gpu / wall), "tok_s": batch / wall, "replay_ms": replay,
        "host_share": max(0.0, 1 - (replay if replay else gpu * 1e3) / (wall * 1e3)),
        "graph_replays": engine.decoder.replays if engine.decoder else 0,
        "kernels": [  # the busiest, per step: device (or CPU) microseconds and launches
            {"name": e.key[:80], "us_per_step": (e.self_device_time_total if cuda else e.self_cpu_time_total)
             / args.steps, "calls_per_step": e.count / args.steps}
            for e in sorted(
                table, key=lambda e: -(e.self_device_time_total if cuda else e.self_cpu_time_total)
            )[: args.rows]
        ],
    }  # fmt: skip
    if not args.json:
        sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        print(table.table(sort_by=sort, row_limit=args.rows))
        print(
            f"{name} · {doc['layers']} layers · {engine.device} · {engine.backend} · batch {batch}: "
            f"step {wall * 1e3:.3f} ms, kernels busy {gpu * 1e3:.3f} ms, host share {doc['host_share']:.1%}, "
            f"{doc['tok_s']:.1f} tok/s, {doc['graph_replays']} graph replays"
            + (
                f"; the graph alone {replay:.3f} ms: host share {doc['host_share_of_replay']:.1%}"
                if replay
                else ""
            )
        )
    return doc


if __name__ == "__main__":
    main()
