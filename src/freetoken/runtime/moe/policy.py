"""How many of a step's misses cross PCIe, and which: q* = m·B_P/B_H (see DESIGN.md, "The formulas").

Fill branch: q·S/B_P. CPU branch: (m−q)·S/(B_H−B_P), on the host bandwidth the DMA leaves. They
balance at q* = m·B_P/B_H; the expert size S cancels. With B_H <= B_P the CPU can never keep up:
fetch everything.
"""

from __future__ import annotations

import numpy as np


def fetch_count(
    misses: int,
    pcie_bw: float | None,
    host_bw: float | None,
    max_fetch: int | None = None,
    correction: float = 1.0,
) -> int:
    """q = clamp(round(m·c·B_P/B_H), 1, min(m, max_fetch)); no misses -> 0; unknown B_P -> 0 (all CPU).

    c corrects the linear model by what `bench bw` measured with both branches running (measured best
    q/m over B_P/B_H at profiling time; 1 without a profile), so the measured split wins while the
    bandwidths, re-probed online, still move q with contention. B_H <= B_P with c = 1: fetch all.
    """
    if misses <= 0:
        return 0
    cap = misses if max_fetch is None else max(1, min(misses, max_fetch))
    if pcie_bw is None or pcie_bw <= 0:
        return 0
    if host_bw is None:
        return cap
    fraction = min(1.0, correction * pcie_bw / host_bw)
    return int(min(max(round(misses * fraction), 1), cap))


def choose_fetches(
    misses: np.ndarray, token_counts: np.ndarray, weight_sums: np.ndarray, q: int
) -> np.ndarray:
    """Which q misses to fetch: the ones serving the most tokens, then the largest total router weight.

    More tokens means more GPU work saved per byte moved; between equals, the router's confidence is
    the best guess at which expert the next tokens will demand again, and a fetch stays resident.
    Returns a boolean mask over `misses`.
    """
    chosen = np.zeros(len(misses), dtype=bool)
    if q <= 0:
        return chosen
    order = np.lexsort((misses, -weight_sums, -token_counts))  # last key is the primary one
    chosen[order[:q]] = True
    return chosen
