"""Measure B_P, B_H and their overlap on this machine, through the runtime's own code paths.

B_P: expert fills from a pinned pool into device slots (SlotBank.fill, the transfer stream).
B_H: the CPU expert kernel at batch 1 on real expert shapes (cpu_experts, the configured threads).
Both at once: q fills and m − q CPU experts issued together, as hybrid does, for every q: through the
path a captured decode step takes where it runs here (the gather kernel's fills, the CPU branch handed
over in the stream), else through the read-back one (SlotBank.fill, CpuBranch).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from freetoken.errors import FreeTokenError
from freetoken.runtime.devices import sync_device
from freetoken.runtime.measure.profile import BandwidthProfile, current_versions, this_machine
from freetoken.runtime.models import load_model_config
from freetoken.runtime.moe.cpu_branch import CpuBranch
from freetoken.runtime.moe.experts import routed_experts
from freetoken.runtime.moe.kernels.cpu_experts import (
    beyond_cache_bytes,
    bf16_activations,
    branch_threads,
    cpu_experts,
    kernel_available,
    read_bandwidth,
)
from freetoken.runtime.moe.kernels.expert_fill import fill_kernel_available, fill_slots
from freetoken.runtime.moe.pool import HUGE_PAGES, HostExpertPool
from freetoken.runtime.moe.slot_bank import SlotBank
from freetoken.runtime.moe.stream_branch import StreamBranch


@dataclass(frozen=True)
class ExpertShape:
    hidden: int
    intermediate: int
    top_k: int
    num_experts: int

    @property
    def nbytes(self) -> int:  # bf16
        return 3 * self.hidden * self.intermediate * 2


READ_ROUNDS = 3
HOST_REPS = 20  # calls per B_H measurement: one is a millisecond, and a shared host needs a good sample
HOST_BATCHES = (4, 16, 64)  # tokens per expert at which B_H is measured besides 1 (prefill chunks)

PRESETS = {
    "qwen3-30b-a3b": ExpertShape(2048, 768, 8, 128),
    "qwen3-235b-a22b": ExpertShape(4096, 1536, 8, 128),
    "qwen3.6-35b-a3b": ExpertShape(2048, 512, 8, 256),
    "demo": ExpertShape(256, 128, 4, 32),
}


def shape_from_model(path: str) -> ExpertShape:
    from pathlib import Path

    folder = Path(path)
    if folder.is_file():
        folder = folder.parent
    cfg = load_model_config(folder)
    if not cfg.moe_layers:
        raise FreeTokenError(f"{path}: the model has no MoE layers to measure")
    return ExpertShape(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok, cfg.num_experts)


def _timed(fn: Callable[[], object], reps: int, sync: Callable[[], None]) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


class Bench:
    """One measurement session over a bf16 expert pool larger than the last-level cache."""

    def __init__(
        self,
        shape: ExpertShape,
        threads: int,
        bank_bytes: int | None = None,
        reps: int = 5,
        pin: bool = True,
        huge_pages: bool = HUGE_PAGES,
    ) -> None:
        self.shape, self.threads, self.reps = shape, threads, reps
        bank_bytes = bank_bytes or beyond_cache_bytes()
        # More experts than the model has where needed: the pool is synthetic, and must not fit in a cache.
        experts = max(2 * shape.top_k, -(-bank_bytes // shape.nbytes))
        self.pool = HostExpertPool.allocate(
            (0,), experts, shape.hidden, shape.intermediate, torch.bfloat16, huge_pages
        )
        gen = torch.Generator().manual_seed(0)
        for bank in (self.pool.gate_up[0], self.pool.down[0]):
            bank.copy_(torch.randn(bank.shape, generator=gen).mul_(0.02))
        self.pool.mark_filled()
        self.cuda = torch.cuda.is_available()
        self.device = torch.device("cuda" if self.cuda else "cpu")
        if self.cuda and pin:
            self.pool.pin()
        self._rotation = 0

    def sync(self) -> None:
        sync_device(self.device)

    def _experts(self, n: int) -> np.ndarray:
        """n distinct experts, rotating through the pool so no call finds its weights in cache."""
        start = self._rotation
        self._rotation = (self._rotation + n) % self.pool.num_experts
        return (start + np.arange(n)) % self.pool.num_experts

    def cpu_inputs(self, n: int, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x, ids, weights of one layer step: n fresh experts, each for `batch` tokens (every token
        routed to all n), laid out as the CPU branch hands them over."""
        ids = torch.from_numpy(self._experts(n))[None].expand(batch, n).contiguous()
        return torch.randn(batch, self.shape.hidden), ids, torch.full((batch, n), 1.0 / n)

    def host_bw(self, batch: int = 1) -> float:
        """Expert weight bytes per second through cpu_experts at `batch` tokens per expert: the best of
        HOST_REPS calls, the inputs made beforehand (the runtime gets them from the routing)."""
        k = self.shape.top_k
        gate_up, down = self.pool.gate_up[0], self.pool.down[0]
        out = torch.empty(batch, self.shape.hidden)
        steps = [self.cpu_inputs(k, batch) for _ in range(max(HOST_REPS, self.reps) + 1)]
        bf16_act = bf16_activations(self.pool.dtype)  # as a bf16 model's steps run
        best = float("inf")
        for i, (x, ids, w) in enumerate(steps):
            t0 = time.perf_counter()
            cpu_experts(x, ids, w, gate_up, down, self.threads, out=out, bf16_act=bf16_act)
            if i:  # the first warms up
                best = min(best, time.perf_counter() - t0)
        return k * self.shape.nbytes / best

    def device_pairs(self, bank: SlotBank, tokens: int = 512) -> float:
        """(token, expert) pairs per second of expert compute on the device, prefill-sized batches."""
        k = self.shape.top_k
        gate_up, down = bank.banks(0)
        x = torch.randn(tokens, self.shape.hidden, dtype=gate_up.dtype, device=self.device)
        gen = torch.Generator().manual_seed(1)
        slots = torch.stack([torch.randperm(k, generator=gen) for _ in range(tokens)])  # [T, k] all slots
        w = torch.full((tokens, k), 1.0 / k, dtype=x.dtype, device=self.device)

        def compute() -> None:
            with torch.inference_mode():
                routed_experts(x, slots, w, gate_up[:k], down[:k])

        return tokens * k / _timed(compute, self.reps, self.sync)

    def fill_bw(self, bank: SlotBank) -> float:
        k = self.shape.top_k

        def fills() -> None:
            for slot, expert in enumerate(self._experts(k)):
                bank.fill(slot, 0, int(expert))

        return k * self.shape.nbytes / _timed(fills, self.reps, self.sync)

    def gather_bw(self, bank: SlotBank) -> float:
        """The same fills as fill_bw by the gather kernel a captured decode step uses: the device reads
        the pinned pool through unified addressing, driven by a plan in device memory."""
        k = self.shape.top_k
        plan = torch.empty(k, 2, dtype=torch.int32, device=self.device)
        count = torch.full((1,), k, dtype=torch.int32, device=self.device)
        slots = torch.arange(k, dtype=torch.int32)

        def fills() -> None:
            experts = torch.from_numpy(self._experts(k).astype(np.int32))
            plan.copy_(torch.stack((experts, slots), dim=1), non_blocking=True)
            fill_slots(plan, count, self.pool.gate_up[0], self.pool.down[0], *bank.banks(0))

        return k * self.shape.nbytes / _timed(fills, self.reps, self.sync)

    def linear(self, nbytes: int = 256 << 20) -> tuple[float, float]:
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        h2d = nbytes / _timed(lambda: dev.copy_(host, non_blocking=True), self.reps, self.sync)
        d2h = nbytes / _timed(lambda: host.copy_(dev, non_blocking=True), self.reps, self.sync)
        return h2d, d2h

    def overlap(self, bank: SlotBank, misses: int) -> list[dict[str, float]]:
        """One layer step of `misses` misses as hybrid runs it, for every q: q fills on the transfer
        stream, the other m − q through the CPU branch (its thread, staging copies and merge)."""
        branch = CpuBranch(self.pool, self.device, self.threads)
        x = torch.randn(1, self.shape.hidden, dtype=torch.bfloat16, device=self.device)
        rows = torch.zeros(1, dtype=torch.long)
        rows_out = []
        try:
            for q in range(misses + 1):

                def step(q: int = q) -> None:
                    cpu_ids = torch.from_numpy(self._experts(misses - q))[None]
                    partial = None
                    if misses - q:
                        w = torch.full((1, misses - q), 1.0 / misses)
                        partial = branch.submit(0, x, rows, cpu_ids, w)  # launched first, as hybrid does
                    for slot, expert in enumerate(self._experts(q)):
                        bank.fill(slot, 0, int(expert))
                    if partial is not None:
                        with torch.inference_mode():
                            branch.merge(torch.zeros_like(x), rows, partial)

                rows_out.append({"q": q, "seconds": _timed(step, self.reps, self.sync)})
        finally:
            branch.close()
        return rows_out

    def overlap_in_stream(self, bank: SlotBank, misses: int) -> list[dict[str, float]]:
        """The same layer steps as a captured decode step runs them (`stream_layer`), for every q. Every
        input is on the device before the clock starts, as the router leaves it."""
        branch = StreamBranch(self.pool, self.device, self.shape.top_k, 1, self.threads)
        x = torch.randn(1, self.shape.hidden, dtype=torch.bfloat16, device=self.device)
        rows_out = []
        try:
            for q in range(misses + 1):
                steps = iter([self.stream_inputs(q, misses) for _ in range(self.reps + 1)])

                def step(steps: Iterator[tuple[torch.Tensor, ...]] = steps) -> None:
                    self.stream_layer(branch, bank, x, *next(steps))

                rows_out.append({"q": q, "seconds": _timed(step, self.reps, self.sync)})
        finally:
            branch.close()
        return rows_out

    def stream_layer(
        self,
        branch: StreamBranch,
        bank: SlotBank,
        x: torch.Tensor,
        plan: torch.Tensor,
        count: torch.Tensor,
        cpu_ids: torch.Tensor,
        slot_ids: torch.Tensor,
        w: torch.Tensor,
    ) -> torch.Tensor:
        """One layer step of x [1, H] as hybrid's captured decode step: the CPU pairs handed over in the
        stream (the native coordinator computes them), the fills by the gather kernel, the fetched
        experts computed from their slots, the CPU's result merged."""
        gate_up, down = bank.banks(0)
        with torch.inference_mode():
            branch.submit(0, x, cpu_ids, w)
            fill_slots(plan, count, self.pool.gate_up[0], self.pool.down[0], gate_up, down)
            return branch.merge(routed_experts(x, slot_ids, w, gate_up, down))

    def stream_inputs(self, q: int, misses: int) -> tuple[torch.Tensor, ...]:
        """A step of `misses` fresh experts, q of them fetched, on the device: plan [k, 2] int32 (into
        slots 0..q−1, -1 after), count [1] int32, cpu_ids [1, k] (the first m − q pairs the CPU's),
        slot_ids [1, k] (the next q pairs the fetched slots'), -1 elsewhere, weights [1, k] fp32."""
        k, experts = self.shape.top_k, torch.from_numpy(self._experts(misses))
        plan = torch.full((k, 2), -1, dtype=torch.int32)
        plan[:q, 0], plan[:q, 1] = experts[:q].int(), torch.arange(q, dtype=torch.int32)
        cpu_ids = torch.full((1, k), -1, dtype=torch.int64)
        cpu_ids[0, : misses - q] = experts[q:]
        slot_ids = torch.full((1, k), -1, dtype=torch.int64)
        slot_ids[0, misses - q : misses] = torch.arange(q)
        w = torch.full((1, k), 1.0 / misses, dtype=torch.float32)
        count = torch.tensor([q], dtype=torch.int32)
        return tuple(t.to(self.device) for t in (plan, count, cpu_ids, slot_ids, w))

    def decode_overlap(self, bank: SlotBank, misses: int) -> tuple[list[dict[str, float]], str]:
        """The overlap rows of the path decode steps take here, and its name: in the stream where the
        gather kernel and the native CPU branch run, else the read-back one."""
        if fill_kernel_available(self.device):
            try:
                return self.overlap_in_stream(bank, misses), "stream"
            except RuntimeError:  # no native CPU kernel: decode steps read routing back
                pass
        return self.overlap(bank, misses), "read_back"

    def cpu_fixed_cost(self) -> float:
        """One CPU-branch launch with no expert work: staging copies, the thread hand-off, the merge."""
        branch = CpuBranch(self.pool, self.device, self.threads)
        x = torch.randn(1, self.shape.hidden, dtype=torch.bfloat16, device=self.device)
        rows = torch.zeros(1, dtype=torch.long)
        ids = torch.full((1, 1), -1, dtype=torch.long)
        w = torch.zeros(1, 1)

        def launch() -> None:
            with torch.inference_mode():
                out = torch.zeros_like(x)
                branch.merge(out, rows, branch.submit(0, x, rows, ids, w))

        try:
            return _timed(launch, 3 * self.reps, self.sync)
        finally:
            branch.close()


def recommend(overlap: list[dict[str, float]], misses: int) -> tuple[str, float | None]:
    """The cheapest way to run a layer step of `misses` misses, from the measured overlap rows:
    q = m is offload, q = 0 is cpu, anything between is hybrid. Without a GPU: cpu."""
    if not overlap:
        return "cpu", None
    best = min(overlap, key=lambda row: row["seconds"])
    backend = "offload" if best["q"] == misses else "cpu" if best["q"] == 0 else "hybrid"
    return backend, best["q"] / misses


def measure(
    shape: ExpertShape, threads: int | None = None, reps: int = 5, miss_rate: float = 0.63
) -> BandwidthProfile:
    """`miss_rate`: the share of a layer's top-k expected to miss (0.63 ≈ a cache of 37% of the pool)."""
    threads = threads or branch_threads()
    machine = this_machine(threads)
    bench = Bench(shape, threads, reps=reps)
    # The read ceiling and B_H taken in turns, the best of each: a shared host drifts between seconds.
    reads, hosts = [], []
    for _ in range(READ_ROUNDS):
        reads.append(read_bandwidth(threads=threads))
        hosts.append(bench.host_bw())
    host_read, b_h = max(reads), max(hosts)
    b_h_batch = {str(n): bench.host_bw(n) for n in HOST_BATCHES}
    b_p = b_p_gather = h2d = d2h = device_pairs = None
    overlap: list[dict[str, float]] = []
    overlap_path = "read_back"
    misses = max(1, round(shape.top_k * miss_rate))
    if bench.cuda:
        bank = SlotBank(bench.pool, shape.top_k, bench.device)
        b_p = bench.fill_bw(bank)
        b_p_gather = bench.gather_bw(bank) if fill_kernel_available(bench.device) else None
        h2d, d2h = bench.linear()
        overlap, overlap_path = bench.decode_overlap(bank, misses)
        device_pairs = bench.device_pairs(bank)
    fixed = bench.cpu_fixed_cost()
    backend, fraction = recommend(overlap, misses)
    return BandwidthProfile(
        machine_key=machine.key,
        machine={
            "gpu_name": machine.gpu_name,
            "gpu_uuid": machine.gpu_uuid,
            "cpu_model": machine.cpu_model,
            "threads": machine.threads,
        },
        created=time.time(),
        versions=current_versions(),
        expert_shape={
            "hidden": shape.hidden,
            "intermediate": shape.intermediate,
            "top_k": shape.top_k,
            "bytes": shape.nbytes,
            "overlap_misses": misses,
        },
        host_read=host_read,
        b_h=b_h,
        b_h_batch=b_h_batch,
        device_pairs_s=device_pairs,
        b_p=b_p,
        b_p_gather=b_p_gather,
        h2d=h2d,
        d2h=d2h,
        cpu_fixed_s=fixed,
        kernel="compiled" if kernel_available() else "torch",
        overlap=overlap,
        overlap_path=overlap_path,
        measured_fetch_fraction=fraction if overlap else None,
        model_fetch_fraction=min(1.0, b_p / b_h) if b_p else None,
        recommended_backend=backend,
    )
