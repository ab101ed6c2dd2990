"""Turn user-facing device and dtype names into torch objects."""

from __future__ import annotations

import torch

from freetoken.errors import FreeTokenError
from freetoken.runtime.config import normalize_dtype

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    """`auto` -> the first CUDA device when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise FreeTokenError(f"unknown device {name!r}; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise FreeTokenError(f"device {name!r} requested but CUDA is not available here; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise FreeTokenError(f"unsupported device {name!r}; use auto, cpu, cuda or cuda:N")
    return device


def resolve_dtype(name: str, device: torch.device, stored: str = "float32") -> torch.dtype:
    """`auto` -> bfloat16 on CUDA; on the CPU the checkpoint's own dtype when it is bfloat16 (kept as
    stored: half the bytes to read per token, the kernels accumulate in fp32), else float32 (a float16
    checkpoint is widened: bf16 would drop mantissa bits it has)."""
    key = normalize_dtype(name)
    if key == "auto":
        if device.type == "cuda" or stored == "bfloat16":
            return torch.bfloat16
        return torch.float32
    return _TORCH_DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in _TORCH_DTYPES.items()}[dtype]


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU); for timing."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
