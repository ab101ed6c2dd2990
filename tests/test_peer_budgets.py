"""The peer benchmark gives llama.cpp and FreeToken the same expert bytes: -ncmoe counts layers from the
first, dense ones included, while the cache ratio is over the MoE layers alone."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_budgets_split_the_moe_layers_alike() -> None:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from peer_llamacpp import budget_split
    finally:
        sys.path.remove(str(BENCHMARKS))
    assert budget_split(1.0, 24, 0) == (0, 0, 1.0)
    assert budget_split(0.375, 24, 0) == (15, 15, 0.375)  # Qwen3-30B-A3B-shaped: -ncmoe 15
    assert budget_split(0.0, 24, 0) == (24, 24, 0.0)
    assert budget_split(0.2, 8, 3) == (7, 4, 0.2)  # DeepSeek-V3 cut to 8: one of five MoE layers on the GPU
    assert budget_split(1.0, 8, 3) == (0, 0, 1.0)


def test_tensor_split_takes_the_nearest_share_from_the_first_tensors() -> None:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from peer_llamacpp import tensor_split
    finally:
        sys.path.remove(str(BENCHMARKS))
    five_layers = [(f"blk.{i // 3 + 3}.{k}", 100) for i, k in enumerate(["gate", "up", "down"] * 5)]
    names, ratio = tensor_split(0.11, five_layers)  # DeepSeek-V3 cut to 8: 2 of 15 tensors on the GPU
    assert names == tuple(n for n, _ in five_layers[:13]) and abs(ratio - 2 / 15) < 1e-12
    mixed = [("gate", 100), ("up", 100), ("down", 150)]  # Q4_K_M-like: a larger down tensor
    assert tensor_split(0.4, mixed) == (("gate", "up"), 150 / 350)
    assert tensor_split(1.0, mixed) == ((), 1.0) and tensor_split(0.0, mixed)[1] == 0.0


def test_best_against_best_takes_each_engines_fastest_thread_count() -> None:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from peer_llamacpp import best_against_best
    finally:
        sys.path.remove(str(BENCHMARKS))

    def row(budget: float, threads: int, peer: float, ours: float, backend: str = "cpu") -> dict:
        return {
            "budget": budget,
            "threads": threads,
            "llama_cpp": {"ncmoe": 24, "decode_tok_s": peer},
            "freetoken": {"moe_backend": backend, "cpu_int8_act": True, "decode_tok_s": ours},
        }

    rows = [row(0.0, 14, 118.0, 162.0), row(0.0, 16, 130.0, 157.0), row(0.375, 14, 176.0, 336.0, "hybrid")]
    best = {(b["budget"], b["engine"]): b for b in best_against_best(rows)}
    cpu = best[(0.0, "cpu+i8")]  # ours at 14 against llama.cpp at 16, not row by row
    assert (cpu["ours"], cpu["ours_threads"], cpu["peer"], cpu["peer_threads"]) == (162.0, 14, 130.0, 16)
    assert abs(cpu["ratio"] - 162.0 / 130.0) < 1e-12
    hybrid = best[(0.375, "hybrid+i8")]  # another budget's llama.cpp rows are not its peer
    assert (hybrid["peer"], hybrid["peer_threads"], hybrid["ours"]) == (176.0, 14, 336.0)
