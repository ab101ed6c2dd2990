"""Re-prefilled tokens per turn under the three harness edit patterns, per recurrent-checkpoint policy.

    python benchmarks/checkpoints.py [--budget 8] [--turns 8] [--json]

A tiny random Qwen3.5-MoE (three DeltaNet layers, one gated attention layer; transformers builds it) replays
the synthetic agent session of `freetoken replay session --generate`, edited as OpenClaw, OpenCode and
SWE-agent edit it, with anchors, interval(64), interval(512) and no checkpoints at the same budget. The
floor is the genuinely new suffix: the prompt past its common prefix with what the engine holds.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from freetoken.replay.checkpoint_compare import compare

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from oracle import build_hybrid_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=int, default=8, help="checkpoints kept, the same for every policy")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        build_hybrid_model(Path(tmp))
        rows = compare(Path(tmp), budget=args.budget, turns=args.turns)
    if args.json:
        print(json.dumps({"budget": args.budget, "rows": rows}, indent=2))
        return
    table = Table(title=f"re-prefilled tokens, turns 1..{args.turns - 1}, {args.budget} checkpoints each")
    for col in ("harness", "policy", "per turn (re-prefilled / new suffix)", "total", "× suffix", "state KB"):
        table.add_column(col, justify="right")
    for r in rows:
        turns = " ".join(f"{a}/{b}" for a, b in zip(r["reprefilled"][1:], r["suffix"][1:], strict=True))
        table.add_row(
            r["edit"],
            r["policy"],
            turns,
            f"{r['total_reprefilled']}/{r['total_suffix']}",
            f"{r['ratio']:.3f}",
            f"{r['checkpoint_bytes'] / 1024:.0f}",
        )
    Console(width=170).print(table)


if __name__ == "__main__":
    main()
