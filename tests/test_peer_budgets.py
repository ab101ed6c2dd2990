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
