"""Every family beside llama.cpp in one run: for each family (and each stated routing skew) its generator
writes a GGUF at the family's published shapes, cut in layers where the file would be large,
`peer_llamacpp.py` runs both engines on it at each expert budget, and the file is deleted.

    python benchmarks/peer_families.py --llama-bench .peers/llama-build-cuda/bin/llama-bench --out peers.json
    python benchmarks/peer_families.py --llama-bench BIN --families qwen3moe,gpt-oss --skews 0,0.5 \
        --out peers.json

Each row prints as it is measured, and --out is rewritten after every file, so a run stopped midway keeps
what it measured; a second run with the same --out skips the (family, skew) pairs already there (their
errors aside). Routing: `--skews` are the generators' `--router-skew` (0: near uniform; 0.5 gives
Qwen3.6-35B-A3B's published miss rate at 37 %); each row carries the run's own miss rate.

Families (llama.cpp's arch names; experts in Q4_K_M's per-layer mix unless published in another type):
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Family:
    about: str
    generator: str  # a script beside this one
    args: tuple[str, ...]  # its arguments besides OUT and --router-skew
    split: str = "layers"  # peer_llamacpp.py --split: tensors where a cut file has few MoE layers


FAMILY = "make_family_gguf.py"
FAMILIES = {
    "qwen3moe": Family("Qwen3-30B-A3B, 8 of 48 layers", FAMILY,
                       ("--family", "qwen3moe", "--layers", "8", "--expert-type", "Q4_K_M")),
    "gpt-oss": Family("gpt-oss-20b, 8 of 24 layers, MXFP4 experts", "make_gpt_oss_gguf.py",
                      ("--layers", "8")),
    "glm4moe": Family("GLM-4.5-Air, 5 of 46 layers (the first dense)", FAMILY,
                      ("--family", "glm4moe", "--layers", "5", "--expert-type", "Q4_K_M")),
    "minimax-m2": Family("MiniMax-M2, 8 of 62 layers", FAMILY,
                         ("--family", "minimax-m2", "--layers", "8", "--expert-type", "Q4_K_M")),
    "deepseek2": Family("DeepSeek-V3, 3 of 61 layers (one dense), Q4_K experts", "make_deepseek_gguf.py",
                        ("--family", "deepseek2", "--layers", "3", "--dense-layers", "1"), "tensors"),
    "glm-dsa": Family("GLM-5, 3 of 78 layers (one dense), Q4_K experts", "make_deepseek_gguf.py",
                      ("--family", "glm-dsa", "--layers", "3", "--dense-layers", "1"), "tensors"),
    "olmoe": Family("OLMoE-1B-7B, all 16 layers", FAMILY, ("--family", "olmoe", "--expert-type", "Q4_K_M")),
    "llama": Family("Mixtral-8x7B as llama.cpp's llama, 8 of 32 layers", FAMILY,
                    ("--family", "mixtral", "--layers", "8", "--expert-type", "Q4_K_M")),
    "qwen35moe": Family("Qwen3.6-35B-A3B, all 40 layers", "make_qwen35_gguf.py", ("--expert-type", "Q4_K_M")),
}  # fmt: skip
__doc__ = (__doc__ or "") + "\n".join(f"  {name:<11} {f.about}" for name, f in FAMILIES.items())


def generate(family: Family, path: Path, skew: float, args: argparse.Namespace) -> None:
    command = [sys.executable, str(HERE / family.generator), str(path), *family.args]
    command += ["--router-skew", str(skew), *shlex.split(args.generator_args)]
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=args.timeout)


def peer(gguf: Path, family: Family, args: argparse.Namespace) -> dict[str, Any]:
    """peer_llamacpp.py's --json document for one file."""
    command = [
        sys.executable, str(HERE / "peer_llamacpp.py"), "--llama-bench", str(args.llama_bench), "--gguf",
        str(gguf), "--device", args.device, "--budgets", args.budgets, "--split", family.split, "--backends",
        args.backends, "--threads", args.threads, "--prompt", str(args.prompt), "--gen", str(args.gen),
        "--batch", "1", "--json",
    ]  # fmt: skip
    done = subprocess.run(command, check=True, capture_output=True, text=True, timeout=args.timeout)
    return json.loads(done.stdout)


def summary(entry: dict[str, Any]) -> list[str]:
    """One line per row of an entry: budget, the two engines' decode tok/s, the ratio, our miss rate."""
    if "error" in entry:
        return [f"{entry['family']:<11} skew {entry['skew']:<4} error: {entry['error']}"]
    lines = []
    for row in entry["peer"]["rows"]:
        ours, theirs = row["freetoken"], row["llama_cpp"]
        miss = ours.get("miss_rate")
        ratio = row["ratio"].get("decode_tok_s", float("nan"))
        lines.append(
            f"{entry['family']:<11} skew {entry['skew']:<4} budget {row['budget']:.3f} "
            f"{ours['moe_backend']:<7} ours {ours['decode_tok_s']:8.1f}  "
            f"llama.cpp {theirs['decode_tok_s']:8.1f}  {ratio:5.2f} x"
            + (f"  miss {miss:.1%}" if miss is not None else "")
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bench", type=Path, required=True, help="llama-bench built by build_llamacpp.sh")
    ap.add_argument("--families", default=",".join(FAMILIES), help="a comma list of: " + ", ".join(FAMILIES))
    ap.add_argument("--skews", default="0", help="the generators' --router-skew, each a file")
    ap.add_argument("--budgets", default="1,0.375,0", help="fractions of the expert bytes on the GPU")
    ap.add_argument("--backends", default="hybrid", help="FreeToken's backends below a budget of 1")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--threads", default="14")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--scratch", type=Path, default=Path("/dev/shm"), help="where the GGUFs are written")
    ap.add_argument(
        "--timeout", type=float, default=600.0, help="seconds for a file's generator, and its runs"
    )
    ap.add_argument(
        "--generator-args", default="", help="appended to every generator's arguments (e.g. smaller shapes)"
    )
    ap.add_argument("--out", type=Path, required=True, help="the JSON document, rewritten after every file")
    args = ap.parse_args()
    names = [n for n in args.families.split(",") if n]
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        ap.error(f"--families: unknown {', '.join(unknown)}; known: {', '.join(FAMILIES)}")
    doc = json.loads(args.out.read_text()) if args.out.exists() else {"entries": []}
    doc["entries"] = [e for e in doc["entries"] if "error" not in e]  # a failed file is tried again
    done = {(e["family"], e["skew"]) for e in doc["entries"]}
    for name in names:
        for skew in (float(s) for s in args.skews.split(",")):
            if (name, skew) in done:
                continue
            family, gguf, start = FAMILIES[name], args.scratch / f"peer-{name}-{skew}.gguf", time.time()
            entry: dict[str, Any] = {"family": name, "skew": skew, "about": family.about}
            try:
                generate(family, gguf, skew, args)
                entry["gguf_bytes"] = gguf.stat().st_size
                entry["peer"] = peer(gguf, family, args)
            except subprocess.CalledProcessError as e:
                entry["error"] = (e.stderr or "").strip().splitlines()[-1:] or [f"exit {e.returncode}"]
                entry["error"] = entry["error"][0]
            except subprocess.TimeoutExpired:
                entry["error"] = f"over --timeout {args.timeout:.0f} s"
            finally:
                gguf.unlink(missing_ok=True)
            entry["seconds"] = round(time.time() - start, 1)
            doc["entries"].append(entry)
            args.out.write_text(json.dumps(doc, indent=1))
            print("\n".join(summary(entry)), flush=True)


if __name__ == "__main__":
    main()
