"""Triton kernels compiled for a Hopper GPU (sm_90) on a machine without one.

Triton's interpreter, which the CPU suite runs the kernel bodies under, accepts code the compiler rejects
(a shape held in a local, a pointer cast it cannot lower, a tile past the shared memory), and a GPU lease is
a poor place to find that out. `HopperCompileOnly` stands in for Triton's CUDA driver: it names an sm_90
target, so a launch compiles the kernel to a cubin with the wheel's own ptxas, checks the shared memory
against Hopper's 227 KiB, and then launches nothing. Launches are made on `meta` tensors (no data, no
host reads), so the same wrappers the engine calls run unchanged.

Run as a program, in a process where TRITON_INTERPRET is unset (the test suite sets it for its own
process): `python tests/hopper_compile.py SET` compiles a set of kernels (`moe-decode`: the expert decode
kernels for every codec, float and int8 sides; `router`: the router kernel for each family's rule;
`model`: the decode step's other kernels at published dims), one line a case; exit 1 on the first kernel
that does not compile.
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


def model_kernel_cases() -> list[tuple[str, Callable[[], None]]]:
    """(label, a launch on meta tensors at a family's published dims): the decode step's other kernels."""
    import torch

    from freetoken.runtime.models.kernels import delta_step, latent_attention, norm_rope
    from freetoken.runtime.models.kernels.decode_attention import slot_decode_attention
    from freetoken.runtime.models.kernels.sinkhorn import sinkhorn_kernel
    from freetoken.runtime.models.kernels.slot_write import slot_write

    def t(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype, device="meta")

    def i32(*shape: int) -> torch.Tensor:
        return t(*shape, dtype=torch.int32)

    b, slots, cap = 4, 8, 4096
    return [
        ("gqa attention (qwen3.6 full layers)", lambda: slot_decode_attention(
            t(b, 16, 256), t(slots, 2, cap, 256), t(slots, 2, cap, 256), i32(b), i32(b), 0.0625)),
        ("gqa attention, sinks and window (gpt-oss)", lambda: slot_decode_attention(
            t(b, 64, 64), t(slots, 8, cap, 64), t(slots, 8, cap, 64), i32(b), i32(b), 0.125,
            sinks=t(64, dtype=torch.float32), window=128)),
        ("latent attention (deepseek-v3)", lambda: latent_attention.latent_decode_attention(
            t(b, 128, 576), t(slots, 1, cap, 576), i32(b), i32(b), 0.1, 512)),
        ("norm, rope, kv write (qwen3)", lambda: norm_rope.qk_norm_rope_kv_write(
            t(b, 32 * 128), t(b, 4 * 128), t(b, 4 * 128), t(128), t(128), 1e-6, t(b, 128), t(b, 128),
            t(slots, 4, cap, 128), t(slots, 4, cap, 128), i32(b), i32(b))),
        ("norm, partial rope, zero-centred (qwen3.6)", lambda: norm_rope.qk_norm_rope_kv_write(
            t(b, 16, 256), t(b, 2 * 256), t(b, 2 * 256), t(256), t(256), 1e-6, t(b, 64), t(b, 64),
            t(slots, 2, cap, 256), t(slots, 2, cap, 256), i32(b), i32(b), zero_centred=True)),
        ("add rms norm", lambda: norm_rope.add_rms_norm(t(b, 2048), t(b, 2048), t(2048), 1e-6)),
        ("causal conv step (qwen3.6)", lambda: delta_step.causal_conv_step(
            t(b, 8192), t(slots, 8192, 3), t(8192, 1, 4), i32(b))),
        ("gated delta rule step (qwen3.6)", lambda: delta_step.delta_rule_step(
            t(b, 2 * 16 * 128 + 32 * 128), t(b, 32), t(b, 32), t(32, dtype=torch.float32),
            t(32, dtype=torch.float32), t(slots, 32, 128, 128, dtype=torch.float32), i32(b), 16, 128)),
        ("kda rule step (kimi-linear)", lambda: delta_step.kda_rule_step(
            t(b, 3 * 32 * 128), t(b, 32), t(b, 32, 128, dtype=torch.float32),
            t(slots, 32, 128, 128, dtype=torch.float32), i32(b))),
        ("sinkhorn (deepseek-v4 hyper-connections)", lambda: sinkhorn_kernel(
            t(b, 4, 4, dtype=torch.float32), 20, 1e-6)),
        ("slot write (latent cache)", lambda: slot_write(t(b, 576), t(slots, 1, cap, 576), i32(b), i32(b))),
    ]  # fmt: skip


def compile_model_kernels() -> list[str]:
    driver = compiling_for_hopper()
    lines = []
    for label, launch in model_kernel_cases():
        before = len(driver.launched)
        launch()
        lines.append(f"{label}: {', '.join(sorted(set(driver.launched[before:])))}")
    return lines


SETS = {"moe-decode": compile_moe_decode, "router": compile_router, "model": compile_model_kernels}


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[1] not in SETS:
        print(f"usage: hopper_compile.py {'|'.join(SETS)}", file=sys.stderr)
        return 2
    for line in SETS[argv[1]]():
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
