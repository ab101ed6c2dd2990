"""The stream operations of the CPU branch's hand-over, two ways with one interface.

  DriverStreamOps  (CUDA) through the driver on the current stream: copies between a device buffer and
                   pinned host memory (cuMemcpyDtoHAsync / cuMemcpyHtoDAsync) and 32-bit flag writes and
                   waits on mapped pinned memory (cuStreamWriteValue32 / cuStreamWaitValue32), so a captured
                   graph replays all four as nodes and no host thread takes part in the step. A flag write
                   carries a memory barrier: the copies before it are visible to the host when it lands.
  HostStreamOps    (the cpu device standing in) the same four, done by the calling thread: copies are
                   memmoves, the signal a release store, the wait blocks (interpreter lock released) until
                   the coordinator answers.

Flags are int32 words in pinned memory; `signal` sets one to 1, `wait` waits for 1 and sets it back to 0.
"""

from __future__ import annotations

import ctypes
import functools

import torch

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
        vp, u32, u64, size = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_size_t
        self._write = _entry(lib, "cuStreamWriteValue32_v2", "cuStreamWriteValue32")
        self._wait = _entry(lib, "cuStreamWaitValue32_v2", "cuStreamWaitValue32")
        self._d2h = _entry(lib, "cuMemcpyDtoHAsync_v2", "cuMemcpyDtoHAsync")
        self._h2d = _entry(lib, "cuMemcpyHtoDAsync_v2", "cuMemcpyHtoDAsync")
        self._mapped = _entry(lib, "cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer")
        self._write.argtypes = self._wait.argtypes = [vp, u64, u32, ctypes.c_uint]
        self._d2h.argtypes = [vp, u64, size, vp]
        self._h2d.argtypes = [u64, vp, size, vp]
        self._mapped.argtypes = [ctypes.POINTER(u64), vp, ctypes.c_uint]
        for fn in (self._write, self._wait, self._d2h, self._h2d, self._mapped):
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

    def d2h(self, dst_ptr: int, src: torch.Tensor, nbytes: int) -> None:
        self._check("cuMemcpyDtoHAsync", self._d2h(dst_ptr, src.data_ptr(), nbytes, self._stream()))

    def h2d(self, dst: torch.Tensor, src_ptr: int, nbytes: int) -> None:
        self._check("cuMemcpyHtoDAsync", self._h2d(dst.data_ptr(), src_ptr, nbytes, self._stream()))

    def signal(self, flag: int) -> None:
        """`flag`: the device address of the word."""
        self._check(
            "cuStreamWriteValue32", self._write(self._stream(), flag, 1, CU_STREAM_WRITE_VALUE_DEFAULT)
        )

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

    def d2h(self, dst_ptr: int, src: torch.Tensor, nbytes: int) -> None:
        ctypes.memmove(dst_ptr, src.data_ptr(), nbytes)

    def h2d(self, dst: torch.Tensor, src_ptr: int, nbytes: int) -> None:
        ctypes.memmove(dst.data_ptr(), src_ptr, nbytes)

    def signal(self, flag: int) -> None:
        self.lib.ft_branch_signal(self.branch)  # the branch's own submit word

    def wait(self, flag: int) -> None:
        self.lib.ft_branch_wait_done(self.branch)  # the branch's own done word
