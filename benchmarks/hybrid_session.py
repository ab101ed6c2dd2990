"""Per-turn TTFT and decode speed of a hybrid model over a replayed agent session, per checkpoint policy.

    python benchmarks/hybrid_session.py                        # Qwen3.6-35B-A3B shape, 40 layers, cache 37%
    python benchmarks/hybrid_session.py --layers 16 --edit opencode --json
    python benchmarks/hybrid_session.py --small --device cpu   # smoke test of the script

A random-weight Qwen3.5/3.6-MoE (gated DeltaNet layers, every fourth one gated full attention, 256 experts
of which 8 are routed plus a shared expert) replays the synthetic agent session of `freetoken replay
session --generate`, edited as the chosen harness edits it, once per policy at the same checkpoint budget.
Each turn reports the tokens re-prefilled (against the genuinely new suffix), the time to first token and
the decode speed. Routing is uniform over the experts (random weights route narrowly), as a real agent's
long context does; the vocabulary is the demo tokenizer's.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from freetoken.replay.harness import requests_for, synthetic_session
from freetoken.replay.session import replay_in_process
from freetoken.replay.synthetic import uniform_routing
from freetoken.runtime.config import EngineConfig, MoeConfig
from freetoken.runtime.engine import Engine
from freetoken.runtime.loading.demo import random_weights
from freetoken.runtime.text.demo_tokenizer import write_demo_tokenizer

# Qwen3.6-35B-A3B (as Qwen3.5-35B-A3B): 40 layers, 3 DeltaNet + 1 full attention, 256 experts of 512.
QWEN3_6_35B_A3B: dict[str, Any] = dict(
    hidden_size=2048,
    num_hidden_layers=40,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    num_experts=256,
    num_experts_per_tok=8,
    max_position_embeddings=262144,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
)
SMALL = {
    **QWEN3_6_35B_A3B,
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "num_experts": 16,
    "num_experts_per_tok": 4,
}
# name -> (policy, interval)
POLICIES = {"anchors": ("anchors", 64), "interval-64": ("interval", 64), "none": ("none", 64)}


def write_config(folder: Path, shape: dict[str, Any], layers: int) -> Path:
    """config.json of a Qwen3_5MoeForCausalLM of `shape` with `layers` layers, plus the demo tokenizer."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_demo_tokenizer(folder)
    kinds = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    raw = {
        **shape,
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "model_type": "qwen3_5_moe_text",
        "num_hidden_layers": layers,
        "layer_types": kinds,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "dtype": "bfloat16",
    }
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, help="layer count (40 for Qwen3.6-35B-A3B)")
    ap.add_argument("--ratio", type=float, default=0.37, help="expert cache as a fraction of the pool")
    ap.add_argument("--backend", default="offload", help="MoE backend")
    ap.add_argument("--edit", default="openclaw", help="harness edit pattern: openclaw, opencode, swe-agent")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--output-words", type=int, default=300, help="words of each tool output")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens decoded per turn")
    ap.add_argument("--budget", type=int, default=16, help="checkpoints kept, the same for every policy")
    ap.add_argument("--policies", default=",".join(POLICIES), help="a subset of: " + ", ".join(POLICIES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="a tiny shape (smoke test)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    shape = SMALL if args.small else QWEN3_6_35B_A3B
    layers = args.layers or shape["num_hidden_layers"]
    session = synthetic_session(args.turns, output_tokens=args.output_words)
    requests = [{"messages": m, "max_tokens": args.max_tokens} for m in requests_for(session, args.edit)]
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_config(Path(tmp) / "model", shape, layers)
        moe = MoeConfig(args.backend, cache_ratio=args.ratio, reprofile=False)
        config = EngineConfig(folder, args.device, "bfloat16", moe, state_checkpoints=args.budget)
        engine = Engine(config, weights=random_weights())
    uniform_routing(engine)
    rows = []
    try:
        replay_in_process(engine, requests[:2])  # warm: kernels, allocator, the expert cache
        for name in args.policies.split(","):
            policy, interval = POLICIES[name]
            engine.engine_config = replace(config, checkpoint_policy=policy, checkpoint_interval=interval)
            for report in replay_in_process(engine, requests):
                rows.append({"policy": name, **vars(report)})
    finally:
        engine.close()
    doc = {
        "shape": "small" if args.small else "qwen3.6-35b-a3b",
        "layers": layers,
        "pool_GB": engine.pool.nbytes / 1e9,
        "cache_ratio": args.ratio,
        "backend": engine.backend,
        "edit": args.edit,
        "budget": args.budget,
        "rows": rows,
    }
    if args.json:
        print(json.dumps(doc, indent=2))
        return
    table = Table(
        title=f"{doc['shape']}, {layers} layers, pool {doc['pool_GB']:.1f} GB, cache {args.ratio:.0%}, "
        f"{engine.backend} · {args.edit} edits · {args.budget} checkpoints"
    )
    for col in ("policy", "turn", "prompt", "re-prefilled", "new suffix", "TTFT s", "decode tok/s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["policy"],
            str(r["turn"]),
            str(r["prompt_tokens"]),
            str(r["reprefilled_tokens"]),
            str(r["suffix_tokens"]),
            f"{r['ttft_s']:.3f}",
            f"{r['decode_tok_s']:.1f}",
        )
    Console(width=150).print(table)
    for name in args.policies.split(","):
        mine = [r for r in rows if r["policy"] == name and r["turn"] > 0]
        ttft = sum(r["ttft_s"] for r in mine)
        tok_s = sum(r["decode_tok_s"] for r in mine) / max(len(mine), 1)
        print(f"{name}: turns 1.. TTFT {ttft:.2f} s in all, mean decode {tok_s:.1f} tok/s")


if __name__ == "__main__":
    main()
