"""Our MoE decode GEMVs beside llama.cpp's own, kernel against kernel, on the same card in one run.

    python benchmarks/peer_llamacpp_kernels.py --llama-bench .peers/llama-build-cuda/bin/llama-bench
    python benchmarks/peer_llamacpp_kernels.py --llama-bench BIN --codecs Q4_K --ncu /path/to/ncu --json
    python benchmarks/peer_llamacpp_kernels.py --llama-bench BIN --family mixtral --codecs Q4_K,Q6_K
    python benchmarks/peer_llamacpp_kernels.py --llama-bench BIN --codecs IQ3_S --ggufs DIR  # DIR/X.gguf kept

For each codec a 4-layer GGUF of a family's shapes (`--family`, make_family_gguf.py's: Qwen3-30B-A3B by
default, Mixtral-8x7B's wide experts, MiniMax-M2's, OLMoE's, GLM-4.5-Air's) with experts of that codec is
written by `make_family_gguf.py` (its dense weights bf16, so llama.cpp's quantized GEMVs, `mul_mat_vec_q`, are
the MoE ones); `ncu --clock-control none` times every such kernel of a batch-1 decode (`llama-bench -p 0`,
every expert on the GPU) with the DRAM bytes it read: the fused gate/up launch (the most bytes) and down.
Ours: the fused MoE decode step's kernels (the int8-activation sides for the codecs they read, with
`int8_blocks`; the fp32 ones with `codec_blocks` for the others: the shipped tiles) on random banks of
the same shapes, each kernel's device time under torch's profiler, each call routed to other
experts. `x read`: GB/s over a plain reduction's read measured in the same run.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # moe_decode_kernel, imported with torch where the GPU side runs
UNITS = {
    "ns": 1e-9, "nsecond": 1e-9, "us": 1e-6, "usecond": 1e-6, "ms": 1e-3, "msecond": 1e-3,
    "byte": 1.0, "B": 1.0, "KB": 1e3, "Kbyte": 1e3, "MB": 1e6, "Mbyte": 1e6, "GB": 1e9, "Gbyte": 1e9,
}  # fmt: skip
METRICS = ("gpu__time_duration.sum", "dram__bytes_read.sum", "launch__grid_size")


def parse_ncu_csv(text: str) -> list[dict[str, Any]]:
    """ncu --csv (a row a metric a kernel launch) -> a dict a launch: name, seconds, dram_bytes, grid."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    if not lines:
        raise SystemExit("ncu printed no kernel rows (no kernel matched, or the profiler could not start)")
    rows = list(csv.reader(lines))
    head = rows[0]
    at = {key: head.index(key) for key in ("ID", "Kernel Name", "Metric Name", "Metric Unit", "Metric Value")}
    launches: dict[str, dict[str, Any]] = defaultdict(dict)
    for row in rows[1:]:
        launch = launches[row[at["ID"]]]
        launch["name"] = row[at["Kernel Name"]]
        value = float(row[at["Metric Value"]].replace(",", "")) * UNITS.get(row[at["Metric Unit"]], 1.0)
        metric = row[at["Metric Name"]]
        key = {"gpu__time_duration.sum": "seconds", "dram__bytes_read.sum": "dram_bytes"}.get(metric, "grid")
        launch[key] = value
    return list(launches.values())


def moe_gemvs(launches: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """The quantized GEMV launches grouped by kernel and grid; the group reading the most bytes is
    gate/up, the next down -> {"gate_up" | "down": {"seconds", "dram_bytes", "launches"}} (means)."""
    groups: dict[tuple[str, float], list[dict[str, Any]]] = defaultdict(list)
    for launch in launches:
        if "mul_mat_vec_q" in launch["name"]:
            groups[(launch["name"], launch.get("grid", 0.0))].append(launch)
    if len(groups) < 2:
        raise SystemExit(f"expected gate/up and down mul_mat_vec_q launches, found {len(groups)} kind(s)")
    means = [
        {
            "seconds": sum(x["seconds"] for x in group) / len(group),
            "dram_bytes": sum(x["dram_bytes"] for x in group) / len(group),
            "launches": float(len(group)),
        }
        for group in groups.values()
    ]
    means.sort(key=lambda m: -m["dram_bytes"])
    return {"gate_up": means[0], "down": means[1]}


def llama_kernels(binary: Path, gguf: Path, ncu: str) -> dict[str, dict[str, float]]:
    """llama.cpp's MoE GEMVs of a batch-1 decode of `gguf`, every expert on the GPU, under ncu."""
    env = {**os.environ, "LD_LIBRARY_PATH": f"{binary.parent}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    args = [ncu, "--clock-control", "none", "--kernel-name", "regex:mul_mat_vec_q", "--launch-skip", "128"]
    args += ["--launch-count", "64", "--metrics", ",".join(METRICS), "--csv"]
    args += [str(binary), "-m", str(gguf), "-ngl", "99", "-fa", "1", "-p", "0", "-n", "64", "-r", "1"]
    done = subprocess.run(args, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"ncu failed ({done.returncode}): {done.stderr.strip()[-400:]}")
    return moe_gemvs(parse_ncu_csv(done.stdout))


def our_kernels(codec: str, hidden: int, inter: int, experts: int, top_k: int) -> dict[str, dict[str, float]]:
    """Our gate_up and down kernels at batch 1 (shipped tiles; the int8-activation ones for the codecs
    they read, the fp32 ones otherwise): device seconds and expert bytes."""
    import torch
    from moe_decode_kernel import cycling, kernel_times, random_banks

    from freetoken.codecs import get_codec
    from freetoken.runtime.moe.kernels.moe_decode import codec_blocks, fused_moe_decode, int8_blocks
    from freetoken.runtime.moe.kernels.moe_decode_int8 import int8_side

    g = torch.Generator(device="cuda").manual_seed(0)
    gate_up, down, _ = random_banks(codec, experts, hidden, inter, g)
    x = torch.randn(1, hidden, device="cuda").bfloat16()
    w = torch.rand(1, top_k, device="cuda")
    sets = [torch.randperm(experts, device="cuda", generator=g)[:top_k][None] for _ in range(16)]
    int8 = bool(int8_side(codec, hidden) and int8_side(codec, inter))
    blocks, codecs = (int8_blocks(codec, hidden) if int8 else codec_blocks(codec)), (codec, codec)
    times = kernel_times(
        cycling(
            lambda ids: fused_moe_decode(x, ids, w, gate_up, down, blocks, codecs=codecs, int8_act=int8), sets
        )
    )
    c = get_codec(codec)
    nbytes = {
        "gate_up": top_k * c.tensor_bytes(2 * inter, hidden),
        "down": top_k * c.tensor_bytes(hidden, inter),
    }
    return {
        part: {
            "seconds": sum(s for name, s in times.items() if part in name),
            "dram_bytes": float(nbytes[part]),
        }
        for part in ("gate_up", "down")
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-bench", type=Path, required=True, help="a CUDA build of llama-bench")
    ap.add_argument("--codecs", default="Q4_K,Q8_0")
    ap.add_argument("--family", default="qwen3moe", help="make_family_gguf.py's family: its expert shapes")
    ap.add_argument("--ncu", default=shutil.which("ncu") or "ncu", help="Nsight Compute's command line")
    ap.add_argument("--dir", type=Path, default=None, help="where the GGUFs are written (a temporary folder)")
    ap.add_argument(
        "--ggufs", type=Path, default=None, help="a folder of CODEC.gguf files (kept; made where absent)"
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not args.llama_bench.is_file():
        raise SystemExit(f"{args.llama_bench}: no such file (build it with the peers' build script)")
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    from make_family_gguf import FAMILIES
    from moe_decode_kernel import read_bandwidth

    if args.family not in FAMILIES:
        raise SystemExit(f"--family {args.family!r}: one of {', '.join(sorted(FAMILIES))}")
    published = FAMILIES[args.family].shape
    shape = {"hidden": published["hidden"], "inter": published["moe_inter"], "experts": published["experts"],
             "top_k": published["top_k"]}  # fmt: skip
    read = read_bandwidth()
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for codec in args.codecs.split(","):
            gguf = (args.ggufs or Path(tmp)) / f"{codec}.gguf"
            if not gguf.is_file():
                make = [sys.executable, str(HERE / "make_family_gguf.py"), str(gguf), "--layers", "4"]
                make += ["--family", args.family]
                subprocess.run([*make, "--expert-type", codec], check=True, capture_output=True)
            theirs = llama_kernels(args.llama_bench, gguf, args.ncu)
            if args.ggufs is None:
                gguf.unlink()
            ours = our_kernels(codec, **shape)
            for part in ("gate_up", "down"):
                o, t = ours[part], theirs[part]
                rows.append(
                    {
                        "codec": codec,
                        "kernel": part,
                        "bytes": o["dram_bytes"],
                        "ours_us": o["seconds"] * 1e6,
                        "ours_x_read": o["dram_bytes"] / o["seconds"] / read,
                        "llama_cpp_us": t["seconds"] * 1e6,
                        "llama_cpp_dram_bytes": t["dram_bytes"],
                        "llama_cpp_x_read": t["dram_bytes"] / t["seconds"] / read,
                        "ours_over_llama_cpp": t["seconds"] / o["seconds"],
                    }
                )
    if args.json:
        device = torch.cuda.get_device_name()
        print(json.dumps({"device": device, "family": args.family, "read_GBps": read / 1e9, "rows": rows}))
        return
    print(f"{torch.cuda.get_device_name()}, read {read / 1e9:.0f} GB/s, batch 1, {shape}")
    print("codec  kernel   MB      ours us (x read)   llama.cpp us (x read)   ours / llama.cpp")
    for r in rows:
        ours = f"{r['ours_us']:7.2f} ({r['ours_x_read']:.2f})"
        theirs = f"{r['llama_cpp_us']:7.2f} ({r['llama_cpp_x_read']:.2f})"
        print(
            f"{r['codec']:<6} {r['kernel']:<8} {r['bytes'] / 1e6:5.1f}   {ours}      {theirs}"
            f"          {r['ours_over_llama_cpp']:.2f} x"
        )


if __name__ == "__main__":
    main()
