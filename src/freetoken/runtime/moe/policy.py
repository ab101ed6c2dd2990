"""How many of a step's misses cross PCIe, and which: q* = m·B_P/B_H (see DESIGN.md, "The formulas").

Fill branch: q·S/B_P. CPU branch: (m−q)·S/(B_H−B_P), on the host bandwidth the DMA leaves. They
balance at q* = m·B_P/B_H; the expert size S cancels. With B_H <= B_P the CPU can never keep up:
fetch everything.
"""

from __future__ import annotations

import math


def fetch_fraction(pcie_bw: float | None, host_bw: float | None, correction: float = 1.0) -> float:
    """f = min(1, c·B_P/B_H), the share of a step's misses to fetch; unknown B_P -> 0 (all CPU), unknown
    B_H -> 1 (all fetched). c corrects the linear model by what `bench bw` measured with both branches
    running (measured best q/m over B_P/B_H at profiling time; 1 without a profile), so the measured
    split wins while the bandwidths, re-probed online, still move q with contention."""
    if pcie_bw is None or pcie_bw <= 0:
        return 0.0
    if host_bw is None:
        return 1.0
    return min(1.0, correction * pcie_bw / host_bw)


def quota(misses: int, fraction: float, max_fetch: int | None = None) -> int:
    """q = clamp(floor(m·f + 0.5), 1, max(1, min(m, max_fetch))) of a step's m misses, f from
    fetch_fraction; 0 if m == 0 or not f > 0. In Python floats (fp64), as the residency kernel
    (kernels/lru_ensure.py) computes it on the device: m·f is exact, then one rounding of + 0.5."""
    if misses <= 0 or not fraction > 0:
        return 0
    cap = misses if max_fetch is None else max(1, min(misses, max_fetch))
    return int(min(max(math.floor(misses * fraction + 0.5), 1), cap))
