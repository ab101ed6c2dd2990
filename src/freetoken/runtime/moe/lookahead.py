"""Router-lookahead prefetch: the next MoE layer's likely experts, fetched while this layer's work runs.

Co-routing counts, learned online on the device the slots are on: follow[r] [E, E] int32 counts the
token rows that chose expert e at MoE row r and e' at row r + 1 of the same pass (every pass teaches,
prefill and decode alike). After row r's step, the experts of row r + 1 with the highest count summed
over the step's distinct experts — at most `width`, each with a count > 0, ties to the lower id — go
through the residency's own LRU step as a prefetch (ExpertResidency.prefetch): those resident are
stamped as used, the others take the least recently used slots and are filled, before row r + 1's own
step finds them. Nothing is predicted across passes (the last row's step predicts nothing).

Plain torch with no host sync (graph-capturable); the same code on the cpu device is what `replay`'s
`lru-prefetch` policy runs, so the replayed and the engine's prefetches cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from freetoken.runtime.moe.pool import HostExpertPool
from freetoken.runtime.moe.residency import ExpertResidency
from freetoken.runtime.moe.slot_bank import SlotBank

FillFn = Callable[..., None]  # (plan, count, host gate_up, host down, device gate_up, device down)


class CoRouting:
    def __init__(self, rows: int, num_experts: int, width: int, device: torch.device | str) -> None:
        self.num_experts, self.width = num_experts, min(width, num_experts)
        shape = (max(rows - 1, 0), num_experts, num_experts)
        self.follow = torch.zeros(shape, dtype=torch.int32, device=device)  # [L - 1, E, E]
        # ties to the lower id: key = count · E + (E - 1 - id), unique per expert
        self._tiebreak = torch.arange(num_experts - 1, -1, -1, dtype=torch.int64, device=device)

    def learn(self, row: int, before: torch.Tensor, ids: torch.Tensor) -> None:
        """before [T, K'] the experts each token row chose at MoE row `row` - 1, ids [T, K] at `row`
        (-1: no pair); every (before, after) pair of one token row counts once."""
        e = self.num_experts
        a, b = before[:, :, None], ids[:, None, :]  # [T, K', 1], [T, 1, K]
        valid = ((a >= 0) & (b >= 0)).to(torch.int32)  # [T, K', K]
        keys = a.clamp(min=0) * e + b.clamp(min=0)  # [T, K', K]
        self.follow[row - 1].view(-1).index_add_(0, keys.reshape(-1), valid.reshape(-1))

    def predict(self, row: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [T, K] of MoE row `row` -> (experts [1, W] int64 of row + 1, -1 where none is predicted;
        scores [1, W] float32, their summed counts)."""
        e = self.num_experts
        present = torch.zeros(e, dtype=torch.int32, device=ids.device)
        flat = ids.reshape(-1)
        present.scatter_reduce_(0, flat.clamp(min=0), (flat >= 0).to(torch.int32), reduce="amax")  # [E]
        score = (self.follow[row] * present[:, None]).sum(0, dtype=torch.int64)  # [E], over distinct experts
        top = torch.topk(score * e + self._tiebreak, self.width).indices  # [W], best first
        best = score[top]
        experts = torch.where(best > 0, top, -1)
        return experts[None], best.to(torch.float32)[None]


def prefetch_next(
    co: CoRouting, residency: ExpertResidency, row: int, before: torch.Tensor | None, ids: torch.Tensor
) -> tuple[int, torch.Tensor, torch.Tensor] | None:
    """After MoE row `row`'s step (ids [T, K]): learn from `before` (row - 1's ids in this pass, or None),
    then admit row + 1's likely experts -> (that layer, plan, count) for the fill; None at the last row.
    What the executor runs (Prefetcher) and what `replay`'s `lru-prefetch` runs."""
    if before is not None:
        co.learn(row, before, ids)
    layers = residency.moe_layers
    if row + 1 >= len(layers):
        return None
    nxt = layers[row + 1]
    plan, count = residency.prefetch(nxt, *co.predict(row, ids))
    return nxt, plan, count


class Prefetcher:
    """Drives the prefetch for an executor: after each MoE layer step, learn, predict, admit and fill the
    next row's experts; on CUDA the fill runs on its own stream, forked after the step's work and joined
    by the next row's step before it fills or computes (its victims may be the prefetched slots)."""

    def __init__(
        self,
        residency: ExpertResidency,
        pool: HostExpertPool,
        bank: SlotBank,
        fill: FillFn,
        width: int,
        device: torch.device,
    ) -> None:
        self.residency, self.pool, self.bank, self.fill = residency, pool, bank, fill
        self.co = CoRouting(len(pool.layers), pool.num_experts, width, device)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._before: tuple[int, torch.Tensor] | None = None  # (row, ids) of this pass's last step
        self._pending: tuple[torch.Tensor, ...] = ()  # a forked fill's tensors, kept to its join

    def begin_pass(self) -> None:
        self._before = None

    def join(self) -> None:
        """Before a layer step fills or computes: the prefetch fill in flight has landed."""
        if self._pending and self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
        self._pending = ()

    def after(self, layer: int, ids: torch.Tensor) -> None:
        """`layer`'s step (routing `ids` [T, K]) is issued: learn from the pass so far, prefetch for the
        next MoE row."""
        row = self.residency.row_of[layer]
        before = self._before[1] if self._before is not None and self._before[0] == row - 1 else None
        self._before = (row, ids)
        step = prefetch_next(self.co, self.residency, row, before, ids)
        if step is None:
            return
        nxt, plan, count = step
        banks = (self.pool.gate_up[nxt], self.pool.down[nxt], *self.bank.banks(nxt))
        if self.stream is None:
            self.fill(plan, count, *banks)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            self.fill(plan, count, *banks)
        self._pending = (plan, count)
