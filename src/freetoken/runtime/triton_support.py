"""Where a Triton kernel can run: on CUDA tensors, or on CPU ones when Triton's interpreter runs the kernel
bodies (TRITON_INTERPRET=1 set before Triton is first imported, as the test suite does without CUDA)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def kernel_runs_on(body: Callable[[], tuple[Any, bool]], device: torch.device | str) -> bool:
    """`body()` -> (the kernel module, whether the interpreter runs it); False when Triton is missing.
    Meta tensors (no data) are taken where the kernels compile: a launch on them compiles and runs nothing
    under a stand-in driver (tests/hopper_compile.py: the kernels compiled for a GPU on a machine without
    one)."""
    try:
        _, interpreted = body()
    except ImportError:
        return False
    kind = torch.device(device).type
    return kind == "cuda" or (kind == "cpu" and interpreted) or (kind == "meta" and not interpreted)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): Triton's block sizes."""
    return 1 << max(0, n - 1).bit_length()
