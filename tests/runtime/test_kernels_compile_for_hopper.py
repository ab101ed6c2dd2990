"""The Triton kernels compiled for sm_90 with the wheel's own compiler and ptxas, on a machine without a
GPU (tests/hopper_compile.py): the expert decode kernels for every codec, float and int8 sides, batch 1 and
4; the router kernel for each family's rule; the decode step's attention, norm/rope, DeltaNet, KDA,
Sinkhorn and slot-write kernels at the families' published dims. The interpreter runs these bodies in the
other tests; it accepts code the compiler rejects."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from freetoken.runtime.moe.kernels.moe_decode import triton_available
from hopper_compile import SETS, model_kernel_cases, moe_decode_cases, router_cases

TESTS = Path(__file__).resolve().parents[1]


def compiled(kernel_set: str) -> dict[str, str]:
    """hopper_compile.py SET in a process without the interpreter -> {case: the kernels it launched}."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent / "src"), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, str(TESTS / "hopper_compile.py"), kernel_set], env=env, capture_output=True,
        text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return dict(line.split(": ", 1) for line in done.stdout.splitlines())


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("kernel_set", sorted(SETS))
def test_kernels_compile_for_hopper(kernel_set: str) -> None:
    lines = compiled(kernel_set)
    if kernel_set == "moe-decode":
        assert set(lines) == {label for label, *_ in moe_decode_cases()}
        assert all("gate_up_int8_kernel" in lines[label] for label in lines if "int8" in label)
        assert all("down_sum_kernel" in lines[label] for label in lines if "int8" not in label)
    elif kernel_set == "router":
        assert lines == {label: "router_topk_kernel" for label, *_ in router_cases()}
    else:
        assert set(lines) == {label for label, _ in model_kernel_cases()}
        assert all(lines.values())
