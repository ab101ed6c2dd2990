"""Decode steps over the static KV pool, replayed as CUDA graphs.

Each step's rows (token, position, KV slot) are staged in pinned memory and copied in one transfer to a
static device buffer; then one graph replay runs the whole step — every layer, the final norm, the LM
head and the draw — for the batch padded up to a captured size (1, 2, 4, 8, 16; padding rows have slot
-1). A graph is captured the first time its (size, mode) is met; the modes are `greedy` (argmax),
`sample` (device_sampling with the per-row parameters SamplingRows holds), `draw` (the same without
top-k/top-p: no sort) and `logits` (no draw: the host samples, for requests with penalties, logit bias
or logprobs). The one host sync per step is the
read-back of the drawn ids (with their finite flags), after an event.

On the CPU, where a native step takes the model (models/kernels/cpu_decode_step.py), each step is
one native call instead. Where graphs cannot run (not CUDA, an expert backend that reads routing back,
a routing recorder on, or a capture that failed — said once in the log) the same step is called
eagerly. The graphs hold the addresses of the KV pool and of the expert banks: `reset()` drops them
(the engine calls it when the executor changes), and they are dropped by themselves when the pool's
storage moves.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from freetoken.runtime.device_sampling import SamplingRows, greedy_rows
from freetoken.runtime.kv.slot_pool import KVSlotPool
from freetoken.runtime.measure.cpu_share import allowed_cores
from freetoken.runtime.models.kernels.cpu_decode_step import CpuDecodeStep
from freetoken.runtime.models.slot_decode import DecodeOps, DecodeRows
from freetoken.runtime.moe.executor import ExpertExecutor
from freetoken.runtime.moe.kernels.moe_decode import MAX_DECODE_TOKENS

log = logging.getLogger("freetoken.decode")

GRAPH_SIZES = tuple(s for s in (1, 2, 4, 8, 16) if s <= MAX_DECODE_TOKENS)
MAX_ROWS = GRAPH_SIZES[-1]  # rows per step; a larger batch runs as several steps
MODES = ("greedy", "sample", "draw", "logits")


@dataclass(frozen=True)
class StepOutput:
    logits: torch.Tensor  # [n, V], valid until the next step
    tokens: list[int] | None  # drawn ids (None in `logits` mode)
    finite: list[bool] | None  # whether each row's logits were all finite


def padded_size(n: int) -> int:
    return next(s for s in GRAPH_SIZES if s >= n)


class SlotDecoder:
    def __init__(
        self, model: nn.Module, pool: KVSlotPool, device: torch.device, sampling: SamplingRows
    ) -> None:
        self.model, self.pool, self.device, self.sampling = model, pool, device, sampling
        self.ops = DecodeOps.for_device(device)
        self.native: CpuDecodeStep | None = None  # the whole step in one native call (CPU): attach
        self.native_off: str | None = None  # why there is none (what -v says on the CPU)
        pin = device.type == "cuda"
        # row-major, so the first `size` rows are one contiguous block: a single async copy each way
        self._staged = torch.zeros(MAX_ROWS, 3, dtype=torch.int64, pin_memory=pin)  # token, position, slot
        self._staged_np = self._staged.numpy()  # host writes without a tensor per value
        self._rows = torch.zeros(MAX_ROWS, 3, dtype=torch.int64, device=device)
        self._picked = torch.zeros(MAX_ROWS, 2, dtype=torch.int64, pin_memory=pin)  # id, finite
        self._graphs: dict[
            tuple[int, str], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None]
        ] = {}
        self._generation = pool.generation
        self._mempool = None
        # the drawn ids are back: a spinning wait, or one that sleeps (see `sleep_while_waiting`)
        cuda = device.type == "cuda"
        self._events = (torch.cuda.Event(), torch.cuda.Event(blocking=True)) if cuda else None
        # Set by `follow_host_threads` (see there)
        self.sleep_while_waiting = False
        self._copied = torch.cuda.Event() if device.type == "cuda" else None  # the rows are on the device
        self.graphs_off: str | None = None if device.type == "cuda" else "no CUDA device"
        self._said: set[str] = set()  # eager reasons already logged
        self.steps = 0  # decode steps run, and how many of them by graph replay (for tests and benchmarks)
        self.replays = 0
        self._last: torch.cuda.CUDAGraph | None = None  # the graph replayed last (for replay_ms)

    @property
    def captured(self) -> frozenset[tuple[int, str]]:
        """The (padded size, mode) pairs with a captured graph."""
        return frozenset(self._graphs)

    def replay_ms(self, n: int = 20) -> float | None:
        """For profiling: the GPU time of the last replayed step alone, ms per replay over n back-to-back
        replays (the step with no host time between). It re-runs the last step with the same rows, so
        it writes the same K/V again at the same positions, and moves a hybrid model's recurrent states
        on n more times (a profiled sequence is not continued). None before any replay."""
        if self._last is None:
            return None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            self._last.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / n

    def wait(self) -> None:
        """Block until the device has run everything issued so far on the current stream, spinning or
        asleep as `sleep_while_waiting` says (a no-op on the cpu device)."""
        if self._events is not None:
            event = self._events[self.sleep_while_waiting]
            event.record()
            event.synchronize()

    def attach(self, executor: ExpertExecutor) -> None:
        """A new expert executor: the graphs are forgotten (they hold the old one's banks), its native step
        taken (CPU), and the step's wait follows the threads it keeps busy on the host."""
        self.reset()
        step = CpuDecodeStep.build(self.model, self.pool, executor)
        self.native, self.native_off = (None, step) if isinstance(step, str) else (step, None)
        self.follow_host_threads(executor.host_threads())

    def follow_host_threads(self, threads: int) -> None:
        """`threads` of the host compute experts during a step (0: none). The wait for the drawn ids spins
        where a core is left over for it, and sleeps where those threads take every core: spinning beside
        them held a core the branch's layers needed (~5x slower layers at a thread a core), and sleeping
        beside a free core cost 6-15 % of decode speed in wake-ups (16 cores: 14 or 15 branch threads)."""
        self.sleep_while_waiting = threads > 0 and threads + 1 > len(allowed_cores())

    def reset(self) -> None:
        """Forget the captured graphs (the addresses they hold are about to change)."""
        self._graphs.clear()
        self._mempool = None
        self._last = None

    def disable_graphs(self, reason: str) -> None:
        if self.graphs_off is None:
            log.info("decode runs eagerly, without CUDA graphs: %s", reason)
        self.graphs_off = reason
        self.reset()

    def step(
        self, tokens: list[int], positions: list[int], slots: list[int], mode: str, eager: str | None = None
    ) -> StepOutput:
        """One decode step for n <= MAX_ROWS rows (the sampling rows already staged and uploaded by the
        caller for `sample` mode). `eager`: why this step may not replay a graph (the caller knows whether
        the expert backend and the recorder allow it), said once in the log; None: it may."""
        n = len(tokens)
        self.steps += 1
        if mode not in MODES:
            raise ValueError(f"decode mode {mode!r} is not one of {', '.join(MODES)}")
        if not 0 < n <= MAX_ROWS:
            raise ValueError(f"a decode step takes 1..{MAX_ROWS} rows, got {n}")
        if eager is not None and eager not in self._said:
            self._said.add(eager)
            if self.graphs_off is None:
                log.info("decode runs eagerly, without CUDA graphs: %s", eager)
        use_graph = eager is None and self.graphs_off is None
        size = padded_size(n) if use_graph else n
        if self._copied is not None:
            self._copied.synchronize()  # the last step's rows have left the staging buffer (long since)
        staged = self._staged_np
        staged[n:size, :2], staged[n:size, 2] = 0, -1  # padding rows: token 0 at position 0 of no slot
        staged[:n, 0], staged[:n, 1], staged[:n, 2] = tokens, positions, slots
        self._rows[:size].copy_(self._staged[:size], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        if self.pool.generation != self._generation:
            self.reset()
            self._generation = self.pool.generation
        logits, picked = self._replay(size, mode) if use_graph else (None, None)
        if logits is None:
            logits, picked = self._body(size, mode)
        if picked is None:
            return StepOutput(logits[:n], None, None)
        out = self._picked[:n]
        out.copy_(picked[:n], non_blocking=True)
        self.wait()
        ids, finite = out.T.tolist()
        return StepOutput(logits[:n], ids, [bool(f) for f in finite])

    def _body(self, size: int, mode: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        r = self._rows[:size]
        positions = r[:, 1].to(torch.int32)
        rows = DecodeRows(
            tokens=r[:, 0], positions=positions, slots=r[:, 2].to(torch.int32), lengths=positions + 1
        )
        logits = self.native(rows) if self.native is not None else None
        if logits is None:
            logits = self.model.decode(rows, self.pool, self.ops)  # [size, V]
        if mode == "logits":
            return logits, None
        if mode == "greedy":
            ids, finite = greedy_rows(logits)
        else:
            ids, finite = self.sampling.sample(logits, filters=mode == "sample")
        return logits, torch.stack((ids.to(torch.int64), finite.to(torch.int64)), dim=1)  # [size, 2]

    def _replay(self, size: int, mode: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        entry = self._graphs.get((size, mode))
        if entry is None:
            try:
                entry = self._graphs[(size, mode)] = self._capture(size, mode)
            except Exception as exc:  # one line, then eager for the rest of the run
                self.disable_graphs(f"capturing the batch-{size} step failed: {type(exc).__name__}: {exc}")
                return None, None
        graph, logits, picked = entry
        graph.replay()
        self.replays += 1
        self._last = graph
        return logits, picked

    def _capture(
        self, size: int, mode: str
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None]:
        # Warm up on a side stream (Triton compiles, allocator settles). The rows staged now are this
        # step's own, so the K/V the warm-up writes are the values the replay writes again.
        # Recurrent states (a hybrid model's) move on at every step, so the rows' slots are put back after
        # the warm-up: the replay then takes this step from where the sequence stood.
        slots = [int(s) for s in self._staged_np[:size, 2] if s >= 0]
        kept = {layer: [t[slots].clone() for t in tensors] for layer, tensors in self.pool.states.items()}
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._body(size, mode)
        torch.cuda.current_stream(self.device).wait_stream(side)
        for layer, tensors in kept.items():
            for state, saved in zip(self.pool.states[layer], tensors, strict=True):
                state[slots] = saved
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: a stats reader on another thread (its device reads) cannot break the capture
        with torch.cuda.graph(graph, pool=self._mempool, capture_error_mode="thread_local"):
            logits, picked = self._body(size, mode)
        return graph, logits, picked
