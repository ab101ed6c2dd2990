"""Every family's decode step on the GPU: the model's own static step run eagerly, and that step replayed
as a CUDA graph — beside the bandwidth floor.

    python benchmarks/family_graphs.py                          # every family, 4 layers, batches 1 and 8
    python benchmarks/family_graphs.py --families qwen3_5_moe,qwen3_next --layers 8 --json

Each family is built at its published dimensions (transformers' default config of the family:
Qwen3-30B-A3B, Mixtral-8x7B, OLMoE-1B-7B, GLM-4.5-Air, MiniMax-M2, gpt-oss-120b, DeepSeek-V3, DeepSeek-V3.2,
GLM-5, Qwen3.5/3.6-35B-A3B, Qwen3-Next-80B-A3B, Kimi-Linear-48B-A3B, DeepSeek-V4-Flash), cut to a few
layers (DeepSeek-V3, V3.2 and GLM-5: a dense layer and one MoE layer; Kimi-Linear: five, the fifth its
first latent-attention layer; DeepSeek-V4-Flash: four, the fourth its first compressed-sparse layer), with
random bf16 weights drawn in memory, every expert resident (`fused`) and uniform routing. The floor of a
step is the bytes it must read from HBM — every non-expert weight (the embedding's rows aside), the
distinct experts B rows route to in expectation (E·(1 − (1 − k/E)^B) a layer), the K/V it attends over
and the recurrent states it reads and writes — over the device's copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from freetoken.replay.synthetic import uniform_routing
from freetoken.runtime.config import EngineConfig, MoeConfig
from freetoken.runtime.devices import sync_device
from freetoken.runtime.engine import Engine
from freetoken.runtime.loading.demo import random_weights
from freetoken.runtime.text.demo_tokenizer import write_demo_tokenizer

# family -> (transformers config class, overrides of its defaults beside the layer count)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_moe": ("Qwen3MoeConfig", {}),
    "mixtral": ("MixtralConfig", {}),
    "olmoe": ("OlmoeConfig", {"intermediate_size": 1024}),
    "glm4_moe": ("Glm4MoeConfig", {"first_k_dense_replace": 1}),
    "minimax_m2": ("MiniMaxM2Config", {"rotary_dim": 64}),
    "gpt_oss": ("GptOssConfig", {}),
    "deepseek_v3": ("DeepseekV3Config", {"first_k_dense_replace": 1}),
    "deepseek_v32": ("DeepseekV32Config", {"first_k_dense_replace": 1}),
    "glm_moe_dsa": ("GlmMoeDsaConfig", {"first_k_dense_replace": 1}),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", {}),
    "qwen3_next": ("Qwen3NextConfig", {}),
    "kimi_linear": ("KimiLinearConfig", {"num_experts_per_tok": 8}),
    "deepseek_v4": ("DeepseekV4Config", {}),
}
# a 256-expert layer of DeepSeek-V3(.2) is 22.5 GB in bf16 (GLM-5's 19.3); Kimi-Linear's first
# latent-attention layer is its 5th; DeepSeek-V4-Flash's first compressed-sparse layer its 4th
LAYERS = {"deepseek_v3": 2, "deepseek_v32": 2, "glm_moe_dsa": 2, "kimi_linear": 5, "deepseek_v4": 4}


def write_config(folder: Path, family: str, layers: int) -> Path:
    import transformers

    name, overrides = FAMILIES[family]
    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_demo_tokenizer(folder)
    config = getattr(transformers, name)(**{**overrides, "num_hidden_layers": layers, "vocab_size": vocab})
    for per_layer in ("layer_types", "mlp_layer_types", "indexer_types"):
        if getattr(config, per_layer, None) is not None:
            setattr(config, per_layer, list(getattr(config, per_layer)[:layers]))
    config.dtype = "bfloat16"
    config.save_pretrained(folder)
    return folder


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second a copy on the device moves (read and write counted)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync_device(device)
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    sync_device(device)
    return 2 * src.numel() * 10 / (time.perf_counter() - t0)


def floor_bytes(engine: Engine, batch: int, context: int) -> float:
    """HBM bytes one decode step of `batch` rows at `context` positions reads (and writes, for states)."""
    model, cfg = engine.model, engine.config
    embed = model.model.embed_tokens.weight
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    dense -= embed.numel() * embed.element_size() - batch * embed[0].numel() * embed.element_size()
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    experts = sum(
        e * (1 - (1 - k / e) ** batch) * engine.pool.layer_expert_nbytes(layer) for layer in cfg.moe_layers
    )
    pool = engine.kv_pool
    kv_token = sum(t[0, :, 0].numel() * t.element_size() for t in (*pool.k, *pool.v))
    states = sum(2 * t[0].numel() * t.element_size() for tensors in pool.states.values() for t in tensors)
    return dense + experts + batch * (context * kv_token + states)


def time_steps(engine: Engine, batch: int, steps: int, path: str) -> float:
    """Seconds per decode step of `batch` fresh sequences (16 prompt tokens each): `eager` / `graph` the
    model's static step without / with graph replay."""
    decoder = engine.decoder
    engine.reserve_slots(batch)
    seqs = [engine.new_sequence() for _ in range(batch)]
    for i, seq in enumerate(seqs):
        engine.prefill(seq, [(7 * i + j) % 200 + 3 for j in range(16)])
    ids = [11 + i for i in range(batch)]

    def one() -> None:
        eager = "benchmark: the eager side" if path == "eager" else None
        decoder.step(ids, [s.kv.length for s in seqs], [s.kv.slot for s in seqs], "greedy", eager)
        for seq in seqs:
            seq.kv.advance(1)

    with torch.inference_mode():
        for _ in range(4):
            one()
        sync_device(engine.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            one()
        sync_device(engine.device)
        elapsed = (time.perf_counter() - t0) / steps
    for seq in seqs:
        seq.release()
    return elapsed


def run_family(
    family: str, layers: int, batches: list[int], steps: int, bandwidth: float, device: str
) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_config(Path(tmp) / family, family, layers)
        moe = MoeConfig("fused", reprofile=False)
        engine = Engine(EngineConfig(folder, device, "bfloat16", moe), weights=random_weights())
    uniform_routing(engine)
    rows = []
    try:
        for batch in batches:
            times = {path: time_steps(engine, batch, steps, path) for path in ("eager", "graph")}
            floor = floor_bytes(engine, batch, 16 + 4 + steps // 2) / bandwidth
            rows.append(
                dict(
                    family=family,
                    layers=layers,
                    batch=batch,
                    **{f"{path}_ms": 1e3 * t for path, t in times.items()},
                    floor_ms=1e3 * floor,
                    graph_over_floor=times["graph"] / floor,
                    graph_speedup=times["eager"] / times["graph"],
                    replays=engine.decoder.replays,
                )
            )
    finally:
        engine.close()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default=",".join(FAMILIES), help="a subset of: " + ", ".join(FAMILIES))
    ap.add_argument(
        "--layers", type=int, default=4, help="layers of each model (DeepSeek, GLM-5: 2; Kimi: 5)"
    )
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=32, help="measured decode steps per path")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the script")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    device = torch.device(args.device)
    bandwidth = copy_bandwidth(device)
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    for family in args.families.split(","):
        layers = LAYERS.get(family, args.layers)
        new = run_family(family, layers, batches, args.steps, bandwidth, args.device)
        rows += new
        if not args.json:
            for row in new:
                print(json.dumps(row), flush=True)
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if args.json:
        print(json.dumps({"card": card, "copy_gbps": bandwidth / 1e9, "rows": rows}, indent=2))
        return
    table = Table(title=f"decode step, every expert resident — {card}, copy {bandwidth / 1e9:.0f} GB/s")
    columns = ("family", "layers", "batch", "eager ms", "graph ms", "floor ms", "graph/floor", "eager/graph")
    for col in columns:
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["family"], str(r["layers"]), str(r["batch"]), f"{r['eager_ms']:.2f}", f"{r['graph_ms']:.3f}",
            f"{r['floor_ms']:.3f}", f"{r['graph_over_floor']:.2f}", f"{r['graph_speedup']:.1f}",
        )  # fmt: skip
    Console().print(table)


if __name__ == "__main__":
    main()
