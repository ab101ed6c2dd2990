"""CPU expert compute: the compiled bf16 kernel when it is there, the torch reference otherwise.

Both take routing with -1 for pairs another branch computes, and return fp32 partial sums.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

from freetoken.runtime.moe.experts import grouped_experts
from freetoken.runtime.moe.kernels.loader import load_library
from freetoken.runtime.moe.pool import HUGE_PAGES


def kernel_available() -> bool:
    return load_library() is not None


# Cores left to the thread that launches GPU work and drives the transfers while the CPU branch runs.
# Measured on a 16-core host (48-layer decode, cache 37%): the cpu backend took 74 ms/token with 16
# kernel threads and 67 with 15 or 14; hybrid 81 with 16 and 51 with 14.
RESERVED_CORES = 2


def branch_threads() -> int:
    """Default threads of the CPU expert kernel: every torch thread, less RESERVED_CORES with CUDA."""
    threads = torch.get_num_threads()
    if torch.cuda.is_available() and threads > 2 * RESERVED_CORES:
        return threads - RESERVED_CORES
    return threads


def cpu_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up_bank: torch.Tensor,
    down_bank: torch.Tensor,
    threads: int | None = None,
    use_kernel: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, H], ids [T, K] (int, -1 = skip), weights [T, K], banks [E, 2I, H] / [E, H, I] on the host.

    -> [T, H] float32 (written into `out` when given). The kernel needs bf16 banks; any other dtype
    takes the torch path.
    """
    lib = load_library() if use_kernel else None
    if lib is None or gate_up_bank.dtype != torch.bfloat16 or not gate_up_bank.is_contiguous():
        dtype = gate_up_bank.dtype
        with torch.inference_mode():
            result = grouped_experts(x.to(dtype), ids, weights.to(dtype), gate_up_bank, down_bank).float()
        return result if out is None else out.copy_(result)
    if out is None:
        out = torch.zeros(x.shape[0], gate_up_bank.shape[2], dtype=torch.float32)
    else:
        out.zero_()
    plan = plan_entries(ids, weights)
    if plan is not None:
        run_kernel(lib, plan, x, gate_up_bank, down_bank, out, threads or branch_threads())
    return out


@dataclass(frozen=True)
class EntryPlan:
    """Routing entries grouped by expert, experts ascending, in the arrays the kernel takes."""

    experts: np.ndarray  # [E'] uint64: each expert once
    offsets: np.ndarray  # [E' + 1] int32: entries of experts[e] are offsets[e]:offsets[e + 1]
    tokens: np.ndarray  # [N] int32: token row of each entry
    weights: np.ndarray  # [N] float32: routing weight of each entry


def plan_entries(ids: torch.Tensor, weights: torch.Tensor) -> EntryPlan | None:
    """ids [T, K] (-1 = skip), weights [T, K] -> the plan, or None when no entry is this branch's."""
    flat = ids.reshape(-1).numpy()
    keep = np.flatnonzero(flat >= 0)
    if keep.size == 0:
        return None
    order = keep[np.argsort(flat[keep], kind="stable")]
    by_expert = flat[order]
    starts = np.flatnonzero(np.concatenate(([True], by_expert[1:] != by_expert[:-1])))
    return EntryPlan(
        experts=by_expert[starts].astype(np.uint64),
        offsets=np.append(starts, order.size).astype(np.int32),
        tokens=(order // ids.shape[1]).astype(np.int32),
        weights=weights.reshape(-1).float().numpy()[order].astype(np.float32),
    )


def run_kernel(
    lib: ctypes.CDLL,
    plan: EntryPlan,
    x: torch.Tensor,
    gate_up_bank: torch.Tensor,
    down_bank: torch.Tensor,
    out: torch.Tensor,
    threads: int,
) -> None:
    """out [T, H] fp32 += the plan's experts over x [T, H], banks bf16 and contiguous."""
    hidden, inter = gate_up_bank.shape[2], down_bank.shape[2]
    # Addresses of each expert's banks: an array of pointers, as the kernel takes them.
    gu_ptrs = np.uint64(gate_up_bank.data_ptr()) + plan.experts * np.uint64(gate_up_bank.stride(0) * 2)
    dn_ptrs = np.uint64(down_bank.data_ptr()) + plan.experts * np.uint64(down_bank.stride(0) * 2)
    xf = x.float().contiguous()
    scratch = torch.empty(plan.tokens.size, 2 * inter, dtype=torch.float32)
    lib.ft_experts_bf16(
        gu_ptrs.ctypes.data,
        dn_ptrs.ctypes.data,
        len(plan.experts),
        hidden,
        inter,
        xf.data_ptr(),
        plan.tokens.ctypes.data,
        plan.weights.ctypes.data,
        plan.offsets.ctypes.data,
        scratch.data_ptr(),
        out.data_ptr(),
        threads,
    )
    return out


def llc_bytes() -> int:
    """The largest CPU cache on this machine in bytes (sysfs), 32 MiB when it cannot be read."""
    from pathlib import Path

    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * scale)
        except ValueError:
            continue
    return max(sizes, default=32 << 20)


def beyond_cache_bytes() -> int:
    """A working set no cache can hold: 4 × the last-level cache (the STREAM rule), at least 1 GiB."""
    return max(1 << 30, 4 * llc_bytes())


def read_bandwidth(
    nbytes: int | None = None, threads: int | None = None, reps: int = 5, huge_pages: bool = HUGE_PAGES
) -> float:
    """Host read ceiling in bytes/s (STREAM-like sum over all cores); torch when the kernel is absent.
    The buffer lies in pages of the kind the expert pool uses."""
    import time

    from freetoken.formats.ftw import aligned_empty

    nbytes = nbytes or beyond_cache_bytes()
    buf = aligned_empty((nbytes // 4,), torch.float32, huge=huge_pages).fill_(1.0)
    lib = load_library()
    threads = threads or torch.get_num_threads()
    if lib is not None:
        ptr = ctypes.cast(buf.data_ptr(), ctypes.POINTER(ctypes.c_float))
        lib.ft_read_f32(ptr, buf.numel(), threads)
        t0 = time.perf_counter()
        for _ in range(reps):
            lib.ft_read_f32(ptr, buf.numel(), threads)
    else:
        buf.sum()
        t0 = time.perf_counter()
        for _ in range(reps):
            buf.sum()
    return reps * buf.numel() * 4 / (time.perf_counter() - t0)
