"""Backends over the global slot cache: `offload`, `cpu` and `hybrid`.

Per MoE layer per step, with the routing read back once:
  hits    experts already in a slot: computed on the device from the slot bank;
  misses  m experts not resident, split by the mode:
            offload  fetch all of them (the layers in --moe-cpu-layers compute them on the CPU)
            cpu      compute all of them on the CPU (the slots keep their warm set)
            hybrid   fetch q = clamp(round(m·B_P/B_H), 1, min(m, max_fetch)), the CPU takes m − q
The CPU branch is launched first; fills run on the transfer stream while the hits compute; the fetched
experts compute after the fills land; partial sums are added (an exact merge: each pair counted once).
A prefill pass where streaming whole layers wins (prefill_plan) runs every layer from a LayerStreamer's
double buffers instead, with no routing read-back.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from freetoken.runtime.moe.cpu_branch import CpuBranch
from freetoken.runtime.moe.executor import ExecutorContext, ExpertExecutor
from freetoken.runtime.moe.experts import GATHER_MAX_PAIRS, routed_experts
from freetoken.runtime.moe.kernels.cpu_experts import cpu_experts
from freetoken.runtime.moe.layer_stream import LayerStreamer
from freetoken.runtime.moe.policy import choose_fetches, fetch_count
from freetoken.runtime.moe.prefill_plan import PrefillCosts
from freetoken.runtime.moe.slot_bank import SlotBank
from freetoken.runtime.moe.slot_cache import EMPTY, SlotCache


class CachedExecutor(ExpertExecutor):
    mode = "offload"

    def __init__(self, ctx: ExecutorContext, warm: bool = True) -> None:
        super().__init__(ctx)
        pool = ctx.pool
        self.cache = SlotCache(pool.layers, pool.num_experts, ctx.num_slots)
        self.bank = SlotBank(pool, ctx.num_slots + 1, ctx.device)  # the last slot is the probes' own
        self.cpu = CpuBranch(pool, ctx.device, ctx.moe.cpu_threads)
        gb = 1e9
        self.pcie_bw = ctx.moe.pcie_gbps * gb if ctx.moe.pcie_gbps else None
        self.host_bw = ctx.moe.host_gbps * gb if ctx.moe.host_gbps else None
        self.probes = 0
        self.streamer: LayerStreamer | None = None
        if warm:
            self._warm_up()

    def _warm_up(self) -> None:
        """Start with an equal share of every MoE layer resident (lowest expert ids), oldest first."""
        for slot, layer, expert in self.cache.warm_start():
            self.bank.fill(slot, layer, expert)
        self.bank.publish(self.cache.slot_of)
        event = self.bank.fills_done()
        if event is not None:
            event.synchronize()

    def fetch_budget(self, layer: int, misses: int) -> int:
        """How many of this step's misses to fetch; the rest go to the CPU."""
        if self.mode == "cpu" or layer in self.ctx.cpu_layers:
            return 0
        if self.mode == "offload":
            return misses
        moe = self.ctx.moe
        return fetch_count(misses, self.pcie_bw, self.host_bw, moe.hybrid_max_fetch, moe.fetch_correction)

    def prefill_costs(self) -> PrefillCosts:
        moe = self.ctx.moe
        return PrefillCosts(
            num_experts=self.pool.num_experts,
            top_k=self.ctx.num_experts_per_tok,
            expert_bytes=self.pool.expert_nbytes,
            pcie_bw=self.pcie_bw,
            host_bw=self.host_bw,
            host_batch_scale=moe.host_batch_scale,
            device_pairs_per_s=moe.device_pairs_per_s,
            mode=self.mode,
            hit_d2d=moe.prefill_hit_d2d,
        )

    def resident_per_layer(self) -> float:
        return float((self.cache.slot_of != EMPTY).sum()) / len(self.pool.layers)

    def begin_pass(self, tokens: int) -> None:
        """Stream whole layers through two buffers for this pass when --moe-prefill-stream and the
        measured costs say so (and the slots hold two full layers)."""
        moe = self.ctx.moe
        if tokens < 2 or moe.prefill_stream == "off" or self.cache.num_slots < 2 * self.pool.num_experts:
            return
        if moe.prefill_stream == "auto" and not self.prefill_costs().stream_wins(
            tokens, self.resident_per_layer()
        ):
            return
        self.streamer = LayerStreamer(self.cache, self.bank, moe.prefill_hit_d2d, moe.prefill_overlap)
        self.streamer.stage(self.pool.layers[0])  # behind the embedding and the first attention

    def end_pass(self) -> None:
        streamer, self.streamer = self.streamer, None
        if streamer is None:
            return
        streamer.finish(self._compute_stream())
        for layer, (pcie, d2d) in streamer.copies.items():
            self.counters.add(self.cache.row_of[layer], streamed=pcie, d2d=d2d)

    def _compute_stream(self) -> torch.cuda.Stream | None:
        return torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

    def _forward_streamed(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        assert self.streamer is not None
        stream = self._compute_stream()
        out = self._from_bank(x, self.streamer.acquire(layer, stream)[topk_ids], topk_weights)
        self.streamer.release(layer, stream)
        if self.cache.row_of[layer] == 0:
            self.counters.tokens += x.shape[0]
            self.counters.steps += 1
        return out

    def forward(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        if self.streamer is not None:
            return self._forward_streamed(layer, x, topk_ids, topk_weights)
        cache, row = self.cache, self.cache.row_of[layer]
        ids = topk_ids.cpu().numpy()  # [T, K]: the one routing read-back of this layer step
        weights = topk_weights.float().cpu().numpy()
        experts, inverse, counts = np.unique(ids, return_inverse=True, return_counts=True)
        inverse = inverse.reshape(ids.shape)
        weight_sums = np.bincount(inverse.ravel(), weights=weights.ravel(), minlength=len(experts))
        slots, hit = cache.demand(layer, experts)
        miss_idx = np.flatnonzero(~hit)
        q = min(self.fetch_budget(layer, len(miss_idx)), len(miss_idx))
        # Never evict this step's own experts; with more misses than free slots, the rest go to the CPU.
        q = min(q, cache.num_slots - int(hit.sum()))
        fetch = np.zeros(len(experts), dtype=bool)
        fetch[miss_idx[choose_fetches(experts[miss_idx], counts[miss_idx], weight_sums[miss_idx], q)]] = True
        on_cpu = ~hit & ~fetch

        # 1. CPU branch first: it has the farthest to go.
        partial = rows = None
        if on_cpu.any():
            pair_on_cpu = on_cpu[inverse]  # [T, K]
            rows_np = np.flatnonzero(pair_on_cpu.any(axis=1))
            rows = torch.from_numpy(rows_np)
            cpu_ids = torch.from_numpy(np.where(pair_on_cpu, ids, -1)[rows_np])
            alone = not hit.any() and not fetch.any()  # no GPU work to overlap: skip the thread hand-off
            partial = self.cpu.submit(
                layer, x, rows, cpu_ids, torch.from_numpy(weights[rows_np]), inline=alone
            )

        # 2. Fills into the least recently demanded slots, on the transfer stream.
        evictions = 0
        if fetch.any():
            victims, evictions = cache.admit_misses(layer, experts[fetch], protected=slots[hit])
            for slot, expert in zip(victims.tolist(), experts[fetch].tolist(), strict=True):
                self.bank.fill(slot, layer, expert)
            self.bank.publish(cache.slot_of)
        fills_done = self.bank.fills_done() if fetch.any() else None

        # 3. Hits compute now (the table rows they read were published before), fetched ones after fills.
        pair_hit = torch.from_numpy(hit[inverse]).to(x.device)
        pair_fetch = torch.from_numpy(fetch[inverse]).to(x.device)
        out = torch.zeros_like(x)
        if hit.any():
            out = out + self._from_slots(x, topk_ids, topk_weights, pair_hit, layer)
        if fills_done is not None:
            torch.cuda.current_stream(x.device).wait_event(fills_done)
        if fetch.any():
            out = out + self._from_slots(x, topk_ids, topk_weights, pair_fetch, layer)
        if partial is not None:
            assert rows is not None
            out = self.cpu.merge(out, rows, partial)

        counters = self.counters
        if row == 0:
            counters.tokens += x.shape[0]
            counters.steps += 1
        counters.add(
            row,
            hits=int(hit.sum()),
            misses=len(miss_idx),
            fills=int(fetch.sum()),
            evictions=evictions,
            cpu=int(on_cpu.sum()),
        )
        counters.last_q[row] = int(fetch.sum())
        return out

    def _from_slots(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        pairs: torch.Tensor,
        layer: int,
    ) -> torch.Tensor:
        """Sum over the (token, choice) pairs in `pairs` [T, K] bool, computed from the slot bank."""
        slot_ids = self.bank.table[self.cache.row_of[layer]][topk_ids].long()  # [T, K]
        return self._from_bank(x, torch.where(pairs, slot_ids, torch.full_like(slot_ids, -1)), topk_weights)

    def _from_bank(self, x: torch.Tensor, slot_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """The experts in slots `slot_ids` [T, K] (-1 = skip) for x [T, H], weighted."""
        if x.device.type == "cpu" or slot_ids.numel() > GATHER_MAX_PAIRS:
            slot_ids = slot_ids.cpu()  # grouping happens on the host anyway
        return routed_experts(x, slot_ids, topk_weights, self.bank.gate_up, self.bank.down)

    def probe(self) -> None:
        """One layer step's worth of experts on each path, folded into B_H and B_P (moving averages)."""
        pool, k = self.pool, min(self.ctx.num_experts_per_tok, self.pool.num_experts)
        rng = np.random.default_rng(self.probes)
        layer = int(rng.choice(pool.layers))
        experts = rng.choice(pool.num_experts, size=k, replace=False)
        x = torch.randn(1, pool.hidden_size)
        t0 = time.perf_counter()
        cpu_experts(
            x,
            torch.from_numpy(experts)[None],
            torch.full((1, k), 1.0 / k),
            pool.gate_up[layer],
            pool.down[layer],
            self.cpu.threads,
        )
        self.host_bw = _smooth(self.host_bw, k * pool.expert_nbytes / (time.perf_counter() - t0))
        if self.bank.stream is not None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(self.bank.stream)
            for expert in experts.tolist():
                self.bank.fill(self.cache.num_slots, layer, expert)
            end.record(self.bank.stream)
            end.synchronize()
            self.pcie_bw = _smooth(self.pcie_bw, k * pool.expert_nbytes / (start.elapsed_time(end) / 1e3))
        self.probes += 1

    def close(self) -> None:
        self.cpu.close()


def _smooth(old: float | None, new: float, weight: float = 0.2) -> float:
    return new if old is None else (1 - weight) * old + weight * new


class OffloadExecutor(CachedExecutor):
    name = mode = "offload"


class CpuMissExecutor(CachedExecutor):
    name = mode = "cpu"


class HybridExecutor(CachedExecutor):
    name = mode = "hybrid"
