"""The CPU branch handed over inside the device's stream: a decode step with CPU work and no host in it.

Per MoE layer step of at most `max_rows` rows (kernels/branch_coordinator.c holds the protocol):
  submit  one kernel writes the rows' CPU pairs (ids -1 elsewhere), their weights and x into the pinned
          stage and raises the submit flag; a layer with no CPU pair raises the done flag instead and the
          coordinator never hears of it (kernels/hand_over.py) — all stream work
  (the GPU computes its own pairs meanwhile; the coordinator thread runs the C kernel on the pool)
  merge   the stream waits for the done flag, then one kernel adds the result [T, H] fp32, read in the
          pinned region through unified addressing, where the layer had a CPU pair
On CUDA these are stream operations (kernels/stream_ops.py), so the decode step is captured in a CUDA graph
with its CPU branch; on the cpu device the calling thread does them, which runs this same path in CI.
A dead or stuck branch answers every hand-over at once (the GPU never hangs) and
`failure()` says why; the executor raises it after the step and falls back to the read-back path.
"""

from __future__ import annotations

import ctypes
import time

import torch

from freetoken.runtime.moe.kernels.cpu_experts import (
    ExpertFnC,
    bank_sizes,
    bf16_activations,
    codec_ids,
    cpu_experts,
    expert_fn_c,
    kernel_takes,
)
from freetoken.runtime.moe.kernels.hand_over import DistinctCount, stage_bytes
from freetoken.runtime.moe.kernels.loader import load_library
from freetoken.runtime.moe.kernels.stream_ops import DriverStreamOps, HostStreamOps
from freetoken.runtime.moe.pool import HostExpertPool

# How long the kernel's threads spin after a layer before they nap (kernels/spin_team.h): on CUDA longer than
# a decode step's gap between two layers that have CPU pairs — ~0.1 ms under cpu, up to a few ms under a
# well-cached hybrid, where most layers have none (5 ms against 1: team start 90-105 against 172-175 µs,
# 374 against 362 tok/s) — so they start together; on the cpu device the calling thread's own work between
# layers needs the cores, so they nap at once.
TEAM_SPIN_S = 5e-3
# ft_branch_timings' counters in its order (kernels/branch_coordinator.c): nanoseconds, but for the counts
TIMINGS = ("layers", "busy", "call", "team_start", "work_end", "gaps", "gap", "joined")
FAILURES = {
    1: "the CPU expert kernel failed (code {error})",
    2: "the CPU expert branch was stuck in one layer for over {stall:g} s",
    3: "the CPU expert branch's thread stopped",
    4: "the CPU expert branch received a malformed hand-over",
}


class StreamBranch:
    def __init__(
        self,
        pool: HostExpertPool,
        device: torch.device,
        top_k: int,
        max_rows: int,
        threads: int,
        int8_act: bool = False,
        stall_s: float = 1.0,
    ) -> None:
        lib = load_library()
        if lib is None:
            raise RuntimeError("the CPU expert kernel is not available")
        layers = list(pool.layers)
        codecs = [pool.codec_names(layer) for layer in layers]
        for layer, names in zip(layers, codecs, strict=True):
            if not kernel_takes(pool.gate_up[layer], pool.down[layer], names):
                raise RuntimeError(f"the CPU expert kernel does not take layer {layer}'s banks")
        assert pool.hidden_size % 2 == 0, "ids are packed 8-aligned after x"
        self.lib, self.device, self.pool, self.int8_act = lib, device, pool, int8_act
        self.row_of = {layer: row for row, layer in enumerate(layers)}
        self.hidden, self.top_k, self.max_rows, self.stall_s = pool.hidden_size, top_k, max_rows, stall_s
        size = stage_bytes(max_rows, self.hidden, top_k)
        self.bf16_act = bf16_activations(pool.dtype)
        ids = [codec_ids(names, int8_act, self.bf16_act) for names in codecs]
        n = len(layers)
        pointers = ctypes.c_void_p * n
        ints = ctypes.c_int * n
        inter = bank_sizes(pool.gate_up[layers[0]], pool.down[layers[0]])[1]
        fns = [expert_fn_c(pool.fn, pool.gate_up_bias.get(layer)) for layer in layers]
        fn_array = None if all(f is None for f in fns) else (ExpertFnC * n)(*(f or ExpertFnC() for f in fns))
        self.handle = lib.ft_branch_new(
            pointers(*(pool.gate_up[layer].data_ptr() for layer in layers)),
            pointers(*(pool.down[layer].data_ptr() for layer in layers)),
            ints(*(gu for gu, _ in ids)), ints(*(dn for _, dn in ids)), fn_array,
            n, pool.num_experts, self.hidden, inter, top_k, max_rows, threads, stall_s,
            TEAM_SPIN_S if device.type == "cuda" else 0.0,
        )  # fmt: skip
        if not self.handle:
            raise RuntimeError("could not start the CPU expert branch's threads")
        # The branch's own memory (it outlives a coordinator stuck in a layer): flags, stage, out.
        nbytes, offsets = ctypes.c_long(), (ctypes.c_long * 3)()
        self._region = lib.ft_branch_region(self.handle, ctypes.byref(nbytes), offsets)
        self._registered = False
        if device.type == "cuda":
            if int(torch.cuda.cudart().cudaHostRegister(self._region, nbytes.value, 0)) != 0:
                self.close()
                raise RuntimeError("could not page-lock the CPU branch's staging")
            self._registered = True
        region = torch.frombuffer(
            (ctypes.c_uint8 * nbytes.value).from_address(self._region), dtype=torch.uint8
        )
        f, st, o = offsets
        self.flags = region[f : f + 8].view(torch.int32)  # submit, done
        self.stage = region[st : st + -(-size // 8) * 8]  # whole words (the region pads it to 64 bytes)
        self.out_host = (
            region[o : o + 4 * max_rows * self.hidden].view(torch.float32).view(max_rows, self.hidden)
        )
        self.ops: DriverStreamOps | HostStreamOps = (
            DriverStreamOps(device) if device.type == "cuda" else HostStreamOps(lib, self.handle)
        )
        self._done_flag = self.ops.device_address(self.flags.data_ptr()) + 4
        self._ids: torch.Tensor | None = None  # the hand-over in flight's ids (its memory kept to the merge)

    def set_threads(self, threads: int) -> None:
        self.lib.ft_branch_set_threads(self.handle, threads)

    def submit(
        self,
        layer: int,
        x: torch.Tensor,
        cpu_ids: torch.Tensor,
        weights: torch.Tensor,
        count: DistinctCount | None = None,
    ) -> None:
        """Hand over x [T, H]'s pairs `cpu_ids` [T, K] (-1: not the CPU's) with `weights` [T, K]; `count`
        where the hand-over adds its distinct expert ids."""
        assert x.shape[0] <= self.max_rows, f"a hand-over takes at most {self.max_rows} rows"
        self._ids = cpu_ids.contiguous()
        self.ops.hand_over(x, self._ids, weights, self.stage, self.flags, self.row_of[layer], count)

    def merge(self, out: torch.Tensor, out_is_zero: bool = False) -> torch.Tensor:
        """out [T, H] + the CPU's result for the layer handed over last (out itself when it had no CPU
        pair); `out_is_zero`: the device had no part, out (uninitialised) gives only shape and dtype."""
        assert self._ids is not None, "merge follows a submit"
        ids, self._ids = self._ids, None
        self.ops.wait(self._done_flag)
        return self.ops.merge(out, self.out_host[: out.shape[0]], ids, out_is_zero)

    def check(self, timeout_s: float = 2.0) -> None:
        """One hand-over for real before the branch is trusted: eagerly and, on CUDA, replayed from a
        captured graph; each must finish within `timeout_s` with the kernel's result. Raises RuntimeError
        saying what failed (the executor then reads routing back instead)."""
        layer = next(iter(self.row_of))
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(1, self.hidden, generator=gen)
        ids = torch.full((1, self.top_k), -1, dtype=torch.int64)
        ids[0, 0] = 0
        w = torch.ones(1, self.top_k)
        pool = self.pool
        want = cpu_experts(
            x, ids, w, pool.gate_up[layer], pool.down[layer], 1, codecs=pool.codec_names(layer),
            int8_act=self.int8_act, fn=pool.fn, gate_up_bias=pool.gate_up_bias.get(layer),
            bf16_act=self.bf16_act,
        )  # fmt: skip
        dev = [t.to(self.device) for t in (x, ids, w)]

        def once() -> torch.Tensor:
            self.submit(layer, *dev)
            return self.merge(torch.zeros_like(dev[0]))

        self._expect(once(), want, timeout_s, "an eager hand-over")
        if self.device.type != "cuda":
            return
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                out = once()
        except Exception as exc:  # e.g. stream memory operations this driver cannot capture
            raise RuntimeError(f"capturing a hand-over failed: {type(exc).__name__}: {exc}") from None
        graph.replay()
        self._expect(out, want, timeout_s, "a hand-over replayed from a CUDA graph")

    def _expect(self, out: torch.Tensor, want: torch.Tensor, timeout_s: float, what: str) -> None:
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
            deadline = time.monotonic() + timeout_s
            while not done.query():
                if time.monotonic() > deadline:
                    while not done.query():  # release the stream's waits, then give up on the branch
                        self.flags[1] = 1
                        time.sleep(1e-3)
                    raise RuntimeError(f"{what} did not finish within {timeout_s:g} s")
                time.sleep(1e-4)
        why = self.failure()
        if why is not None:
            raise RuntimeError(f"{what}: {why}")
        got = out.float().cpu()
        if not torch.allclose(got, want, rtol=1e-3, atol=1e-4):
            raise RuntimeError(f"{what} gave {got[0, :3].tolist()}..., the kernel {want[0, :3].tolist()}...")

    def failure(self) -> str | None:
        """Why the branch died (it answers every hand-over at once from then on), or None."""
        error = ctypes.c_int(0)
        why = self.lib.ft_branch_failed(self.handle, ctypes.byref(error))
        if not why:
            return None
        return FAILURES.get(why, "the CPU expert branch failed").format(error=error.value, stall=self.stall_s)

    def served(self) -> int:
        return int(self.lib.ft_branch_served(self.handle))

    def timings(self, reset: bool = False) -> dict[str, float]:
        """Where the layers served since the last reset spent their time, µs a layer: `busy` from the take
        to the answer, `call` of it in the kernel call; from the call's start, when its last thread took its
        first unit (`team_start`) and ended its last (`work_end`: the sums over pairs are the units'), and
        when its threads were joined (`joined`); `gap` from an answer to the next take (the GPU's part of
        the step and both flags' latency; gaps between steps left out). `reset`: start again after."""
        raw = (ctypes.c_long * len(TIMINGS))()
        self.lib.ft_branch_timings(self.handle, raw, int(reset))
        got = dict(zip(TIMINGS, raw, strict=True))
        layers, gaps = max(got["layers"], 1), max(got["gaps"], 1)
        out = {"layers": float(got["layers"])}
        phases = ("busy", "call", "team_start", "work_end", "joined")
        out.update({name: got[name] / layers / 1e3 for name in phases})
        out["gap"] = got["gap"] / gaps / 1e3
        return out

    def close(self) -> None:
        """Ends the threads and frees the branch's memory (kept, with a thread stuck in a layer)."""
        if not getattr(self, "handle", None):
            return
        stuck = self.lib.ft_branch_stop(self.handle)
        if not stuck:
            if getattr(self, "_registered", False):
                torch.cuda.cudart().cudaHostUnregister(self._region)
            self.lib.ft_branch_free(self.handle)
        self.handle = None

    def __del__(self) -> None:  # threads that outlive their owner would spin forever
        self.close()
