"""FreeToken beside llama.cpp on the same GGUF at the same expert budget, in one run.

    python benchmarks/peer_llamacpp.py --llama-bench .peers/llama-build-cuda/bin/llama-bench \\
        --gguf /dev/shm/q30.gguf --device cuda --budgets 1,0.375
    python benchmarks/peer_llamacpp.py --llama-bench .peers/llama-build-cpu/bin/llama-bench \\
        --gguf small.gguf --device cpu --threads 2 --json

The GGUFs: `make_family_gguf.py` (a grouped-query family's shapes: Qwen3-30B-A3B, OLMoE, GLM-4.5-Air,
MiniMax-M2, Mixtral; experts BF16, Q8_0, Q4_K, Q6_K or Q4_K_M's per-layer mix), `make_gpt_oss_gguf.py`
(gpt-oss-20b's, MXFP4 experts) and `make_deepseek_gguf.py` (DeepSeek-V3's or GLM-5's, cut to a few
layers), beside this script.

A budget is the fraction of the expert bytes on the GPU. Of the M MoE layers (the file's layers less its
leading dense ones, D), N = round((1 - budget) · M) keep their experts in host memory: llama.cpp gets
`-ngl 99 -ncmoe D + N` (it counts from the first layer, dense ones included); FreeToken gets `fused` at 1
and `--moe-backend BACKEND --moe-cache-ratio (M - N) / M` below it, the same bytes. On a cpu
device both run everything on the host (`-ngl 0`; FreeToken's `cpu` backend). Prefill: one prompt of
`--prompt` tokens (llama-bench pp); decode: `--gen` tokens after it (tg). Routing: the generators' expert
blocks are zero-mean and our decode samples its tokens (as tg feeds random ones), so random hidden states
route near uniformly — a cache hits less than on a real model — unless a file states a skew
(`make_qwen35_gguf.py --router-skew`); each row reports the run's miss rate: say it beside any figure.

`--split tensors` places a budget by expert tensor instead (gate, up and down of each MoE layer, from the
first layer on, kept in host memory by llama.cpp's `-ot NAME=CPU`): on a file of few MoE layers this comes
closer to a small budget (DeepSeek-V3 cut to 8 layers: 11 % is 2 of 15 tensors, 13.3 %, where layers
give 0 or 20 %). FreeToken's cache ratio is the GPU's share of the expert bytes either way.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from family_graphs import copy_bandwidth, floor_bytes

from freetoken.runtime.devices import sync_device
from freetoken.runtime.engine import Engine, build_engine
from freetoken.runtime.kv.prefix_cache import PrefixCache
from freetoken.runtime.moe.kernels.cpu_experts import read_bandwidth
from freetoken.runtime.moe.kernels.loader import cpu_description
from freetoken.runtime.sampling import SamplingParams
from freetoken.runtime.scheduler import Scheduler
from freetoken.runtime.sequence import GenerationStats, TokenEvent

SAMPLED = SamplingParams(temperature=1.0, seed=0, ignore_eos=True)  # decode's tokens (freetoken_bench)


def llama_bench(
    binary: Path,
    gguf: Path,
    device: str,
    offloaded: int,
    threads: int,
    prompt: int,
    gen: int,
    host_tensors: tuple[str, ...] = (),
) -> dict[str, float]:
    """llama-bench's pp and tg tokens per second (its own mean over repetitions); `host_tensors`: expert
    tensors kept in host memory by name (with `offloaded` 0)."""
    args = [str(binary), "-m", str(gguf), "-t", str(threads), "-p", str(prompt), "-n", str(gen), "-o", "json"]
    args += ["-ngl", "99", "-ncmoe", str(offloaded), "-fa", "1"] if device != "cpu" else ["-ngl", "0"]
    if host_tensors and device != "cpu":
        args += ["-ot", ";".join(f"^{re.escape(name)}$=CPU" for name in host_tensors)]
    env = {**os.environ, "LD_LIBRARY_PATH": f"{binary.parent}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    done = subprocess.run(args, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"llama-bench failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    out = {}
    for row in json.loads(done.stdout):
        kind = "prefill_tok_s" if row.get("n_prompt", 0) > 0 and row.get("n_gen", 0) == 0 else "decode_tok_s"
        out[kind] = float(row["avg_ts"])
    return out


def host_read_floor(engine: Engine, threads: int) -> float:
    """Decode tokens/s if reading each token's routed experts (top-k of every MoE layer, as stored) at
    this host's read ceiling were all a step cost: the floor of a row with every expert on the CPU."""
    pool, k = engine.pool, engine.config.num_experts_per_tok
    per_token = pool.nbytes * k / pool.num_experts  # bytes: k experts of every MoE layer
    return read_bandwidth(threads=threads) / per_token


def freetoken_bench(engine: Engine, prompt: int, gen: int) -> dict[str, Any]:
    """Through the engine's scheduler, as `ft run` does: prefill `prompt` tokens (timed to the first
    token); decode `gen` tokens after a short prompt, as llama-bench's tg starts from an empty context,
    sampled at temperature 1 (SAMPLED): as varied as tg's random token ids, where a random-weight model
    decoding greedily can settle on repeating one token, which routes to the same experts every step.
    Warmed up first on the same prompt (the prefill path it takes and its kernels compiled, the batch-1
    graph captured)."""
    vocab = engine.config.vocab_size
    ids = [(7 * i + 11) % vocab for i in range(prompt)]
    list(engine.generate(ids, SamplingParams(max_tokens=8, ignore_eos=True)))
    engine.reset()  # nothing cached: the prompt is prefilled in full
    prefill = _last(engine.generate(ids, SamplingParams(max_tokens=1, ignore_eos=True)))
    engine.reset()
    branch = getattr(engine.executor, "stream_branch", None)
    if branch is not None:
        branch.timings(reset=True)
    decode = _last(engine.generate(ids[-8:], replace(SAMPLED, max_tokens=gen + 1)))
    out: dict[str, Any] = {"prefill_tok_s": prefill.prefill_tok_s, "decode_tok_s": decode.decode_tok_s}
    if branch is not None:  # where a decode layer's CPU side spends its time, µs a layer
        out["cpu_branch_us"] = branch.timings()
    return out


def batch_decode_tok_s(engine: Engine, batch: int, gen: int) -> float:
    """Aggregate decode tokens/s of `batch` requests decoding together (short distinct prompts)."""
    vocab = engine.config.vocab_size
    engine.reserve_slots(batch)
    scheduler = Scheduler(engine, PrefixCache(0), max_running=batch)

    def run(steps: int) -> tuple[int, float]:
        events: list[Any] = []
        for b in range(batch):
            prompt = [(13 * b + 7 * i + 5) % vocab for i in range(8)]
            scheduler.add(prompt, SamplingParams(max_tokens=steps + 1, ignore_eos=True), events.append)
        scheduler.step()  # every request prefills and draws its first token
        first = len(events)
        sync_device(engine.device)
        start = time.perf_counter()
        while scheduler.has_work():
            scheduler.step()
        return len(events) - first, time.perf_counter() - start

    run(4)  # warm-up: the batch's graph captured
    tokens, seconds = run(gen)
    return tokens / seconds


def freetoken_options(args: argparse.Namespace, ratio: float, threads: int) -> list[dict[str, Any]]:
    """The engine options with `ratio` of the expert bytes on the GPU: fused with every expert there; each
    of --backends at that share; cpu with no slot when no expert is on the GPU."""
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.int8_act]
    if args.device == "cpu" or ratio == 0.0:
        return [
            {"moe_backend": "cpu", "cache_size": 0, "cpu_threads": threads, "cpu_int8_act": mode}
            for mode in modes
        ]
    if ratio == 1.0:
        return [{"moe_backend": "fused"}]
    out = []
    for backend in args.backends.split(","):
        options: dict[str, Any] = {"moe_backend": backend, "cache_ratio": ratio, "cpu_threads": threads}
        if backend == "hybrid":
            options.update(
                {k: v for k, v in (("pcie_gbps", args.pcie_gbps), ("host_gbps", args.host_gbps)) if v}
            )
            out += [{**options, "cpu_int8_act": mode} for mode in modes]
        else:
            out.append(options)
    return out


def measure(args: argparse.Namespace, options: dict[str, Any], batch: int) -> dict[str, Any]:
    """FreeToken's prefill and decode on the GGUF with `options` (and `batch` requests together if > 1)."""
    context = args.prompt + args.gen + 64
    engine = build_engine(args.gguf, device=args.device, dtype="auto", max_seq_len=context, **options)
    ours: dict[str, Any] = dict(freetoken_bench(engine, args.prompt, args.gen))
    if batch > 1:
        ours["batch"] = batch
        ours["batch_decode_tok_s"] = batch_decode_tok_s(engine, batch, args.gen)
    ours["miss_rate"] = engine.moe_counters.miss_rate()
    ours["streamed_experts"] = engine.moe_counters.totals()["streamed"]  # prefill's whole layers
    ours["expert_pool"] = engine.pool.describe()
    if options.get("cache_size") == 0:  # every routed expert read by the CPU: the host read bounds decode
        ours["floor_decode_tok_s"] = host_read_floor(engine, options["cpu_threads"])
    elif options["moe_backend"] == "fused" and args.device.startswith("cuda"):  # every byte read from HBM
        context = 8 + args.gen // 2  # tg's mean context: a short prompt, then --gen tokens
        ours["floor_decode_tok_s"] = copy_bandwidth(engine.device) / floor_bytes(engine, 1, context)
    engine.close()
    del engine
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return ours


def engine_label(engine: dict[str, Any]) -> str:
    """A row's engine as the table names it: FreeToken's backend, llama.cpp's placement; +i8 with int8
    activations."""
    label = engine["moe_backend"] if "moe_backend" in engine else f"ncmoe {engine['ncmoe']}"
    if engine.get("host_tensors"):
        label = f"ot {engine['host_tensors']}"
    return label + ("+i8" if engine.get("cpu_int8_act") else "")


def best_against_best(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per budget and FreeToken engine: its fastest decode over the thread counts run against llama.cpp's
    fastest at that budget (each engine at its own best thread count)."""
    out: dict[tuple[float, str], dict[str, Any]] = {}
    for row in rows:
        key = (row["budget"], engine_label(row["freetoken"]))
        best = out.setdefault(key, {"budget": key[0], "engine": key[1], "ours": 0.0})
        if row["freetoken"]["decode_tok_s"] > best["ours"]:
            best.update(ours=row["freetoken"]["decode_tok_s"], ours_threads=row["threads"])
    for best in out.values():
        at_budget = [r for r in rows if r["budget"] == best["budget"]]
        peer = max(at_budget, key=lambda r: r["llama_cpp"]["decode_tok_s"])
        best.update(peer=peer["llama_cpp"]["decode_tok_s"], peer_threads=peer["threads"])
        best["ratio"] = best["ours"] / best["peer"] if best["peer"] else None
    return list(out.values())


def earlier_peer(path: Path, placement: dict[str, int]) -> dict[str, float]:
    """llama.cpp's prefill and decode at the same placement (`ncmoe`, `host_tensors`) from an earlier
    --json report."""
    rows = [row["llama_cpp"] for row in json.loads(path.read_text())["rows"]]
    for row in rows:
        if all(row.get(k, 0) == v for k, v in placement.items()):
            return {k: v for k, v in row.items() if k not in placement}
    have = sorted({(r["ncmoe"], r.get("host_tensors", 0)) for r in rows})
    raise SystemExit(f"{path}: no llama.cpp row at {placement} (has (ncmoe, host_tensors) {have})")


def _last(events: Iterator[TokenEvent]) -> GenerationStats:
    *_, last = events
    assert last.stats is not None
    return last.stats


def budget_split(budget: float, layers: int, dense: int) -> tuple[int, int, float]:
    """A budget (share of expert bytes on the GPU) -> (llama.cpp's -ncmoe, MoE layers whose experts stay
    in host memory, FreeToken's cache ratio of the same bytes): the module's note."""
    moe = layers - dense
    on_host = round((1 - budget) * moe)
    return (dense + on_host if on_host else 0), on_host, (moe - on_host) / moe


def tensor_split(budget: float, tensors: list[tuple[str, int]]) -> tuple[tuple[str, ...], float]:
    """A budget -> (the first expert tensors, in file order, kept in host memory so that the GPU holds the
    nearest share of the expert bytes to `budget`; that share). `tensors`: (name, bytes) of every expert
    tensor."""
    total = sum(size for _, size in tensors)
    best, host = (abs(1.0 - budget), 0), 0
    for k, (_, size) in enumerate(tensors, 1):
        host += size
        best = min(best, (abs((total - host) / total - budget), k))
    kept = tensors[: best[1]]
    return tuple(name for name, _ in kept), (total - sum(size for _, size in kept)) / total


def expert_tensors(gguf: Path) -> list[tuple[str, int]]:
    """(name, bytes) of a GGUF's routed-expert tensors in file order of their layers (gate, up, down)."""
    from gguf import GGUFReader

    found = {t.name: int(t.n_bytes) for t in GGUFReader(gguf).tensors if re.search(r"_exps\.weight$", t.name)}
    order = {"gate": 0, "up": 1, "down": 2}
    key = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps")

    def rank(name: str) -> tuple[int, int]:
        m = key.match(name)
        return (int(m.group(1)), order[m.group(2)]) if m else (1 << 30, 0)

    return [(name, found[name]) for name in sorted(found, key=rank)]


def layer_counts(gguf: Path) -> tuple[int, int]:
    """(layers, leading dense layers) of a GGUF."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    dense = reader.fields.get(f"{arch}.leading_dense_block_count")
    return int(reader.fields[f"{arch}.block_count"].parts[-1][0]), int(dense.parts[-1][0]) if dense else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    peer = ap.add_mutually_exclusive_group(required=True)
    peer.add_argument("--llama-bench", type=Path, help="llama-bench built by build_llamacpp.sh")
    peer.add_argument(
        "--peer-from",
        type=Path,
        help="llama.cpp's rows from an earlier --json run of this script (same GGUF, same kind of machine) "
        "instead of running llama-bench; the report names that file, and its ratios span two runs",
    )
    ap.add_argument("--gguf", type=Path, required=True, help="e.g. made by make_qwen3moe_gguf.py")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--budgets", default="1,0.375", help="fractions of the expert bytes on the GPU")
    ap.add_argument(
        "--split",
        choices=("layers", "tensors"),
        default="layers",
        help="place a budget by MoE layer (llama.cpp's -ncmoe) or by expert tensor (-ot NAME=CPU)",
    )
    ap.add_argument(
        "--backends", default="offload,hybrid", help="FreeToken's backends for a budget in (0, 1), each a row"
    )
    ap.add_argument(
        "--pcie-gbps", type=float, help="B_P for hybrid (default: this machine's bench bw profile)"
    )
    ap.add_argument("--host-gbps", type=float, help="B_H for hybrid (likewise)")
    ap.add_argument(
        "--threads",
        default=str(max(1, (os.cpu_count() or 2) - 2)),
        help="CPU threads of both engines; a comma list runs each (and reports each engine's best)",
    )
    ap.add_argument(
        "--int8-act",
        choices=("off", "on", "both"),
        default="off",
        help="the rows whose experts the CPU computes (cpu, hybrid): quantized experts against int8 "
        "activations (--moe-cpu-int8-act), or both rows",
    )
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="also decode this many requests together (fused)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    layers, dense = layer_counts(args.gguf)
    by_tensor = expert_tensors(args.gguf) if args.split == "tensors" else []
    rows: list[dict[str, Any]] = []
    budgets = [1.0] if args.device == "cpu" else [float(b) for b in args.budgets.split(",")]
    thread_counts = [int(t) for t in args.threads.split(",")]
    for budget, threads in itertools.product(budgets, thread_counts):
        host_tensors: tuple[str, ...] = ()
        if by_tensor and 0.0 < budget < 1.0:
            ncmoe, (host_tensors, ratio) = 0, tensor_split(budget, by_tensor)
        else:
            ncmoe, _, ratio = budget_split(1.0 if args.device == "cpu" else budget, layers, dense)
        placement = {"ncmoe": ncmoe, "host_tensors": len(host_tensors)}
        peer = (
            earlier_peer(args.peer_from, placement)
            if args.peer_from
            else llama_bench(
                args.llama_bench, args.gguf, args.device, ncmoe, threads, args.prompt, args.gen, host_tensors
            )
        )
        for options in freetoken_options(args, ratio, threads):
            ours = measure(args, options, batch=args.batch if ratio == 1.0 else 1)
            rows.append(
                {
                    "budget": ratio,
                    "threads": threads,
                    "llama_cpp": {**placement, **peer},
                    "freetoken": {**options, **ours},
                    "ratio": {k: ours[k] / peer[k] for k in ("prefill_tok_s", "decode_tok_s") if peer.get(k)},
                }
            )
    doc = {"gguf": str(args.gguf), "layers": layers, "dense_layers": dense, "device": args.device,
           "threads": thread_counts, "prompt": args.prompt, "gen": args.gen, "cpu": cpu_description(),
           "rows": rows, "best": best_against_best(rows)}  # fmt: skip
    if args.peer_from:
        doc["llama_cpp_from"] = str(args.peer_from)
    if args.json:
        print(json.dumps(doc, indent=1))
        return
    cpu = doc["cpu"]
    print(f"{args.gguf.name} · {layers} layers · {args.device} · pp{args.prompt} / tg{args.gen}")
    print(f"{cpu['model']} · {cpu['cores']} cores · {' '.join(cpu['isa']) or 'no listed ISA'}")
    if args.peer_from:
        print(f"llama.cpp's rows from an earlier run: {args.peer_from}")
    print(f"{'budget':>7} {'threads':>7} {'engine':>10} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for row in rows:
        for name in ("llama_cpp", "freetoken"):
            r = row[name]
            head = f"{row['budget']:>7.3f} {row['threads']:>7} {engine_label(r):>10}"
            print(f"{head} {r['prefill_tok_s']:>14.1f} {r['decode_tok_s']:>13.1f}")
        ratio = row["ratio"]
        print(f"{'':>15} {'ours/peer':>10} {ratio['prefill_tok_s']:>14.2f} {ratio['decode_tok_s']:>13.2f}")
        ours = row["freetoken"]
        if "floor_decode_tok_s" in ours:
            floor, peer_tok_s = ours["floor_decode_tok_s"], row["llama_cpp"]["decode_tok_s"]
            print(
                f"{'':>15} {'read floor':>10} {'':>14} {floor:>13.1f}  (ours "
                f"{ours['decode_tok_s'] / floor:.2f}, llama.cpp {peer_tok_s / floor:.2f} of it)"
            )
        if "cpu_branch_us" in ours:
            t = ours["cpu_branch_us"]
            print(
                f"{'':>15} {'cpu side':>10}  µs a layer: busy {t['busy']:.0f} (kernel call {t['call']:.0f}, "
                f"threads started by {t['team_start']:.0f}, done by {t['work_end']:.0f}, joined "
                f"{t['joined']:.0f}), gap {t['gap']:.0f}"
            )
        if "batch_decode_tok_s" in ours:
            scale = ours["batch_decode_tok_s"] / ours["decode_tok_s"]
            print(
                f"{'':>15} {'ours b' + str(ours['batch']):>10} {'':>14} {ours['batch_decode_tok_s']:>13.1f}"
                f"  ({scale:.2f}x batch 1)"
            )
    if len(thread_counts) > 1:
        for best in doc["best"]:
            print(
                f"best against best, budget {best['budget']:.3f}: {best['engine']} {best['ours']:.1f} tok/s "
                f"at {best['ours_threads']} threads, llama.cpp {best['peer']:.1f} at {best['peer_threads']}: "
                f"{best['ratio']:.2f} x"
            )


if __name__ == "__main__":
    main()
