"""When a prefill chunk streams whole expert layers instead of serving its misses on demand.

Per MoE layer, for a chunk of T tokens routed top-k over E experts, S the bytes of one expert and r the
experts of the layer resident now:
  routed experts            u = E·(1 − (1 − k/E)^T)      independent routing: no locality assumed
  tokens per routed expert  n = T·k / u
  misses                    m = u·(1 − r/E)
  GPU expert compute        C = T·k / R_D                R_D: (token, expert) pairs per second on the device
  on demand                 m·S / B_od + C               the fills wait for routing, the compute for fills
                            B_od = B_P (offload), B_H(n) (cpu), B_P + B_H(n) (hybrid)
  streamed                  max(E'·S / B_P, C)           the next layer's copy runs behind this compute
                            E' = E − r with --moe-prefill-hit-d2d (hits copied on the device), else E
Streaming wins when its time is at most the on-demand time; the crossover T* is the smallest such T. B_P, B_H
at a few batch sizes and R_D come from `freetoken bench bw`; B_H(n) beyond the largest measured batch falls as
1/n (compute-bound), and without a measured R_D, C is taken as 0 (which favours on-demand).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillCosts:
    """Machine and model numbers the choice is made from (bandwidths in bytes/s)."""

    num_experts: int
    top_k: int
    expert_bytes: int
    pcie_bw: float | None
    host_bw: float | None
    host_batch_scale: Sequence[tuple[int, float]] = ()  # (tokens per expert, B_H(n)/B_H(1)), n ascending
    device_pairs_per_s: float | None = None
    mode: str = "offload"  # offload | cpu | hybrid
    hit_d2d: bool = False

    def host_bw_at(self, n: float) -> float:
        """B_H(n): piecewise linear in log n over the measured batches, 1/n beyond the last."""
        if not self.host_bw:
            return 0.0
        points = list(self.host_batch_scale) or [(1, 1.0)]
        if n <= points[0][0]:
            return self.host_bw * points[0][1]
        for (n0, s0), (n1, s1) in itertools.pairwise(points):
            if n <= n1:
                t = (math.log(n) - math.log(n0)) / (math.log(n1) - math.log(n0))
                return self.host_bw * (s0 + t * (s1 - s0))
        n_last, s_last = points[-1]
        return self.host_bw * s_last * n_last / n

    def routed(self, tokens: int) -> float:
        e, k = self.num_experts, self.top_k
        return e * (1.0 - (1.0 - k / e) ** tokens)

    def on_demand_s(self, tokens: int, resident: float) -> float:
        u = self.routed(tokens)
        misses = u * (1.0 - resident / self.num_experts)
        per_expert = tokens * self.top_k / max(u, 1.0)
        b_p = self.pcie_bw or 0.0
        b_h = self.host_bw_at(per_expert)
        bandwidth = {"offload": b_p, "cpu": b_h, "hybrid": b_p + b_h}[self.mode]
        if bandwidth <= 0:
            return math.inf
        return misses * self.expert_bytes / bandwidth + self.compute_s(tokens)

    def stream_s(self, tokens: int, resident: float) -> float:
        if not self.pcie_bw:
            return math.inf
        copied = self.num_experts - (resident if self.hit_d2d else 0.0)
        return max(copied * self.expert_bytes / self.pcie_bw, self.compute_s(tokens))

    def compute_s(self, tokens: int) -> float:
        return tokens * self.top_k / self.device_pairs_per_s if self.device_pairs_per_s else 0.0

    def stream_wins(self, tokens: int, resident: float) -> bool:
        stream = self.stream_s(tokens, resident)
        return tokens > 1 and math.isfinite(stream) and stream <= self.on_demand_s(tokens, resident)

    def crossover(self, resident: float, limit: int = 1 << 20) -> int | None:
        """The smallest chunk (tokens) that streams, or None when none up to `limit` does."""
        if not self.stream_wins(limit, resident):
            return None
        lo, hi = 1, limit  # stream_wins(lo) is False, stream_wins(hi) is True; the costs are monotone in T
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if self.stream_wins(mid, resident) else (mid, hi)
        return hi
