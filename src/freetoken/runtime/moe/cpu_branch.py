"""The CPU branch: misses computed on the host from the pool, beside the GPU.

Per layer step: the rows of x routed to CPU experts go device-to-host into pinned staging, the kernel
computes them from the pool's banks on its own native thread (started at once, the interpreter lock
not needed), the main thread adds the result back. Without the compiled kernel, or for banks it
does not take, a Python worker thread runs the torch path instead. Staging is reused between steps:
the next step's copies come after its routing read, which waits for this step's work.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from freetoken.runtime.moe.expert_fn import SILU
from freetoken.runtime.moe.kernels.cpu_experts import (
    MATRIX_ROWS,
    KernelWorker,
    bf16_activations,
    branch_threads,
    cpu_experts,
    kernel_takes,
)
from freetoken.runtime.moe.kernels.loader import load_library
from freetoken.runtime.moe.pool import HostExpertPool


class Partial:
    """The CPU branch's fp32 partial sums [R, H] of one layer step, once `result` has waited for them."""

    def __init__(self, wait: Callable[[], torch.Tensor]) -> None:
        self._wait: Callable[[], torch.Tensor] | None = wait
        self._value: torch.Tensor | None = None

    def result(self) -> torch.Tensor:
        if self._wait is not None:
            self._value, self._wait = self._wait(), None
        assert self._value is not None
        return self._value


class CpuBranch:
    def __init__(
        self, pool: HostExpertPool, device: torch.device, threads: int | None = None, int8_act: bool = False
    ) -> None:
        self.pool = pool
        self.int8_act = int8_act  # quantized banks against int8 activation blocks
        self.device = device
        self.threads = threads or branch_threads()  # decided once, not per layer step
        self.pinned = device.type == "cuda"
        lib = load_library()
        banks = [(pool.gate_up[layer], pool.down[layer]) for layer in pool.layers]
        # the test cpu_experts makes; the native worker takes bf16 banks of SiLU experts without biases
        # (others run on the Python worker, whose ctypes call releases the interpreter lock as well)
        plain = not pool.stored and pool.fn == SILU and not pool.biased
        takes = plain and all(kernel_takes(gate_up, down) for gate_up, down in banks)
        self.native = KernelWorker(lib) if lib is not None and banks and takes else None
        self.worker = None
        if self.native is None:
            self.worker = ThreadPoolExecutor(1, thread_name_prefix="freetoken-cpu-experts")
        self._x_host = torch.empty(0)
        self._out_host = torch.empty(0)

    def _staging(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._x_host.shape[0] < tokens:
            shape = (max(tokens, 2 * self._x_host.shape[0], 8), self.pool.hidden_size)
            self._x_host = torch.empty(shape, dtype=torch.float32, pin_memory=self.pinned)
            self._out_host = torch.empty(shape, dtype=torch.float32, pin_memory=self.pinned)
        return self._x_host[:tokens], self._out_host[:tokens]

    def submit(
        self,
        layer: int,
        x: torch.Tensor,
        rows: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        inline: bool = False,
    ) -> Partial:
        """Start computing x[rows] with experts `ids` [R, K] (host, -1 = not mine), `weights` [R, K] (host).

        Returns the pending fp32 partial sums [R, H] on the host (pinned when CUDA is present).
        `inline` computes on the calling thread: for steps with nothing to overlap (no hits, no fills).
        """
        x_host, out_host = self._staging(len(rows))
        # A plain copy: the compute stream has just been read back (routing), so it waits for nothing.
        x_host.copy_(x if len(rows) == x.shape[0] else x.index_select(0, rows.to(x.device)))
        gate_up, down = self.pool.gate_up[layer], self.pool.down[layer]
        codecs = self.pool.codec_names(layer)
        # bf16 rows staged in fp32 go back to bf16 (exactly) where torch's bf16 products may take them
        x_in = x_host.bfloat16() if x.dtype == torch.bfloat16 and len(rows) >= MATRIX_ROWS else x_host
        bf16_act = bf16_activations(x.dtype)  # the model's dtype decides, not the staging's

        def run() -> torch.Tensor:
            with torch.inference_mode():  # the staging was made under it, on the caller's thread
                cpu_experts(
                    x_in, ids, weights, gate_up, down, self.threads, out=out_host, codecs=codecs,
                    int8_act=self.int8_act, fn=self.pool.fn, gate_up_bias=self.pool.gate_up_bias.get(layer),
                    bf16_act=bf16_act,
                )  # fmt: skip
            return out_host

        if inline:
            done = run()
            return Partial(lambda: done)
        if self.native is not None:
            native = self.native
            native.start(x_host, ids, weights, gate_up, down, out_host, self.threads, bf16_act)
            return Partial(lambda: (native.wait(), out_host)[1])
        assert self.worker is not None
        return Partial(self.worker.submit(run).result)

    def merge(self, out: torch.Tensor, rows: torch.Tensor, partial: Partial) -> torch.Tensor:
        """out [T, H] += the CPU partial sums at `rows`."""
        result = partial.result().to(out.device, non_blocking=True).to(out.dtype)
        if len(rows) == out.shape[0]:
            return out + result
        return out.index_add(0, rows.to(out.device), result)

    def close(self) -> None:
        if self.native is not None:
            self.native.close()
        if self.worker is not None:
            self.worker.shutdown(wait=True)
