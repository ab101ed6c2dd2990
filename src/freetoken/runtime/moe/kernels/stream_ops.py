"""The stream operations of the CPU branch's hand-over, two ways with one interface.

  DriverStreamOps  (CUDA) on the current stream: the hand-over kernel (kernels/hand_over.py: the stage
                   written through unified addressing, then the submit word, or the done word when the
                   layer has no CPU pair), the wait through the driver (cuStreamWaitValue32 on mapped pinned
                   memory, then cuStreamWriteValue32 back to 0) and the merge kernel, which reads the result
                   where the coordinator wrote it (unified addressing, no copy back); a captured graph
                   replays them all as nodes and no host thread takes part in the step.
  HostStreamOps    (the cpu device standing in) the same, done by the calling thread with the torch
                   references: the stage and the result are memory the thread reads and writes, the submit
                   a release store, the wait blocks (interpreter lock released) until the coordinator answers.

Flags are int32 words in pinned memory (submit, done); `wait` waits for done = 1 and sets it back to 0.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from freetoken.runtime.moe.kernels.hand_over import (
    DistinctCount,
    merge_hand_over,
    merge_reference,
    stage_hand_over,
    stage_reference,
)

CU_STREAM_WAIT_VALUE_EQ = 0x1
CU_STREAM_WRITE_VALUE_DEFAULT = 0x0  # with a memory barrier before the write


@functools.cache
def _driver() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def _entry(lib: ctypes.CDLL, *names: str) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    for name in names:
        fn = getattr(lib, name, None)
        if fn is not None:
            return fn
    raise RuntimeError(f"the CUDA driver has no {names[0]}")


class DriverStreamOps:
    def __init__(self, device: torch.device) -> None:
        lib = _driver()
        if lib is None:
            raise RuntimeError("the CUDA driver library (libcuda.so.1) cannot be loaded")
        self.device = device
        vp, u32, u64 = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint64
        self._write = _entry(lib, "cuStreamWriteValue32_v2", "cuStreamWriteValue32")
        self._wait = _entry(lib, "cuStreamWaitValue32_v2", "cuStreamWaitValue32")
        self._mapped = _entry(lib, "cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer")
        self._write.argtypes = self._wait.argtypes = [vp, u64, u32, ctypes.c_uint]
        self._mapped.argtypes = [ctypes.POINTER(u64), vp, ctypes.c_uint]
        for fn in (self._write, self._wait, self._mapped):
            fn.restype = ctypes.c_int

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream

    @staticmethod
    def _check(what: str, result: int) -> None:
        if result != 0:
            raise RuntimeError(f"{what} failed with CUDA driver error {result}")

    def device_address(self, host_ptr: int) -> int:
        """The device's address of pinned host memory (the host's own under unified addressing)."""
        out = ctypes.c_uint64()
        if self._mapped(ctypes.byref(out), host_ptr, 0) != 0:
            return host_ptr  # not mapped by that call's rules: unified addressing shares the address
        return out.value

    def hand_over(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, stage: torch.Tensor,
        flags: torch.Tensor, row: int, count: DistinctCount | None = None,
    ) -> None:  # fmt: skip
        stage_hand_over(x, ids, weights, stage, flags, row, count)

    def merge(
        self, out: torch.Tensor, out_host: torch.Tensor, ids: torch.Tensor, out_is_zero: bool = False
    ) -> torch.Tensor:
        """out + the CPU's result, read from the page-locked `out_host`, where `ids` had a CPU pair."""
        return merge_hand_over(out, out_host, ids, out_is_zero)

    def wait(self, flag: int) -> None:
        stream = self._stream()
        self._check("cuStreamWaitValue32", self._wait(stream, flag, 1, CU_STREAM_WAIT_VALUE_EQ))
        self._check("cuStreamWriteValue32", self._write(stream, flag, 0, CU_STREAM_WRITE_VALUE_DEFAULT))


class HostStreamOps:
    """The cpu device's stand-in: `lib` the kernel library, `branch` the coordinator's handle."""

    def __init__(self, lib: ctypes.CDLL, branch: int) -> None:
        self.lib, self.branch = lib, branch

    def device_address(self, host_ptr: int) -> int:
        return host_ptr

    def hand_over(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, stage: torch.Tensor,
        flags: torch.Tensor, row: int, count: DistinctCount | None = None,
    ) -> None:  # fmt: skip
        if stage_reference(x, ids, weights, stage, row, count):
            self.lib.ft_branch_signal(self.branch)  # the branch's own submit word
        else:
            flags[1] = 1  # answered here: the wait below is this thread's own

    def merge(
        self, out: torch.Tensor, out_host: torch.Tensor, ids: torch.Tensor, out_is_zero: bool = False
    ) -> torch.Tensor:
        return merge_reference(out, out_host, ids, out_is_zero)

    def wait(self, flag: int) -> None:
        self.lib.ft_branch_wait_done(self.branch)  # the branch's own done word
