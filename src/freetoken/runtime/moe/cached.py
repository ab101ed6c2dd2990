"""Backends over the global slot cache: `offload`, `cpu` and `hybrid`.

Per MoE layer per step, the residency policy (residency.py: on the device, no host sync) sorts the
step's experts:
  hits    experts already in a slot: computed on the device from the slot bank;
  misses  m experts not resident, split by the mode:
            offload  fetch all of them (the layers in --moe-cpu-layers compute them on the CPU)
            cpu      compute all of them on the CPU (the slots keep their warm set)
            hybrid   fetch q = clamp(round(m·B_P/B_H), 1, min(m, max_fetch)), the CPU takes m − q
A decode step that fetches all its misses runs on the device alone: the policy's fill plan is carried
out by a gather kernel reading the pinned host pool (kernels/expert_fill.py), then the experts compute
from their slots — so it is captured in the decode step's CUDA graph. A decode step with a CPU share
hands the CPU's pairs over inside the stream (stream_branch.py: staged, flagged, computed by a native
coordinator, waited for and added), with the fills and the slots' pairs in between — captured too. Where
that branch is unavailable, and for larger steps, the step reads the policy's answer back once: the CPU
branch is launched first; fills run on the transfer stream (DMA) while the hits compute; the fetched
experts compute after the fills land; partial sums are added (an exact merge: each pair counted once).
A prefill pass where streaming whole layers wins (prefill_plan) runs every layer from a LayerStreamer's
double buffers instead, with no routing read-back (two layers' slots of the cache, or of a scratch bank
beside a smaller cache).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from freetoken.runtime.moe.counters import distinct_per_layer
from freetoken.runtime.moe.cpu_branch import CpuBranch
from freetoken.runtime.moe.executor import ExecutorContext, ExpertExecutor
from freetoken.runtime.moe.expert_fn import PairBias
from freetoken.runtime.moe.experts import GATHER_MAX_PAIRS, prefill_kernel_on, routed_experts
from freetoken.runtime.moe.kernels.cpu_experts import bf16_activations, cpu_experts
from freetoken.runtime.moe.kernels.expert_fill import fill_slots, fill_slots_reference
from freetoken.runtime.moe.kernels.hand_over import DistinctCount
from freetoken.runtime.moe.kernels.moe_decode import MAX_DECODE_TOKENS
from freetoken.runtime.moe.layer_stream import LayerStreamer, scratch_bank
from freetoken.runtime.moe.lookahead import Prefetcher
from freetoken.runtime.moe.policy import fetch_fraction
from freetoken.runtime.moe.prefill_plan import PrefillCosts
from freetoken.runtime.moe.residency import COUNTER_NAMES, ExpertResidency
from freetoken.runtime.moe.slot_bank import PROBE_SLOTS, SlotBank
from freetoken.runtime.moe.stream_branch import StreamBranch

log = logging.getLogger(__name__)


class CachedExecutor(ExpertExecutor):
    mode = "offload"

    def __init__(self, ctx: ExecutorContext, warm: bool = True) -> None:
        super().__init__(ctx)
        pool = ctx.pool
        self.residency = ExpertResidency(pool.layers, pool.num_experts, ctx.num_slots, ctx.device)
        self.bank = SlotBank(pool, ctx.num_slots + PROBE_SLOTS, ctx.device)  # the last: the probes' own
        asked = ctx.moe.cpu_threads and min(ctx.moe.cpu_threads, torch.get_num_threads())  # clamped there
        self.cpu = CpuBranch(pool, ctx.device, asked, ctx.moe.cpu_int8_act)
        self._branch_threads = self.cpu.threads  # the most it takes
        gb = 1e9
        self.pcie_bw = ctx.moe.pcie_gbps * gb if ctx.moe.pcie_gbps else None
        self.host_bw = ctx.moe.host_gbps * gb if ctx.moe.host_gbps else None
        self.probes = 0
        self.streamer: LayerStreamer | None = None
        self.scratch: SlotBank | None = None  # two layers' buffers for streaming beside a smaller cache
        self._fill = fill_slots if ctx.device.type == "cuda" else fill_slots_reference
        prefetch = ctx.moe.prefetch and self.mode in ("offload", "hybrid") and ctx.num_slots > 0
        self.prefetcher = (
            Prefetcher(self.residency, pool, self.bank, self._fill, ctx.moe.prefetch, ctx.device)
            if prefetch
            else None
        )
        self.counters.attach(self.residency.read_counters)
        self._set_fetch()
        self.stream_branch: StreamBranch | None = None
        self.stream_off: str | None = None  # why decode steps with CPU work read routing back instead
        self._start_stream_branch()
        if warm:
            self._warm_up()
        self._measure_unknown_bandwidths()

    def _measure_unknown_bandwidths(self) -> None:
        """On CUDA with B_P or B_H unknown (no `bench bw` profile here, no flag): hybrid's q* needs both,
        and every mode's choice to stream a prompt's layers (prefill_plan) does, so they are measured now
        through the runtime's own paths (a warm-up probe, then a counted one) rather than leaving every
        miss to the CPU and every prompt unstreamed. A bandwidth given by flag stays as given."""
        if self.bank.stream is None:
            return
        given = (self.pcie_bw, self.host_bw)
        if None not in given:
            return
        for _ in range(2):
            self.pcie_bw, self.host_bw = given
            self.probe()
        self.pcie_bw = given[0] or self.pcie_bw
        self.host_bw = given[1] or self.host_bw
        self._set_fetch()
        log.info(
            "%s: no bandwidth profile; measured B_P %.1f GB/s, B_H %.1f GB/s (run `freetoken bench bw`)",
            self.mode, (self.pcie_bw or 0) / 1e9, (self.host_bw or 0) / 1e9,
        )  # fmt: skip

    def _start_stream_branch(self) -> None:
        """The stream branch, once a decode step can leave pairs to the CPU."""
        if self.stream_branch is not None or self.stream_off is not None or not self._needs_stream_branch():
            return
        branch = None
        try:
            branch = StreamBranch(
                self.pool, self.device, self.ctx.num_experts_per_tok, MAX_DECODE_TOKENS, self.cpu.threads,
                self.ctx.moe.cpu_int8_act,
            )  # fmt: skip
            branch.check()
        except RuntimeError as exc:
            self.stream_off = str(exc)
            if branch is not None:
                branch.close()
            return
        self.stream_branch = branch

    def _needs_stream_branch(self) -> bool:
        """Whether a decode step can leave pairs to the CPU (the cpu device with no slot has its native
        step and the inline path instead)."""
        if self.residency.num_slots == 0:
            return self.device.type == "cuda"
        pairs = MAX_DECODE_TOKENS * self.ctx.num_experts_per_tok
        return any(not self._device_alone(layer, pairs) for layer in self.pool.layers)

    def _in_stream(self, rows: int) -> bool:
        """Whether a step of `rows` hands its CPU pairs over inside the stream."""
        branch = self.stream_branch
        return branch is not None and self.stream_off is None and rows <= branch.max_rows

    def _warm_up(self) -> None:
        """Start with an equal share of every MoE layer resident (lowest expert ids), oldest first."""
        self._fill_placed(self.residency.warm_start())

    def _fill_placed(self, placed: list[tuple[int, int, int]]) -> None:
        """Copy (slot, layer, expert) placements from the pool and wait for them."""
        for slot, layer, expert in placed:
            self.bank.fill(slot, layer, expert)
        event = self.bank.fills_done()
        if event is not None:
            event.synchronize()

    def resize_slots(self, num_slots: int) -> None:
        """At a safe point: `num_slots` slots; the most recently used experts stay, filled again from the
        pool into new banks (the old banks are freed first)."""
        placed = self.residency.resize(num_slots)
        self.bank.reallocate(num_slots + PROBE_SLOTS)  # the last slot is the probes' own
        self.ctx.num_slots = num_slots
        if num_slots >= 2 * self.pool.num_experts:
            self.scratch = None  # the cache holds the buffers now
        self._fill_placed(placed)
        self._start_stream_branch()  # fewer slots than a step's pairs: overflow goes to the CPU

    def set_cpu_threads(self, threads: int) -> None:
        self.cpu.threads = max(1, min(self._branch_threads, threads))
        if self.stream_branch is not None:
            self.stream_branch.set_threads(self.cpu.threads)

    def host_threads(self) -> int:
        return self.cpu.threads if self.mode != "offload" or self.ctx.cpu_layers else 0

    def fetches_all(self, layer: int) -> bool:
        """Whether every miss of `layer` is fetched (no CPU share: the step needs no read-back)."""
        return self.mode == "offload" and layer not in self.ctx.cpu_layers

    def _set_fetch(self) -> None:
        """The policy's per-layer fetch fractions from the current B_P and B_H (a safe point)."""
        moe = self.ctx.moe
        hybrid = fetch_fraction(self.pcie_bw, self.host_bw, moe.fetch_correction)
        fractions = []
        for layer in self.pool.layers:
            if self.fetches_all(layer):
                fractions.append(1.0)
            elif self.mode == "hybrid" and layer not in self.ctx.cpu_layers:
                fractions.append(hybrid)
            else:
                fractions.append(0.0)
        self.residency.set_fetch(fractions, moe.hybrid_max_fetch if self.mode == "hybrid" else None)

    def _device_alone(self, layer: int, pairs: int) -> bool:
        """Whether a layer step of `pairs` (token, choice) pairs runs with no read-back: every miss is
        fetched (the slots can take all of a step's distinct experts) by the fill kernel (few tokens)."""
        small = pairs <= MAX_DECODE_TOKENS * self.ctx.num_experts_per_tok
        return self.fetches_all(layer) and small and pairs <= self.residency.num_slots

    def graph_blocker(self, rows: int) -> str | None:
        stored = self.stored_blocker()
        if stored is not None:
            return stored
        if self._in_stream(rows):
            return None
        if self.stream_off is not None:
            return f"the CPU branch cannot run inside the step ({self.stream_off})"
        if self.mode != "offload":
            return f"the {self.mode} backend computes misses on the CPU"
        if self.ctx.cpu_layers:
            return "--moe-cpu-layers compute misses on the CPU"
        pairs = rows * self.ctx.num_experts_per_tok  # every layer fetches all (checked above): one test
        if not self._device_alone(self.pool.layers[0], pairs):
            return f"a step of {rows} rows may have more misses than the {self.residency.num_slots} slots"
        return None

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
        return self.residency.resident_count() / len(self.pool.layers)

    def begin_pass(self, tokens: int, rows: int) -> None:
        """Count the pass; stream whole layers through two buffers for it when --moe-prefill-stream and
        the measured costs say so (and the slots hold two full layers)."""
        self.counters.tokens += rows
        self.counters.steps += 1
        if self.prefetcher is not None:
            self.prefetcher.begin_pass()
        moe = self.ctx.moe
        if tokens < 2 or moe.prefill_stream == "off":
            return
        in_cache = self.residency.num_slots >= 2 * self.pool.num_experts
        resident = self.resident_per_layer() if in_cache else 0.0  # the scratch bank copies every expert
        if moe.prefill_stream == "auto" and not self.prefill_costs().stream_wins(tokens, resident):
            return
        scratch = None
        if not in_cache:
            if moe.vram_budget is not None:  # a scratch bank would overstep the budget that sized the slots
                self.scratch = None
                return
            if self.scratch is None:
                self.scratch = scratch_bank(self.pool, self.device)
            if self.scratch is None:
                return
            scratch = self.scratch
        hit_d2d, overlap = moe.prefill_hit_d2d, moe.prefill_overlap
        self.streamer = LayerStreamer(self.residency, self.bank, hit_d2d, overlap, scratch)
        self.streamer.stage(self.pool.layers[0])  # behind the embedding and the first attention

    def end_pass(self) -> None:
        self._check_stream_branch()
        streamer, self.streamer = self.streamer, None
        if streamer is None:
            return
        streamer.finish(self._compute_stream())
        for layer, (pcie, d2d) in streamer.copies.items():
            self.counters.add(self.residency.row_of[layer], streamed=pcie, d2d=d2d)

    def _check_stream_branch(self) -> None:
        """After a pass: a CPU branch that died in it voids the pass (its hand-overs were answered with
        no result); later steps read routing back."""
        if self.stream_branch is None or self.stream_off is not None:
            return
        why = self.stream_branch.failure()
        if why is not None:
            self.stream_off = why
            raise RuntimeError(f"{why}: this step's results are void; later steps read routing back")

    def _compute_stream(self) -> torch.cuda.Stream | None:
        return torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

    def _forward_streamed(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        assert self.streamer is not None
        stream = self._compute_stream()
        slot_ids = self.streamer.acquire(layer, stream)[topk_ids]
        bias = self.pair_bias(layer, topk_ids)
        out = self._from_bank(layer, x, slot_ids, topk_weights, bias, self.streamer.bank)
        self.streamer.release(layer, stream)
        return out

    def compute(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        if self.streamer is not None:
            return self._forward_streamed(layer, x, topk_ids, topk_weights)
        in_stream = self._in_stream(x.shape[0])
        if self.residency.num_slots == 0:
            if in_stream:
                return self._forward_all_handed_over(layer, x, topk_ids, topk_weights)
            return self._forward_from_pool(layer, x, topk_ids, topk_weights)
        slot_ids, plan, count = self.residency.ensure(layer, topk_ids, topk_weights)
        if self.prefetcher is None:
            return self._from_slots(layer, x, topk_ids, topk_weights, slot_ids, plan, count, in_stream)
        self.prefetcher.join()  # a prefetch fill in flight may be into this step's slots
        out = self._from_slots(layer, x, topk_ids, topk_weights, slot_ids, plan, count, in_stream)
        self.prefetcher.after(layer, topk_ids)
        return out

    def _from_slots(
        self,
        layer: int,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        slot_ids: torch.Tensor,
        plan: torch.Tensor,
        count: torch.Tensor,
        in_stream: bool,
    ) -> torch.Tensor:
        """The layer step after the policy's: fills, the slots' pairs, the CPU's share, merged."""
        pool, bank = self.pool, self.bank
        bias = self.pair_bias(layer, topk_ids)
        if self._device_alone(layer, topk_ids.numel()):
            self._fill(plan, count, pool.gate_up[layer], pool.down[layer], *bank.banks(layer))
            return self._from_bank(layer, x, slot_ids, topk_weights, bias)
        if in_stream:  # CPU pairs handed over, fills and the slots' pairs meanwhile, then the merge
            assert self.stream_branch is not None
            cpu_ids = torch.where(slot_ids < 0, topk_ids, -1)
            self.stream_branch.submit(layer, x, cpu_ids, topk_weights)
            self._fill(plan, count, pool.gate_up[layer], pool.down[layer], *bank.banks(layer))
            return self.stream_branch.merge(self._from_bank(layer, x, slot_ids, topk_weights, bias))
        return self._forward_read_back(
            layer, x, topk_ids, topk_weights, slot_ids, plan[: int(count.item())], bias
        )

    def _forward_all_handed_over(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """No slot: every pair handed over to the CPU inside the stream; misses counted on the device."""
        assert self.stream_branch is not None
        row = self.residency.counters[self.residency.row_of[layer]]
        cols = (COUNTER_NAMES.index("misses"), COUNTER_NAMES.index("cpu"))
        count = DistinctCount(row, cols, self.pool.num_experts)
        self.stream_branch.submit(layer, x, topk_ids, topk_weights, count)
        return self.stream_branch.merge(torch.empty_like(x), out_is_zero=True)

    def _forward_from_pool(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """No slot at all (`cpu` with none): every pair on the CPU from the pool, no policy step."""
        ids = topk_ids.cpu()
        distinct = int(distinct_per_layer(ids.numpy()[None])[0])
        self.counters.add(self.residency.row_of[layer], misses=distinct, cpu=distinct)
        rows = torch.arange(x.shape[0])
        partial = self.cpu.submit(layer, x, rows, ids, topk_weights.float().cpu(), inline=True)
        return partial.result().to(x.device, x.dtype, copy=True)  # the result is the branch's staging

    def host_banks(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]] | None:
        if self.device.type != "cpu" or self.residency.num_slots or self.streamer is not None:
            return None
        return {layer: (self.pool.gate_up[layer], self.pool.down[layer]) for layer in self.pool.layers}

    def cpu_threads(self) -> int:
        return self.cpu.threads

    def count_host_steps(self, distinct: np.ndarray) -> None:
        """As `_forward_from_pool` counts: every distinct expert a miss computed on the CPU."""
        self.counters.add_layers(misses=distinct, cpu=distinct)

    def _forward_read_back(
        self,
        layer: int,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        slot_ids: torch.Tensor,
        plan: torch.Tensor,
        bias: PairBias | None,
    ) -> torch.Tensor:
        """The step with the policy's answer on the host: CPU branch, DMA fills, hits, fetched, merge.
        Reading `count` synced the compute stream, so no earlier step still reads a victim slot."""
        ids = topk_ids.cpu().numpy()  # [T, K]
        slots = slot_ids.cpu().numpy()  # [T, K]
        fills = plan.cpu().numpy()  # [q, 2] (expert, slot)
        on_cpu = (slots < 0) & (ids >= 0)
        fetched = np.isin(slots, fills[:, 1]) & (slots >= 0)
        hit = (slots >= 0) & ~fetched

        # 1. CPU branch first: it has the farthest to go.
        partial = rows = None
        if on_cpu.any():
            rows_np = np.flatnonzero(on_cpu.any(axis=1))
            rows = torch.from_numpy(rows_np)
            cpu_ids = torch.from_numpy(np.where(on_cpu, ids, -1)[rows_np])
            weights = topk_weights.float().cpu()[rows]
            alone = not (slots >= 0).any()  # no GPU work to overlap: skip the thread hand-off
            partial = self.cpu.submit(layer, x, rows, cpu_ids, weights, inline=alone)

        # 2. Fills on the transfer stream, into the victims the policy chose.
        for expert, slot in fills.tolist():
            self.bank.fill(slot, layer, expert)
        fills_done = self.bank.fills_done() if len(fills) else None

        # 3. Hits compute now, fetched ones after their fills.
        out = torch.zeros_like(x)
        if hit.any():
            out = out + self._from_bank(layer, x, self._only(slot_ids, hit), topk_weights, bias)
        if fills_done is not None:
            torch.cuda.current_stream(x.device).wait_event(fills_done)
        if fetched.any():
            out = out + self._from_bank(layer, x, self._only(slot_ids, fetched), topk_weights, bias)
        if partial is not None:
            assert rows is not None
            out = self.cpu.merge(out, rows, partial)
        return out

    @staticmethod
    def _only(slot_ids: torch.Tensor, pairs: np.ndarray) -> torch.Tensor:
        """slot_ids [T, K] with the pairs outside `pairs` [T, K] bool set to -1 (skipped)."""
        keep = torch.from_numpy(pairs).to(slot_ids.device)
        return torch.where(keep, slot_ids, -1)

    def _from_bank(
        self,
        layer: int,
        x: torch.Tensor,
        slot_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        bias: PairBias | None = None,
        bank: SlotBank | None = None,
    ) -> torch.Tensor:
        """`layer`'s experts in slots `slot_ids` [T, K] (-1 = skip) of `bank` (default: the cache's) for
        x [T, H], weighted; `bias`: their gate/up biases, by expert id."""
        if x.device.type == "cpu" or (slot_ids.numel() > GATHER_MAX_PAIRS and not prefill_kernel_on()):
            slot_ids = slot_ids.cpu()  # grouping happens on the host anyway
        bank = bank or self.bank
        gate_up, down = bank.banks(layer)
        return routed_experts(x, slot_ids, topk_weights, gate_up, down, self.fn, bias, bank.codecs(layer))

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
            codecs=pool.codec_names(layer),
            int8_act=self.cpu.int8_act,
            fn=pool.fn,
            gate_up_bias=pool.gate_up_bias.get(layer),
            bf16_act=bf16_activations(pool.dtype),
        )
        self.host_bw = _smooth(self.host_bw, k * pool.expert_nbytes / (time.perf_counter() - t0))
        if self.bank.stream is not None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(self.bank.stream)
            for expert in experts.tolist():
                self.bank.fill(self.residency.num_slots, layer, expert)
            end.record(self.bank.stream)
            end.synchronize()
            self.pcie_bw = _smooth(self.pcie_bw, k * pool.expert_nbytes / (start.elapsed_time(end) / 1e3))
        self.probes += 1
        self._set_fetch()

    def close(self) -> None:
        self.scratch = None
        self.cpu.close()
        if self.stream_branch is not None:
            self.stream_branch.close()


def _smooth(old: float | None, new: float, weight: float = 0.2) -> float:
    return new if old is None else (1 - weight) * old + weight * new


class OffloadExecutor(CachedExecutor):
    name = mode = "offload"


class CpuMissExecutor(CachedExecutor):
    name = mode = "cpu"


class HybridExecutor(CachedExecutor):
    name = mode = "hybrid"
