"""The CPU branch: misses computed on the host from the pool, on a worker thread, beside the GPU.

Per layer step: the rows of x routed to CPU experts go device-to-host into pinned staging, the worker
computes them with the pool's banks, the main thread adds the result back. Staging is reused between
steps: the next step's copies come after its routing read, which waits for this step's work.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from freetoken.runtime.moe.kernels.cpu_experts import branch_threads, cpu_experts
from freetoken.runtime.moe.pool import HostExpertPool


class CpuBranch:
    def __init__(self, pool: HostExpertPool, device: torch.device, threads: int | None = None) -> None:
        self.pool = pool
        self.device = device
        self.threads = threads or branch_threads()  # decided once, not per layer step
        self.pinned = device.type == "cuda"
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="freetoken-cpu-experts")
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
    ) -> Future[torch.Tensor]:
        """Start computing x[rows] with experts `ids` [R, K] (host, -1 = not mine), `weights` [R, K] (host).

        Returns a future of the fp32 partial sums [R, H] on the host (pinned when CUDA is present).
        `inline` computes on the calling thread: for steps with nothing to overlap (no hits, no fills).
        """
        x_host, out_host = self._staging(len(rows))
        # A plain copy: the compute stream has just been read back (routing), so it waits for nothing,
        # and the worker then needs no CUDA call at all.
        x_host.copy_(x if len(rows) == x.shape[0] else x.index_select(0, rows.to(x.device)))
        gate_up, down = self.pool.gate_up[layer], self.pool.down[layer]

        def run() -> torch.Tensor:
            with torch.inference_mode():  # the staging was made under it, on the caller's thread
                cpu_experts(x_host, ids, weights, gate_up, down, self.threads, out=out_host)
            return out_host

        if inline:
            done: Future[torch.Tensor] = Future()
            done.set_result(run())
            return done
        return self.worker.submit(run)

    def merge(self, out: torch.Tensor, rows: torch.Tensor, partial: Future[torch.Tensor]) -> torch.Tensor:
        """out [T, H] += the CPU partial sums at `rows`."""
        result = partial.result().to(out.device, non_blocking=True).to(out.dtype)
        if len(rows) == out.shape[0]:
            return out + result
        return out.index_add(0, rows.to(out.device), result)

    def close(self) -> None:
        self.worker.shutdown(wait=True)
