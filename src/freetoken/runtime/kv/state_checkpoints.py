"""Recurrent-state checkpoints of the cached sequence, so an edited context resumes instead of restarting.

A recurrent layer's state is the whole prefix compressed; it cannot be rewound. A checkpoint is a copy of
every DeltaNet layer's state at one position p (the K/V of the attention layers is a prefix of the cache
and needs no copy). A request whose common prefix with the cached sequence is L resumes from the deepest
checkpoint at p <= L and re-prefills only [p, end).

Where checkpoints are taken (`policy`):
  anchors   the semantic anchors of runtime/text/anchors.py: before block openers, after block closers
  interval  every `interval` positions (the fixed spacing other engines use), for comparison
  none      nowhere: a request that does not extend the cached sequence re-prefills from the start
Only `budget` fit. Eviction drops the checkpoint that covers least: the one nearest the checkpoint
before it (an edit between the two costs at most that gap), the gap weighed down with age by
1/sqrt(distance from the newest + 64). What stays is spread over the context and denser towards its
end, where harnesses edit: the previous assistant turn (re-rendered without its thinking) and tool
outputs leaving a recent window. Measured on the three harness patterns (benchmarks/checkpoints.py, 8
checkpoints) against keeping the newest checkpoint of each anchor kind and spreading the rest evenly:
re-prefilled / new suffix 1.050 / 1.088 / 1.082 against 1.006 / 1.180 / 1.138; with 16, 1.007 / 1.018 /
1.016 against 1.006 / 1.044 / 1.041.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from freetoken.runtime.models.delta_net import LinearState
from freetoken.runtime.text.anchors import AnchorTable

POLICIES = ("anchors", "interval", "none")
AGE_SCALE = 64  # tokens: below it, age barely weighs


@dataclass
class Checkpoint:
    position: int
    kind: str
    states: dict[int, LinearState]  # layer -> state after tokens [0, position)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.states.values())


class StateCheckpoints:
    def __init__(
        self, anchors: AnchorTable, budget: int = 16, policy: str = "anchors", interval: int = 64
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"checkpoint policy {policy!r}: expected one of {', '.join(POLICIES)}")
        self.anchors, self.budget, self.policy, self.interval = anchors, budget, policy, interval
        self.saved: dict[int, Checkpoint] = {}  # position -> checkpoint

    @property
    def lookback(self) -> int:
        """Tokens before `start` that `positions` needs to see (a marker may begin before it)."""
        return max((len(m) for m, _, _ in self.anchors.markers), default=1)

    def positions(self, ids: Sequence[int], start: int, end: int, offset: int = 0) -> dict[int, str]:
        """Checkpoint positions p in [start, end], with their kind. ids[i] is the token at position
        offset + i; they cover [max(0, start − lookback), end) at least."""
        if self.budget <= 0 or self.policy == "none":
            return {}
        if self.policy == "interval":
            first = -(-max(start, 1) // self.interval) * self.interval
            return {p: "interval" for p in range(first, end + 1, self.interval)}
        longest = self.lookback
        found = self.anchors.find(ids[: end - offset + longest], max(0, start - longest - offset))
        return {
            a.position + offset: f"{a.kind}:{a.edge}" for a in found if start <= a.position + offset <= end
        }

    def save(self, position: int, kind: str, states: dict[int, LinearState], owned: bool = False) -> None:
        """Keep the states after [0, position) (copied, unless `owned`: then they are taken over)."""
        if self.budget <= 0:
            return
        kept = states if owned else {layer: s.clone() for layer, s in states.items()}
        self.saved[position] = Checkpoint(position, kind, kept)
        while len(self.saved) > self.budget:
            del self.saved[self._victim()]

    def _victim(self) -> int:
        return choose_victim(self.saved)

    def best(self, limit: int) -> Checkpoint | None:
        """The deepest checkpoint at or before `limit`."""
        fitting = [p for p in self.saved if p <= limit]
        return self.saved[max(fitting)] if fitting else None

    def drop_after(self, position: int) -> None:
        """The cached sequence now ends at `position`: checkpoints past it described another continuation."""
        for p in [p for p in self.saved if p > position]:
            del self.saved[p]

    def clear(self) -> None:
        self.saved.clear()

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.saved.values())


def choose_victim(saved: dict[int, Checkpoint]) -> int:
    """The position to drop from `saved` (positions along one sequence) when one must go: the least
    gap to the checkpoint before it, weighed by 1/sqrt(distance from the newest + AGE_SCALE)."""
    order = sorted(saved)
    end = order[-1]
    scores = [
        ((p - prev) / math.sqrt(end - p + AGE_SCALE), p) for prev, p in zip([0, *order], order, strict=False)
    ]
    return min(scores)[1]
