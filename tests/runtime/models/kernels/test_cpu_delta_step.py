"""The native CPU DeltaNet step (delta_step_cpu.c) in the decode: inputs it does not take go to the
reference, the CPU ops carry it, and the hybrid models' decode through it gives the same greedy tokens
as through the references (its calls against the references: test_delta_step.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from freetoken.runtime.engine import build_engine
from freetoken.runtime.models.kernels.cpu_delta_step import cpu_conv_step, cpu_delta_step, cpu_kda_step
from freetoken.runtime.models.kernels.delta_step import (
    causal_conv_step_reference,
    delta_rule_step_reference,
    kda_rule_step_reference,
)
from freetoken.runtime.models.slot_decode import DecodeOps
from freetoken.runtime.moe.kernels.loader import load_library
from freetoken.runtime.sampling import SamplingParams
from oracle import build_family_model, build_hybrid_model, build_qwen3_next_model

pytestmark = pytest.mark.skipif(load_library() is None, reason="needs the compiled CPU kernels")

HK, HV, DK, DV = 2, 4, 8, 12


def randn(*shape: int, seed: int, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def test_an_input_the_kernel_does_not_take_runs_the_reference() -> None:
    mixed = randn(1, 2 * HK * DK + HV * DV, seed=4, dtype=torch.float16)  # fp16: not a native element
    b = a = randn(1, HV, seed=5, dtype=torch.float16)
    state = randn(1, HV, DK, DV, seed=8)
    want_state = state.clone()
    slots = torch.tensor([0], dtype=torch.int32)
    got = cpu_delta_step(mixed, b, a, randn(HV, seed=6), randn(HV, seed=7), state, slots, HK, DK)
    want = delta_rule_step_reference(
        mixed, b, a, randn(HV, seed=6), randn(HV, seed=7), want_state, slots, HK, DK
    )
    assert torch.equal(got, want) and torch.equal(state, want_state)


def test_cpu_ops_take_the_native_delta_step() -> None:
    ops = DecodeOps.for_device(torch.device("cpu"))
    assert (ops.conv_step, ops.delta_step, ops.kda_step) == (cpu_conv_step, cpu_delta_step, cpu_kda_step)


def build_kimi_linear(folder: Path) -> Any:
    return build_family_model(folder, "kimi_linear")


BUILDS = [build_hybrid_model, build_qwen3_next_model, build_kimi_linear]


@pytest.mark.parametrize("build", BUILDS, ids=["qwen3_5_moe", "qwen3_next", "kimi_linear"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hybrid_decode_through_the_native_step_gives_the_references_tokens(
    tmp_path: Path, build: Callable[[Path], Any], dtype: str
) -> None:
    build(tmp_path)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompt = [5, 77, 301, 12, 9]
    tokens = []
    for native in (True, False):
        engine = build_engine(tmp_path, device="cpu", dtype=dtype, moe_backend="cpu")
        if not native:  # the same step with the references in place of the native calls
            ops = engine.decoder.ops
            engine.decoder.ops = replace(
                ops,
                conv_step=causal_conv_step_reference,
                delta_step=delta_rule_step_reference,
                kda_step=kda_rule_step_reference,
            )
        tokens.append([e.token_id for e in engine.generate(prompt, params) if e.token_id is not None])
        engine.close()
    assert tokens[0] == tokens[1] and len(tokens[0]) == 12
