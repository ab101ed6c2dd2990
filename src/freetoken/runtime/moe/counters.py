"""Expert cache counters, per MoE layer and per token."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# streamed / d2d: experts copied by prefill layer streaming over PCIe / on the device (its passes read no
# routing back, so they count no hits or misses).
FIELDS = ("hits", "misses", "fills", "evictions", "cpu", "streamed", "d2d")


@dataclass
class MoeCounters:
    moe_layers: tuple[int, ...]
    tokens: int = 0
    steps: int = 0
    by_layer: dict[str, np.ndarray] = field(default_factory=dict)  # name -> [L] int64
    last_q: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # [L] q of the last step

    def __post_init__(self) -> None:
        n = len(self.moe_layers)
        self.by_layer = {name: np.zeros(n, dtype=np.int64) for name in FIELDS}
        self.last_q = np.zeros(n, dtype=np.int64)

    def add(self, row: int, **counts: int) -> None:
        for name, value in counts.items():
            self.by_layer[name][row] += value

    def totals(self) -> dict[str, int]:
        return {name: int(values.sum()) for name, values in self.by_layer.items()}

    def per_token(self) -> dict[str, float]:
        """Totals over all MoE layers divided by tokens processed."""
        tokens = max(self.tokens, 1)
        return {name: value / tokens for name, value in self.totals().items()}

    def miss_rate(self) -> float:
        t = self.totals()
        demanded = t["hits"] + t["misses"]
        return t["misses"] / demanded if demanded else 0.0

    def reset(self) -> None:
        self.tokens = self.steps = 0
        for values in self.by_layer.values():
            values[:] = 0
        self.last_q[:] = 0

    def as_dict(self) -> dict[str, object]:
        return {
            "tokens": self.tokens,
            "steps": self.steps,
            "totals": self.totals(),
            "per_token": {k: round(v, 4) for k, v in self.per_token().items()},
            "miss_rate": round(self.miss_rate(), 4),
            "by_layer": {name: values.tolist() for name, values in self.by_layer.items()},
            "last_q": self.last_q.tolist(),
        }
