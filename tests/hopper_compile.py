"""Triton kernels compiled for a Hopper GPU (sm_90) on a machine without one.

Triton's interpreter, which the CPU suite runs the kernel bodies under, accepts code the compiler rejects
(a shape held in a local, a pointer cast it cannot lower, a tile past the shared memory), and a GPU lease is
a poor place to find that out. `HopperCompileOnly` stands in for Triton's CUDA driver: it names an sm_90
target, so a launch compiles the kernel to a cubin with the wheel's own ptxas, checks the shared memory
against Hopper's 227 KiB, and then launches nothing. Launches are made on `meta` tensors (no data, no
host reads), so the same wrappers the engine calls run unchanged.

Run as a program, in a process where TRITON_INTERPRET is unset (the test suite sets it for its own
process): `python tests/hopper_compile.py SET` compiles a set of kernels (`moe-decode`: the expert decode
kernels for every codec, float and int8 sides; `router`: the router kernel for each family's rule), one
line a case; exit 1 on the first kernel that does not compile.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

HOPPER_SHARED = 232_448  # bytes of shared memory a block may take on sm_90


class _Utils:
    def get_device_properties(self, device: int) -> dict[str, int]:
        return {"max_shared_mem": HOPPER_SHARED, "multiprocessor_count": 132, "max_num_regs": 65536}

    def load_binary(self, name: str, kernel: bytes, shared: int, device: int) -> tuple[int, ...]:
        return 1, 1, 0, 0, 1024  # (module, function, registers, spills, threads): nothing is loaded

    def unload_module(self, module: int) -> None:
        pass


class HopperCompileOnly:
    """Triton's active-driver interface as far as compiling and launching need it; launches are recorded
    by kernel name, never run."""

    def __init__(self, capability: int = 90) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", capability, 32)
        self.utils = _Utils()
        self.launched: list[str] = []

    def is_active(self) -> bool:
        return True

    def get_current_target(self) -> Any:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def set_current_device(self, device: int) -> None:
        pass

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> Any:
        import torch

        return torch.device("meta")

    def launcher_cls(self, src: Any, metadata: Any) -> Callable[..., None]:
        name = getattr(src, "name", str(src))

        def launch(*args: Any) -> None:
            self.launched.append(name)

        return launch


def compiling_for_hopper() -> HopperCompileOnly:
    """Make Triton compile for sm_90 from here on in this process (TRITON_INTERPRET must be unset)."""
    import os

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("TRITON_INTERPRET=1: Triton's interpreter compiles nothing")
    from triton.runtime.driver import driver

    stand_in = HopperCompileOnly()
    driver.set_active(stand_in)
    return stand_in


def moe_decode_cases() -> list[tuple[str, tuple[str, str] | None, bool, int]]:
    """(label, codecs, int8 activations, tokens): every codec of the decode kernels at batch 1 and 4, the
    int8 sides where they read the codec."""
    from freetoken.runtime.moe.kernels.moe_decode import QUANT_CODECS
    from freetoken.runtime.moe.kernels.moe_decode_int8 import INT8_CODECS

    cases: list[tuple[str, tuple[str, str] | None, bool, int]] = [("bf16", None, False, 1)]
    for name in QUANT_CODECS:
        cases.append((name, (name, name), False, 1))
    for name in INT8_CODECS:
        cases += [(f"{name} int8", (name, name), True, 1), (f"{name} int8 t4", (name, name), True, 4)]
    return cases


def compile_moe_decode(h: int = 2048, i: int = 768, k: int = 8, experts: int = 16) -> list[str]:
    """fused_moe_decode launched once per case on meta tensors at Qwen3-30B-A3B's expert shapes ->
    one line per case (the kernels it compiled)."""
    import torch

    from freetoken.codecs import get_codec
    from freetoken.runtime.moe.kernels.moe_decode import fused_moe_decode

    driver = compiling_for_hopper()
    lines = []
    for label, codecs, int8_act, t in moe_decode_cases():
        meta = torch.device("meta")
        x = torch.empty(t, h, dtype=torch.bfloat16, device=meta)
        ids = torch.empty(t, k, dtype=torch.int64, device=meta)
        w = torch.empty(t, k, dtype=torch.float32, device=meta)
        if codecs is None:
            gu = torch.empty(experts, 2 * i, h, dtype=torch.bfloat16, device=meta)
            dn = torch.empty(experts, h, i, dtype=torch.bfloat16, device=meta)
        else:
            gu_c, dn_c = get_codec(codecs[0]), get_codec(codecs[1])
            gu = torch.empty(experts, 2 * i, gu_c.row_bytes(h), dtype=torch.uint8, device=meta)
            dn = torch.empty(experts, h, dn_c.row_bytes(i), dtype=torch.uint8, device=meta)
        before = len(driver.launched)
        fused_moe_decode(x, ids, w, gu, dn, codecs=codecs, int8_act=int8_act)
        lines.append(f"{label}: {', '.join(driver.launched[before:])}")
    return lines


def router_cases() -> list[tuple[str, Any, int]]:
    """(label, RouterRule, experts): each family's router rule."""
    from freetoken.runtime.moe.kernels.router_topk import RouterRule

    return [
        ("qwen3 softmax renorm", RouterRule(8, "softmax", renormalize=True), 128),
        ("olmoe softmax", RouterRule(8, "softmax"), 64),
        ("deepseek-v3 sigmoid groups", RouterRule(8, "sigmoid", True, True, 8, 4, 2.5), 256),
        ("glm-4.5 sigmoid bias", RouterRule(8, "sigmoid", True, True, scaling=1.8), 128),
        ("gpt-oss topk softmax", RouterRule(4, "topk_softmax"), 128),
        ("deepseek-v4 sqrtsoftplus", RouterRule(6, "sqrtsoftplus", True, True, scaling=1.5), 256),
    ]


def compile_router() -> list[str]:
    """choose_experts launched per rule on meta logits, bf16 and fp32, 1 and 8 rows -> a line each."""
    import torch

    from freetoken.runtime.moe.kernels.router_topk import choose_experts

    driver = compiling_for_hopper()
    lines = []
    for label, rule, e in router_cases():
        before = len(driver.launched)
        for dtype in (torch.bfloat16, torch.float32):
            for t in (1, 8):
                logits = torch.empty(t, e, dtype=dtype, device="meta")
                bias = torch.empty(e, dtype=torch.float32, device="meta") if rule.biased else None
                choose_experts(logits, rule, bias)
        lines.append(f"{label}: {', '.join(sorted(set(driver.launched[before:])))}")
    return lines


SETS = {"moe-decode": compile_moe_decode, "router": compile_router}


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[1] not in SETS:
        print(f"usage: hopper_compile.py {'|'.join(SETS)}", file=sys.stderr)
        return 2
    for line in SETS[argv[1]]():
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
