"""Compile the CPU kernels (`experts_cpu.c` and the rest) once per machine (cached under
$FREETOKEN_HOME/kernels) and load them.

Any failure — no compiler, no OpenMP, a refused flag — is one warning, and callers fall back to torch.
"""

from __future__ import annotations

import ctypes
import hashlib
import platform
import shutil
import subprocess
import tempfile
import warnings
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from freetoken.env import c_compiler, cpu_kernel_choice, kernels_dir

if TYPE_CHECKING:
    import torch

HERE = Path(__file__).parent
# the expert kernel, the thread that runs it, the dense layers' GEMV, the decode attention block and norm,
# the whole CPU decode step over them, the coordinator of the CPU branch inside a GPU step and its team
SOURCES = tuple(
    HERE / name
    for name in (
        "experts_cpu.c",
        "kernel_worker.c",
        "dense_bf16.c",
        "attention_decode.c",
        "norm_cpu.c",
        "decode_step_cpu.c",
        "delta_step_cpu.c",
        "branch_coordinator.c",
        "spin_team.c",
    )
)
HEADERS = tuple(
    HERE / name
    for name in (
        "bf16_dot.h",
        "quant_dot.h",
        "kquant_dot.h",
        "kquant_dot_int8.h",
        "kquant_bf16_dot.h",
        "table_dot.h",
        "iq_grids.h",
        "lowbit_dot.h",
        "lowbit_dot_int8.h",
        "lowbit_bf16_dot.h",
        "widen_row.h",
        "row_dots.h",
        "expert_fn.h",
        "spin_team.h",
    )
)
# FMAs contracted from the kernel's multiply-adds; on x86, full-width vectors where the CPU has them
# (compilers otherwise stop at 256 bits on AVX-512 machines).
X86_FLAGS = ("-mprefer-vector-width=512",) if platform.machine().lower() in ("x86_64", "amd64") else ()
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", *X86_FLAGS, "-fopenmp", "-shared", "-fPIC", "-std=c11")


# Software prefetch in the dot loops (bf16_dot.h's PREFETCH) only where this few cores are allowed and
# the CPU has no AVX-512: it lifted a 2-core AVX2 EPYC's expert kernel 5-13% (one core's own misses in
# flight bound its bandwidth); on a 16-core Xeon it cost the LM head GEMV 95 -> 41 GB/s and the experts
# 64 -> 48 GB/s at 16 threads (there the cores fill the memory pipe without it); on a 2-core AVX-512
# EPYC the expert kernel went 0.88 -> 0.99 x the read without it, and decode 51-56 -> 60-62 tok/s.
# Builds for more cores keep the Q8_0 dots' prefetch, 2 KiB ahead into L2 (quant_dot.h's Q8_PREFETCH: on
# that 16-core Xeon Q8_0 x int8 went 116 -> 142 GB/s at 16 threads, one sweep; on the 2-core AVX-512 EPYC
# it cost 0.88-0.91 against 1.05 x the read, so not there).
PREFETCH_MAX_CORES = 4
MANY_CORE_DEFINES = ("-DPREFETCH=0", "-DQ8_PREFETCH=2048", "-DQ8_PREFETCH_HINT=2")


def pointer(t: torch.Tensor | None) -> int | None:
    """A tensor's data pointer for a native call (NULL for None)."""
    return None if t is None else t.data_ptr()


def machine_defines() -> tuple[str, ...]:
    """-D values this machine's build takes beyond the source's defaults."""
    from freetoken.runtime.measure.cpu_share import allowed_cores

    return prefetch_defines(len(allowed_cores()), cpu_flags())


def prefetch_defines(cores: int, flags: frozenset[str]) -> tuple[str, ...]:
    """Software prefetch on (the source's default) for at most PREFETCH_MAX_CORES cores without AVX-512; none
    for as few cores with AVX-512; for more cores none but the Q8_0 dots', into L2."""
    if cores > PREFETCH_MAX_CORES:
        return MANY_CORE_DEFINES
    return () if "avx512f" not in flags else ("-DPREFETCH=0",)


@cache
def bf16_dot_units() -> bool:
    """Whether this CPU has bf16 dot instructions (AVX512-BF16, AMX) that torch's bf16 products use."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo), empty where unknown."""
    return frozenset((_cpuinfo("flags") or "").split())


def _cpuinfo(field: str) -> str | None:
    """The first /proc/cpuinfo line's value for `field`, or None."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


# The instruction sets the expert kernels' dots choose between (row_dots.h, the int8 and bf16 paths)
KERNEL_ISA = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8")


def cpu_description() -> dict[str, object]:
    """What benchmark reports say of the host: its model, the kernel-relevant instruction sets it has,
    and the cores this process may use."""
    from freetoken.runtime.measure.cpu_share import allowed_cores

    flags = cpu_flags()
    return {"model": cpu_model(), "isa": [f for f in KERNEL_ISA if f in flags], "cores": len(allowed_cores())}


def find_compiler() -> str | None:
    for name in (c_compiler(), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        cmd = [compiler, *FLAGS, *machine_defines(), *map(str, SOURCES), "-o", str(out), "-lm", "-lpthread"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            first = (proc.stderr.strip().splitlines() or ["unknown error"])[0]
            raise RuntimeError(f"{' '.join(cmd)} failed: {first}")
        out.replace(target)  # atomic: a concurrent first use sees the old file or the whole new one


@cache
def load_library() -> ctypes.CDLL | None:
    """The compiled kernel library, or None (with one warning) when it cannot be had."""
    if cpu_kernel_choice() == "torch":
        return None
    compiler = find_compiler()
    if compiler is None:
        warnings.warn("no C compiler found: CPU experts use the slower torch path", stacklevel=2)
        return None
    parts = (
        *(src.read_text() for src in (*SOURCES, *HEADERS)),
        compiler,
        *FLAGS,
        *machine_defines(),
        platform.machine(),
        cpu_model(),
    )
    key = hashlib.sha256(b"\0".join(x.encode() for x in parts)).hexdigest()[:16]
    target = kernels_dir() / f"cpu_kernels-{key}.so"
    try:
        if not target.exists():
            _build(compiler, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        warnings.warn(f"CPU expert kernel unavailable ({exc}); using the slower torch path", stacklevel=2)
        return None
    declare(lib)
    return lib


def declare(lib: ctypes.CDLL) -> None:
    """The argument types of the library's entry points (a build of any variant of the source)."""
    vp, i32, f32p = ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_float)
    # gate_up, down, bank experts, hidden, inter, x, ids, weights, tokens, top_k, scratch, out, threads,
    # unit bytes, trace
    lib.ft_moe_bf16.argtypes = [vp, vp, i32, i32, i32, vp, vp, vp, i32, i32, vp, vp, i32, ctypes.c_long, vp]
    lib.ft_moe_bf16.restype = i32
    # as ft_moe_bf16's, with each bank's codec id after it, and the experts' function (ExpertFnC) last
    lib.ft_moe.argtypes = [vp, i32, vp, i32, *lib.ft_moe_bf16.argtypes[2:], vp]
    lib.ft_moe.restype = i32
    # the native worker: new, submit (the worker, ft_moe_bf16's arguments without the trace, the codec id),
    # wait, free
    lib.ft_worker_new.argtypes, lib.ft_worker_new.restype = [], vp
    lib.ft_worker_submit.argtypes = [vp, *lib.ft_moe_bf16.argtypes[:-1], i32]
    lib.ft_worker_submit.restype = i32
    lib.ft_worker_wait.argtypes, lib.ft_worker_wait.restype = [vp], i32
    lib.ft_worker_free.argtypes, lib.ft_worker_free.restype = [vp], None
    # weight, x, out, rows, hidden, tokens, x scratch, threads
    lib.ft_linear_bf16.argtypes = [vp, vp, vp, i32, i32, i32, vp, i32]
    lib.ft_linear_bf16.restype = i32
    lib.ft_widen_rows_bf16.argtypes = [i32, vp, vp, i32, i32, i32]  # codec, rows, out, rows, n, plain
    lib.ft_widen_rows_bf16.restype = i32
    # qkv, rows, heads, kv heads, head dim, norm mode (0 none, 1 per head, 2 whole projection), rotary
    # dims, q/k norm weights, eps, cos, sin, k/v caches, element size, capacity, slots, positions, scale,
    # sinks (or NULL), window (0: none), scores scratch, q scratch, out, threads
    f32 = ctypes.c_float
    lib.ft_attention_decode.argtypes = [
        vp, i32, i32, i32, i32, i32, i32, vp, vp, f32, vp, vp, vp, vp, i32, i32, vp, vp, f32, vp, i32, vp, vp,
        vp, i32,
    ]  # fmt: skip
    lib.ft_attention_decode.restype = i32
    # x, residual (or NULL), weight, eps, rows, hidden, element size, normed out, sum out, scratch
    lib.ft_add_rms_norm.argtypes = [vp, vp, vp, f32, i32, i32, i32, vp, vp, vp]
    lib.ft_add_rms_norm.restype = None
    # the model's pointer table, rows, tokens, slots, positions, distinct experts out, logits out, scratch,
    # threads, expert threads
    lib.ft_decode_step.argtypes = [vp, i32, vp, vp, vp, vp, vp, vp, i32, i32]
    lib.ft_decode_step.restype = i32
    lib.ft_decode_step_scratch.argtypes, lib.ft_decode_step_scratch.restype = [vp, i32], ctypes.c_long
    # a DeltaNet layer's conv step: x, x row stride, element size, state, weight, weight element size,
    # channels, width, slots (int32), rows, out, threads
    lib.ft_conv_step.argtypes = [vp, ctypes.c_long, i32, vp, vp, i32, i32, i32, vp, i32, vp, i32]
    lib.ft_conv_step.restype = i32
    # its delta rule's step: mixed, its row stride, element size, b, its row stride, a, its row stride, b/a
    # element size, a_log, dt_bias (fp32), state (fp32), slots (int32), rows, Hk, Hv, Dk, Dv, the log decay
    # per key channel (fp32, or NULL), out, threads
    lib.ft_delta_step.argtypes = [
        vp, ctypes.c_long, i32, vp, ctypes.c_long, vp, ctypes.c_long, i32, vp, vp, vp, vp, i32, i32, i32, i32,
        i32, vp, vp, i32,
    ]  # fmt: skip
    lib.ft_delta_step.restype = i32
    # logits, element size, rows, vocab, out [rows, 2] int64 (argmax, finite)
    lib.ft_greedy_rows.argtypes, lib.ft_greedy_rows.restype = [vp, i32, i32, ctypes.c_long, vp], None
    # the stream branch: per-layer gate_up/down pointers, codec ids and experts' functions (or NULL), layers,
    # bank experts, hidden, inter, top_k, max rows, threads, stall seconds; its region (bytes, offsets [3]
    # out); stop, free
    lib.ft_branch_new.argtypes = [vp, vp, vp, vp, vp, *[i32] * 7, ctypes.c_double, ctypes.c_double]
    lib.ft_branch_new.restype = vp
    lp = ctypes.POINTER(ctypes.c_long)
    lib.ft_branch_region.argtypes, lib.ft_branch_region.restype = [vp, lp, lp], vp
    lib.ft_branch_stop.argtypes, lib.ft_branch_stop.restype = [vp], i32
    lib.ft_branch_set_threads.argtypes, lib.ft_branch_set_threads.restype = [vp, i32], None
    lib.ft_branch_failed.argtypes, lib.ft_branch_failed.restype = [vp, ctypes.POINTER(i32)], i32
    lib.ft_branch_served.argtypes, lib.ft_branch_served.restype = [vp], ctypes.c_long
    lib.ft_branch_timings.argtypes, lib.ft_branch_timings.restype = [vp, lp, i32], None
    # the coordinator's spinning team (spin_team.h); run takes a C function pointer (tests)
    lib.ft_team_new.argtypes, lib.ft_team_new.restype = [i32, ctypes.c_long], vp
    lib.ft_team_size.argtypes, lib.ft_team_size.restype = [vp], i32
    lib.ft_team_run.argtypes, lib.ft_team_run.restype = [vp, i32, vp, vp], None
    lib.ft_team_free.argtypes, lib.ft_team_free.restype = [vp], None
    lib.ft_team_check.argtypes, lib.ft_team_check.restype = [i32, i32, ctypes.c_uint, ctypes.c_long, i32], i32
    lib.ft_branch_signal.argtypes, lib.ft_branch_signal.restype = [vp], None
    lib.ft_branch_wait_done.argtypes, lib.ft_branch_wait_done.restype = [vp], i32
    lib.ft_branch_hold.argtypes, lib.ft_branch_hold.restype = [vp, ctypes.c_double], None
    lib.ft_branch_stop_coordinator.argtypes, lib.ft_branch_stop_coordinator.restype = [vp], None
    lib.ft_branch_free.argtypes, lib.ft_branch_free.restype = [vp], None
    lib.ft_read_f32.argtypes = [f32p, ctypes.c_long, i32]
    lib.ft_read_f32.restype = ctypes.c_double
