"""The one module that reads environment variables."""

from __future__ import annotations

import os
from pathlib import Path


def home_dir() -> Path:
    """Cache root: `$FREETOKEN_HOME`, else `$XDG_CACHE_HOME/freetoken`, else ~/.cache/freetoken."""
    explicit = os.environ.get("FREETOKEN_HOME")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "freetoken"


def models_dir() -> Path:
    """Where generated models (the demo) live."""
    return home_dir() / "models"


def profiles_dir() -> Path:
    """Where `bench bw` keeps bandwidth profiles, one file per machine key."""
    return home_dir() / "profiles"


def kernels_dir() -> Path:
    """Where CPU kernels compiled at first use are cached."""
    return home_dir() / "kernels"


def cpu_kernel_choice() -> str:
    """`FREETOKEN_CPU_KERNEL`: `auto` (compiled kernel, else torch) or `torch` (never compile)."""
    return os.environ.get("FREETOKEN_CPU_KERNEL", "auto").lower()


def linear_attention_choice() -> str:
    """`FREETOKEN_LINEAR_ATTENTION`: `auto` (flash-linear-attention's kernels for CUDA tensors when the
    package imports, torch otherwise) or `torch` (always the torch rules)."""
    return os.environ.get("FREETOKEN_LINEAR_ATTENTION", "auto").lower()


def moe_decode_kernel_choice() -> str:
    """`FREETOKEN_MOE_DECODE_KERNEL`: `auto` (the Triton decode kernel for a few tokens on CUDA when Triton
    imports), `int8` (the same, with Q4_K, Q8_0, MXFP4, Q4_0 and IQ4_NL experts met by int8 activations:
    moe_decode_int8.py)
    or `torch` (the gathered torch path)."""
    return os.environ.get("FREETOKEN_MOE_DECODE_KERNEL", "auto").lower()


def moe_prefill_kernel_choice() -> str:
    """`FREETOKEN_MOE_PREFILL_KERNEL`: `auto` (the grouped Triton kernels for more tokens than the decode
    kernel takes, on CUDA when Triton imports) or `torch` (one expert at a time, routing read back)."""
    return os.environ.get("FREETOKEN_MOE_PREFILL_KERNEL", "auto").lower()


def moe_decode_blocks(codec: bool = False, int8: bool = False) -> tuple[int, ...] | None:
    """`FREETOKEN_MOE_DECODE_BLOCKS` (banks of values), `FREETOKEN_MOE_DECODE_CODEC_BLOCKS` (banks of
    a codec's blocks as stored) or `FREETOKEN_MOE_DECODE_INT8_BLOCKS` (the int8-activation kernels): the
    decode kernel's tiles as six integers `gate_up_n,gate_up_k,down_n,
    down_k,num_warps,num_stages` (what `benchmarks/moe_decode_kernel.py --sweep` found best on this
    GPU), optionally a seventh, `split_choices` (0 or 1), an eighth, the down kernel's warps (0: the
    same), a ninth, a cap on registers a thread (0: none), a tenth, `chunk_tile` (0, 1 or 2: the int8
    Q4_K kernels' chunk as one tile in neither, both or gate_up only), an eleventh, `pdl` (0 or 1:
    programmatic dependent launch of the step's kernels after its first), a twelfth, `gate_up_splits` (1
    or more: the int8 gate_up's rows cut in that many parts along H, each a program), a thirteenth,
    `gate_up_rounds` (1 or more: groups of rows an int8 Q4_K gate_up program of whole-row tiles streams
    through), and a fourteenth, `gate_up_joint` (0 or 1: an int8 gate_up program's gate and up rows as one
    tile); unset: the built-in defaults."""
    kind = "INT8_" if int8 else "CODEC_" if codec else ""
    name = f"FREETOKEN_MOE_DECODE_{kind}BLOCKS"
    raw = os.environ.get(name)
    if not raw:
        return None
    values = tuple(int(v) for v in raw.split(","))
    tile_ok = all(v in (0, 1, 2) for v in values[9:10])
    flags_ok = all(v in (0, 1) for v in values[6:7] + values[10:11] + values[13:14]) and tile_ok
    if len(values) not in range(6, 15) or min(values[:6] + values[11:13]) < 1 or not flags_ok:
        raise ValueError(
            f"{name}: expected six positive integers, then optionally split (0/1), the down kernel's warps, "
            f"a register cap, the chunk tile (0/1/2), pdl (0/1), the gate_up's splits and rounds (1 or "
            f"more), joint (0/1), got {raw!r}"
        )
    if min(values[7:], default=0) < 0:
        raise ValueError(
            f"{name}: the down kernel's warps and the register cap must be 0 or more, got {raw!r}"
        )
    return values


def chat_history_file() -> Path:
    """Where `run`'s interactive chat keeps the lines typed, across sessions."""
    return home_dir() / "chat_history"


def c_compiler() -> str | None:
    """`CC`: the C compiler to build the CPU kernels with first (then cc, gcc, clang are tried)."""
    return os.environ.get("CC") or None
