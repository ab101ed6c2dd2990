"""Cold start: load the same model from safetensors and from FTW, beside the disk's sequential-read floor.

    python benchmarks/bootstrap.py --layers 4            # Qwen3-30B-A3B shape, 4 layers (~6 GB bf16)
    python benchmarks/bootstrap.py --spec demo --json
    python benchmarks/bootstrap.py --gguf model.gguf --device cuda   # one GGUF file as it is

Before each cold run the page cache is dropped: through /proc/sys/vm/drop_caches where permitted, else
per file with posix_fadvise(DONTNEED) (clean pages only; the report says which). The floor is one
sequential read of the FTW shards (or of the GGUF) right after a drop; a file in tmpfs stays in memory, so
its floor is a read from memory. Time to first token = load + a one-token answer.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from freetoken.runtime.engine import build_engine
from freetoken.runtime.loading.convert import convert_to_ftw
from freetoken.runtime.loading.demo import (
    DEMO_SPEC,
    QWEN3_30B_A3B_SPEC,
    RandomModelSpec,
    write_random_model,
)
from freetoken.runtime.sampling import SamplingParams

SPECS = {"demo": DEMO_SPEC, "qwen3-30b-a3b": QWEN3_30B_A3B_SPEC}


def drop_cache(files: list[Path]) -> str:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError:
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "fadvise"


def sequential_read(files: list[Path], block: int = 64 << 20) -> float:
    buf = bytearray(block)
    view = memoryview(buf)
    t0 = time.perf_counter()
    total = 0
    for path in files:
        with open(path, "rb", buffering=0) as handle:
            while got := handle.readinto(view):
                total += got
    return total / (time.perf_counter() - t0)


def cold_load(folder: Path, files: list[Path], device: str) -> dict[str, Any]:
    method = drop_cache(files)
    t0 = time.perf_counter()
    engine = build_engine(
        folder,
        device=device,
        dtype="bfloat16",
        moe_backend="fused" if device == "cpu" else "auto",
        reprofile=False,
    )
    load_s = time.perf_counter() - t0
    list(engine.generate([1, 2, 3], SamplingParams(max_tokens=1, ignore_eos=True)))
    ttft = time.perf_counter() - t0
    engine.close()
    return {"load_s": load_s, "ttft_s": ttft, "cache": method}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", choices=sorted(SPECS), default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dir", type=Path, help="work folder (default: a temporary one on the current disk)")
    ap.add_argument("--gguf", type=Path, help="time this GGUF file alone (no model is written)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.gguf is not None:
        nbytes = args.gguf.stat().st_size
        drop_cache([args.gguf])
        floor = sequential_read([args.gguf])
        rows = {"gguf": cold_load(args.gguf, [args.gguf], args.device)}
        source, layers = args.gguf.name, None
    else:
        nbytes, floor, rows = written_models(replace(SPECS[args.spec], num_layers=args.layers), args)
        source, layers = args.spec, args.layers
    report(rows, nbytes, floor, source, layers, args.json)


Rows = dict[str, dict[str, Any]]


def written_models(spec: RandomModelSpec, args: argparse.Namespace) -> tuple[int, float, Rows]:
    """The spec written as safetensors and converted to FTW, each loaded cold; (FTW bytes, floor, rows)."""
    with tempfile.TemporaryDirectory(prefix="ft-bootstrap-", dir=args.dir or Path.cwd()) as tmp:
        hf = write_random_model(Path(tmp) / "hf", spec)
        ftw = Path(tmp) / "ftw"
        convert_to_ftw(hf, ftw, dtype="bfloat16")
        hf_files = sorted(hf.glob("*.safetensors"))
        ftw_files = sorted(ftw.glob("*.ftw"))
        nbytes = sum(p.stat().st_size for p in ftw_files)
        drop_cache(ftw_files)
        floor = sequential_read(ftw_files)
        rows = {
            "safetensors": cold_load(hf, hf_files, args.device),
            "ftw": cold_load(ftw, ftw_files, args.device),
        }
    return nbytes, floor, rows


def report(rows: Rows, nbytes: int, floor: float, source: str, layers: int | None, as_json: bool) -> None:
    """source: the spec's name or the GGUF file's; layers None: the file's own."""
    for row in rows.values():
        row["GBps"] = nbytes / row["load_s"] / 1e9
        row["over_floor"] = row["load_s"] / (nbytes / floor)
    doc = {
        "spec": source,
        "layers": layers,
        "bytes": nbytes,
        "disk_floor_GBps": floor / 1e9,
        "floor_s": nbytes / floor,
        "rows": rows,
    }
    if as_json:
        print(json.dumps(doc, indent=2))
        return
    table = Table(
        title=f"cold load, {source}, {layers or 'all'} layers, {nbytes / 2**30:.2f} GiB · read floor "
        f"{floor / 1e9:.2f} GB/s ({nbytes / floor:.2f} s) · cache: {next(iter(rows.values()))['cache']}"
    )
    for col in ("format", "load s", "GB/s", "x floor", "first token s"):
        table.add_column(col, justify="right")
    for name, r in rows.items():
        table.add_row(
            name, f"{r['load_s']:.2f}", f"{r['GBps']:.2f}", f"{r['over_floor']:.2f}", f"{r['ttft_s']:.2f}"
        )
    Console().print(table)


if __name__ == "__main__":
    main()
