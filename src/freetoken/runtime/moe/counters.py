"""Expert cache counters, per MoE layer and per token.

hits, misses, fills, evictions and cpu (distinct experts per layer step) — and prefetched, the experts
router-lookahead prefetches filled (lookahead.py), apart from the demand fills — are counted on the
device by the residency policy and read from there when reported (`attach`); streamed / d2d — experts
copied by prefill layer streaming over PCIe / on the device, whose passes read no routing, so they
count no hits or misses — are counted on the host.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

DEVICE_FIELDS = ("hits", "misses", "fills", "evictions", "cpu", "prefetched")
FIELDS = (*DEVICE_FIELDS, "streamed", "d2d")


@dataclass
class MoeCounters:
    moe_layers: tuple[int, ...]
    tokens: int = 0  # token rows through the MoE layers
    steps: int = 0  # forward passes
    host: dict[str, np.ndarray] = field(default_factory=dict)  # name -> [L] int64, counted here
    _device: Callable[[], np.ndarray] | None = field(default=None, repr=False)  # -> [L, 6] accumulated
    _baseline: np.ndarray | None = field(default=None, repr=False)  # the device counts at the last reset

    def __post_init__(self) -> None:
        self.host = {name: np.zeros(len(self.moe_layers), dtype=np.int64) for name in FIELDS}

    def attach(self, device_counts: Callable[[], np.ndarray]) -> None:
        """Read DEVICE_FIELDS from `device_counts` (columns in that order) from now on."""
        self._device = device_counts
        self._baseline = device_counts().copy()

    def add(self, row: int, **counts: int) -> None:
        for name, value in counts.items():
            self.host[name][row] += value

    def add_layers(self, **counts: np.ndarray) -> None:
        """Add [L] counts, one per MoE layer in order."""
        for name, values in counts.items():
            self.host[name] += values

    @property
    def by_layer(self) -> dict[str, np.ndarray]:
        """name -> [L] counts since the last reset (reads the device's: a sync)."""
        out = {name: values.copy() for name, values in self.host.items()}
        if self._device is not None and self._baseline is not None:
            counts = self._device() - self._baseline
            for column, name in enumerate(DEVICE_FIELDS):
                out[name] += counts[:, column]
        return out

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
        for values in self.host.values():
            values[:] = 0
        if self._device is not None:
            self._baseline = self._device().copy()

    def as_dict(self) -> dict[str, object]:
        by_layer = self.by_layer
        totals = {name: int(values.sum()) for name, values in by_layer.items()}
        tokens = max(self.tokens, 1)
        demanded = totals["hits"] + totals["misses"]
        return {
            "tokens": self.tokens,
            "steps": self.steps,
            "totals": totals,
            "per_token": {k: round(v / tokens, 4) for k, v in totals.items()},
            "miss_rate": round(totals["misses"] / demanded if demanded else 0.0, 4),
            "by_layer": {name: values.tolist() for name, values in by_layer.items()},
        }


def distinct_per_layer(ids: np.ndarray) -> np.ndarray:
    """ids [L, T, K] (-1: none) -> [L] the distinct expert ids >= 0 of each layer step."""
    flat = np.sort(ids.reshape(ids.shape[0], -1), axis=1)
    new = np.ones_like(flat, dtype=bool)
    new[:, 1:] = flat[:, 1:] != flat[:, :-1]
    return (new & (flat >= 0)).sum(axis=1)
