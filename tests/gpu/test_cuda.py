"""CUDA against CPU: same model, same logits. Skipped without a CUDA device."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from freetoken.runtime.engine import build_engine
from oracle import rel_err
from residency_checks import assert_residency_true

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
PROMPT = [5, 77, 301, 12, 9, 250, 33, 401, 18, 2, 64, 111]


@pytest.mark.parametrize("backend", ["fused", "cpu"])
def test_cuda_logits_equal_cpu_fp32(tiny_model: tuple[Path, Any], backend: str) -> None:
    cpu = build_engine(tiny_model[0], device="cpu", dtype="float32")
    gpu = build_engine(tiny_model[0], device="cuda", dtype="float32", moe_backend=backend)
    ids = list(PROMPT)
    ref = cpu.forward(cpu.new_sequence(), ids, all_logits=True)
    seq = gpu.new_sequence()
    ours = gpu.forward(seq, ids, all_logits=True)
    assert ours.device.type == "cuda"
    assert rel_err(ours, ref) < 1e-4
    cpu_seq = cpu.new_sequence()
    cpu.forward(cpu_seq, ids)
    for _ in range(8):
        nxt = int(ref[-1].argmax())
        ref, ours = cpu.forward(cpu_seq, [nxt]), gpu.forward(seq, [nxt])
        assert rel_err(ours, ref) < 1e-4


@pytest.mark.parametrize("backend", ["fused", "cpu"])
def test_cuda_bf16_close_to_cpu_bf16(tiny_model: tuple[Path, Any], backend: str) -> None:
    cpu = build_engine(tiny_model[0], device="cpu", dtype="bfloat16")
    gpu = build_engine(tiny_model[0], device="cuda", dtype="bfloat16", moe_backend=backend)
    ref = cpu.forward(cpu.new_sequence(), PROMPT, all_logits=True)
    assert rel_err(gpu.forward(gpu.new_sequence(), PROMPT, all_logits=True), ref) < 2e-2
    # decode steps take the sync-free gathered path on the GPU
    seq, cpu_seq = gpu.new_sequence(), cpu.new_sequence()
    gpu.forward(seq, PROMPT)
    cpu.forward(cpu_seq, PROMPT)
    for token in (3, 99, 250):
        assert rel_err(gpu.forward(seq, [token]), cpu.forward(cpu_seq, [token])) < 2e-2


@pytest.mark.parametrize("backend", ["hybrid", "cpu", "offload"])
def test_without_a_profile_the_bandwidths_are_measured(tiny_model: tuple[Path, Any], backend: str) -> None:
    """No `bench bw` profile (the suite's home is empty) and no flags: a cached backend measures B_P and
    B_H at start — hybrid then fetches a share of its misses instead of leaving every one to the CPU, and
    every backend can weigh streaming a prompt's layers."""
    gpu = build_engine(tiny_model[0], device="cuda", dtype="float32", moe_backend=backend, cache_size=4)
    try:
        executor = gpu.executor
        assert executor.pcie_bw > 0 and executor.host_bw > 0
        if backend == "hybrid":
            assert float(executor.residency.fetch.min()) > 0
    finally:
        gpu.close()


@pytest.mark.parametrize(
    ("backend", "options"),
    [
        ("offload", {"cache_size": 2}),
        ("offload", {"cache_size": 5, "cpu_layers": "2,"}),
        ("cpu", {"cache_size": 4}),
        ("hybrid", {"cache_size": 4, "pcie_gbps": 25.0, "host_gbps": 100.0}),
    ],
)
def test_cached_backends_on_cuda_equal_fused(
    tiny_model: tuple[Path, Any], backend: str, options: dict
) -> None:
    """Fills on the transfer stream, the CPU branch thread and the merge, against fused on the CPU."""
    from freetoken.runtime.sampling import SamplingParams

    ref = build_engine(tiny_model[0], device="cpu", dtype="float32", moe_backend="fused")
    gpu = build_engine(tiny_model[0], device="cuda", dtype="float32", moe_backend=backend, **options)
    try:
        params = SamplingParams(max_tokens=24, ignore_eos=True)
        assert [e.token_id for e in gpu.generate(PROMPT, params)] == [
            e.token_id for e in ref.generate(PROMPT, params)
        ]
        seq, ref_seq = gpu.new_sequence(), ref.new_sequence()
        assert (
            rel_err(gpu.forward(seq, PROMPT, all_logits=True), ref.forward(ref_seq, PROMPT, all_logits=True))
            < 1e-4
        )
        for start in range(0, 12, 3):  # three tokens per step
            chunk = [(17 * (start + i)) % 700 for i in range(3)]
            assert (
                rel_err(
                    gpu.forward(seq, chunk, all_logits=True), ref.forward(ref_seq, chunk, all_logits=True)
                )
                < 1e-4
            )
        totals = gpu.moe_counters.totals()
        assert totals["fills"] + totals["cpu"] == totals["misses"]
        assert_residency_true(gpu)
        assert gpu.pool.pinned
    finally:
        gpu.close()


@pytest.mark.parametrize(
    "options",
    [
        {"prefill_overlap": True},
        {"prefill_overlap": False},
        {"prefill_overlap": True, "prefill_hit_d2d": True},
        {"prefill_overlap": True, "moe_backend": "cpu", "cache_size": 0},  # a scratch bank of two layers
        {"prefill_overlap": True, "cache_size": 12},
    ],
    ids=["overlap", "serial", "hit-d2d", "cpu-scratch", "offload-scratch"],
)
def test_streamed_prefill_on_cuda_equals_fused(tmp_path: Path, options: dict) -> None:
    """Double buffering on the transfer stream with its ready/release events, against fused on the CPU."""
    from freetoken.runtime.sampling import SamplingParams
    from oracle import build_hf_model

    build_hf_model(tmp_path, num_hidden_layers=5, mlp_only_layers=[1])  # 4 MoE layers of 8 experts
    prompt = [(37 * i + 11) % 700 for i in range(150)]
    ref = build_engine(tmp_path, device="cpu", dtype="float32", moe_backend="fused")
    gpu = build_engine(
        tmp_path,
        device="cuda",
        dtype="float32",
        max_prefill_tokens=7,
        prefill_stream="on",
        **{"moe_backend": "offload", "cache_size": 20, **options},
    )
    try:
        want = ref.forward(ref.new_sequence(), prompt, all_logits=True)[-1:]
        assert rel_err(gpu.prefill(gpu.new_sequence(), prompt), want) < 1e-4
        assert gpu.moe_counters.totals()["streamed"] > 0
        assert (gpu.executor.scratch is not None) == (gpu.num_slots < 16)
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        gpu.reset()
        ref.reset()
        assert [e.token_id for e in gpu.generate(prompt, params)] == [
            e.token_id for e in ref.generate(prompt, params)
        ]
        assert_residency_true(gpu)
    finally:
        gpu.close()


def test_batched_decode_on_cuda_equals_one_at_a_time(tiny_model: tuple[Path, Any]) -> None:
    """Several sequences in one decode step, experts through the slot cache on CUDA."""
    ref = build_engine(tiny_model[0], device="cpu", dtype="float32", moe_backend="fused")
    gpu = build_engine(tiny_model[0], device="cuda", dtype="float32", moe_backend="hybrid", cache_size=4)
    prompts = [[5, 77, 301, 12], [9, 250, 33, 401, 18], [111, 7]]
    try:
        seqs, refs = [gpu.new_sequence() for _ in prompts], [ref.new_sequence() for _ in prompts]
        nxt = []
        for seq, r, prompt in zip(seqs, refs, prompts, strict=True):
            gpu.forward(seq, prompt)
            nxt.append(int(ref.forward(r, prompt)[-1].argmax()))
        for _ in range(5):
            logits = gpu.decode_batch(seqs, nxt)
            for i, r in enumerate(refs):
                assert rel_err(logits[i], ref.forward(r, [nxt[i]])[-1]) < 1e-4
            nxt = [int(row.argmax()) for row in logits]
    finally:
        gpu.close()


@pytest.mark.parametrize("rules", ["torch", "auto"])
def test_hybrid_model_on_cuda_equals_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rules: str) -> None:
    """Qwen3.5-MoE (DeltaNet states, gated attention, shared expert) on CUDA, experts through the cache.

    `torch`: the torch delta rules, fp32 throughout (1e-4). `auto`: flash-linear-attention's kernels, whose
    fp32 dots run on the tensor cores in tf32 (measured 4.5e-4 on this model), hence 2e-3."""
    pytest.importorskip("transformers.models.qwen3_5_moe")
    from freetoken.runtime.models.delta_kernels import fla_rules
    from oracle import build_hybrid_model

    monkeypatch.setenv("FREETOKEN_LINEAR_ATTENTION", rules)
    fla_rules.cache_clear()
    if rules == "auto" and fla_rules() is None:
        pytest.skip("flash-linear-attention is not installed")
    tol = 1e-4 if rules == "torch" else 2e-3
    build_hybrid_model(tmp_path)
    cpu = build_engine(tmp_path, device="cpu", dtype="float32", moe_backend="fused")
    gpu = build_engine(tmp_path, device="cuda", dtype="float32", moe_backend="hybrid", cache_size=4)
    try:
        ref_seq, seq = cpu.new_sequence(), gpu.new_sequence()
        ref = cpu.forward(ref_seq, PROMPT, all_logits=True)
        assert rel_err(gpu.forward(seq, PROMPT, all_logits=True), ref) < tol
        for _ in range(6):
            nxt = int(ref[-1].argmax())
            ref = cpu.forward(ref_seq, [nxt])
            assert rel_err(gpu.forward(seq, [nxt]), ref) < tol
    finally:
        gpu.close()
        fla_rules.cache_clear()


@pytest.mark.gpu
def test_fla_kernels_equal_the_torch_delta_rule() -> None:
    """flash-linear-attention's kernels (when installed) against the torch rules, prefill and decode."""
    pytest.importorskip("fla")
    from freetoken.runtime.models.delta_kernels import fla_delta_rule
    from freetoken.runtime.models.delta_net import _l2norm, chunked_delta_rule, delta_rule

    gen = torch.Generator(device="cuda").manual_seed(0)
    t, hv, dk, dv = 200, 4, 64, 64
    q = _l2norm(torch.randn(t, hv, dk, device="cuda", generator=gen)) * dk**-0.5
    k = _l2norm(torch.randn(t, hv, dk, device="cuda", generator=gen))
    v = torch.randn(t, hv, dv, device="cuda", generator=gen)
    g = -torch.rand(t, hv, device="cuda", generator=gen)
    beta = torch.rand(t, hv, device="cuda", generator=gen)
    s0 = torch.randn(hv, dk, dv, device="cuda", generator=gen) * 0.1
    ours, theirs = s0.clone(), s0.clone()
    want = chunked_delta_rule(q[:-1], k[:-1], v[:-1], g[:-1], beta[:-1], ours)
    got = fla_delta_rule(q[:-1], k[:-1], v[:-1], g[:-1], beta[:-1], theirs, torch.float32)
    assert rel_err(got, want) < 2e-3 and rel_err(theirs, ours) < 2e-3
    step_want = delta_rule(q[-1:], k[-1:], v[-1:], g[-1:], beta[-1:], ours)
    step_got = fla_delta_rule(q[-1:], k[-1:], v[-1:], g[-1:], beta[-1:], theirs, torch.float32)
    assert rel_err(step_got, step_want) < 2e-3 and rel_err(theirs, ours) < 2e-3
