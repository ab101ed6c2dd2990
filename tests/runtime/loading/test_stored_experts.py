"""GGUF experts kept as stored: the cpu backend's pool holds the file's blocks (no dequantisation),
reports them in `expert_pool`, and decodes the greedy tokens of transformers given the package's
dequantisation of the same file. Backends with slots keep the codecs the device kernels read (every GGML
type of the codec registry) in the pool and the slots alike, when every layer keeps its experts so (pairs
may differ between layers, as in Q4_K_M files); others are dequantised at load."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from freetoken.formats.gguf_checkpoint import GgufCheckpoint
from freetoken.runtime.engine import build_engine
from freetoken.runtime.moe.kernels.cpu_experts import kernel_available
from gguf_fixture import dequantised_state_dict, write_gguf
from residency_checks import assert_residency_true
from scheduler_runs import PROMPTS, greedy

pytestmark = pytest.mark.skipif(not kernel_available(), reason="needs the compiled CPU kernel")
TOKENS = 10


@pytest.fixture(scope="module")
def q8_file(tiny_model: tuple[Path, Any], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """(the Q8_0 GGUF, transformers holding its dequantised weights)."""
    hf = tiny_model[1]
    path = write_gguf(hf, tiny_model[0], tmp_path_factory.mktemp("stored") / "q8.gguf", "Q8_0")
    ref = type(hf)(hf.config).eval()
    ref.load_state_dict(dequantised_state_dict(path, hf))
    return path, ref


@pytest.mark.parametrize(
    "expert_types",
    [
        ("Q4_K", "Q6_K"),
        ("Q6_K", "Q4_K"),
        ("Q8_0", "Q6_K"),
        ("Q5_K", "Q6_K"),
        ("IQ4_XS", "Q5_K"),
        ("MXFP4", "MXFP4"),
    ],
    ids=["Q4_K_M-like", "swapped", "Q8_0+Q6_K", "Q5_K_M-like", "IQ4_XS+Q5_K", "MXFP4"],
)
def test_k_quant_experts_decode_the_reference_tokens(
    make_model: Any, tmp_path: Path, expert_types: tuple[str, str]
) -> None:
    """Experts of random K-quant blocks (K-quants need rows of 256): kept as stored by the cpu backend,
    the greedy tokens of transformers given gguf's dequantisation of the file."""
    folder, hf = make_model(hidden_size=256, moe_intermediate_size=256, num_experts=4)
    path = write_gguf(hf, folder, tmp_path / "k.gguf", "F32", expert_types=expert_types)
    ref = type(hf)(hf.config).eval()
    ref.load_state_dict(dequantised_state_dict(path, hf))
    engine = build_engine(path, device="cpu", dtype="float32", moe_backend="cpu")
    assert all(engine.pool.codec_names(layer) == expert_types for layer in engine.pool.layers)
    assert sorted(engine.pool.describe()["dtypes"]) == sorted(set(expert_types))
    assert engine.pool.describe()["bytes"] <= 1.02 * expert_file_bytes(path)
    prompts = PROMPTS[:2]
    assert greedy(engine, prompts, TOKENS) == [reference_greedy(ref, prompt, TOKENS) for prompt in prompts]


def reference_greedy(ref: Any, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def expert_file_bytes(path: Path) -> int:
    ckpt = GgufCheckpoint(path)
    return sum(ckpt.nbytes(name) for name in ckpt.names() if ".mlp.experts." in name)


def test_cpu_backend_keeps_the_blocks_and_decodes_the_reference_tokens(q8_file: tuple[Path, Any]) -> None:
    path, ref = q8_file
    engine = build_engine(path, device="cpu", dtype="float32", moe_backend="cpu")
    pool = engine.pool
    assert set(pool.stored) == set(engine.config.moe_layers)
    assert all(pool.codec_names(layer) == ("Q8_0", "Q8_0") for layer in pool.layers)
    assert all(pool.gate_up[layer].dtype == torch.uint8 for layer in pool.layers)
    info = pool.describe()
    assert info["dtypes"] == ["Q8_0"]
    assert expert_file_bytes(path) <= info["bytes"] <= 1.02 * expert_file_bytes(path)
    prompts = PROMPTS[:3]
    want = [reference_greedy(ref, prompt, TOKENS) for prompt in prompts]
    assert greedy(engine, prompts[:1], TOKENS) == want[:1]
    assert greedy(engine, prompts, TOKENS) == want


@pytest.mark.parametrize(
    ("backend", "options"),
    [
        ("offload", {"cache_size": 2}),
        ("offload", {"cache_size": 4}),
        ("offload", {"cache_size": 16}),
        ("cpu", {"cache_size": 4}),
        ("hybrid", {"cache_size": 4, "pcie_gbps": 25.0, "host_gbps": 100.0}),
    ],
)
def test_slots_hold_the_blocks_as_stored(q8_file: tuple[Path, Any], backend: str, options: dict) -> None:
    """The slot backends keep Q8_0 in the pool and in the slots (fills copy blocks; the device computes
    from them), and decode the reference tokens at every cache size, one sequence and three."""
    path, ref = q8_file
    engine = build_engine(path, device="cpu", dtype="float32", moe_backend=backend, **options)
    try:
        bank = engine.executor.bank
        assert engine.pool.describe()["dtypes"] == ["Q8_0"]
        assert all(bank.codecs(layer) == ("Q8_0", "Q8_0") for layer in engine.pool.layers)
        assert bank.gate_up.dtype == torch.uint8 and engine.pool.expert_nbytes == 3 * 64 * 32 // 32 * 34
        prompts = PROMPTS[:3]
        want = [reference_greedy(ref, prompt, TOKENS) for prompt in prompts]
        assert greedy(engine, prompts[:1], TOKENS) == want[:1]
        assert greedy(engine, prompts, TOKENS) == want
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("expert_types", "kept"),
    [
        (("Q4_K", "Q4_K"), True),
        (("MXFP4", "MXFP4"), True),
        (("Q4_K", "Q6_K"), True),
        # by layer (the tiny model's MoE layers are 0 and 2)
        ([("Q4_K", "Q6_K"), ("Q4_K", "Q4_K"), ("Q4_K", "Q4_K")], True),
        ([("Q8_0", "Q4_K"), ("Q8_0", "Q4_K"), ("Q6_K", "Q8_0")], True),
        ([("Q3_K", "Q5_K"), ("Q3_K", "Q5_K"), ("Q2_K", "Q3_K")], True),
        (("IQ2_XXS", "IQ3_S"), True),
        (("Q4_K", "TQ2_0"), False),
        ([("Q4_K", "Q6_K"), ("Q4_K", "Q6_K"), ("Q4_K", "TQ2_0")], False),
    ],
    ids=[
        "Q4_K",
        "MXFP4",
        "Q4_K+Q6_K",
        "Q4_K_M-layers",
        "crossed-layers",
        "Q3_K_M-layers",
        "IQ2_XXS+IQ3_S",
        "Q4_K+TQ2_0",
        "one-layer-TQ2_0",
    ],
)
@pytest.mark.parametrize("backend", ["offload", "hybrid"])
def test_slots_take_the_device_codecs_in_every_layer(
    make_model: Any, tmp_path: Path, expert_types: Any, kept: bool, backend: str
) -> None:
    """Experts of every type the device kernels read stay as stored in slots, the pair free to differ by
    layer (slots as long as the largest pair's expert; fills and kernels see each layer's rows); a layer
    of a type they cannot read (TQ2_0, no codec of ours) makes every layer dequantise at load. The greedy
    tokens are the reference's either way, with slots changing hands between layers of different pairs (3
    slots, 2 layers)."""
    folder, hf = make_model(hidden_size=256, moe_intermediate_size=256, num_experts=4)
    path = write_gguf(hf, folder, tmp_path / "k.gguf", "F32", expert_types=expert_types)
    ref = type(hf)(hf.config).eval()
    ref.load_state_dict(dequantised_state_dict(path, hf))
    pairs = [expert_types] if isinstance(expert_types, tuple) else expert_types
    options = {"pcie_gbps": 25.0, "host_gbps": 100.0} if backend == "hybrid" else {}
    engine = build_engine(path, device="cpu", dtype="float32", moe_backend=backend, cache_size=3, **options)
    try:
        bank, layers = engine.executor.bank, engine.pool.layers
        assert bool(engine.pool.stored) == kept
        if kept:
            assert [bank.codecs(layer) for layer in layers] == [pairs[layer % len(pairs)] for layer in layers]
            assert engine.pool.describe()["bytes"] <= 1.02 * expert_file_bytes(path)
        else:
            assert all(bank.codecs(layer) is None for layer in layers)
        assert greedy(engine, PROMPTS[:2], TOKENS) == [reference_greedy(ref, p, TOKENS) for p in PROMPTS[:2]]
        assert_residency_true(engine)
    finally:
        engine.close()


@pytest.mark.parametrize("hit_d2d", [False, True], ids=["pcie", "hit-d2d"])
def test_streamed_prefill_over_layers_of_different_pairs(
    make_model: Any, tmp_path: Path, hit_d2d: bool
) -> None:
    """Prefill streaming copies whole layers of Q4_K/Q6_K and Q4_K/Q4_K blocks into the flat slots (runs
    into a layer's shorter rows, slot-to-slot copies of resident experts) and gives the reference's
    tokens; the table stays true to the slots' bytes."""
    folder, hf = make_model(hidden_size=256, moe_intermediate_size=256, num_experts=4, num_hidden_layers=4)
    types = [("Q4_K", "Q6_K"), ("Q4_K", "Q6_K"), ("Q4_K", "Q4_K")]  # MoE layers 0, 2, 3
    path = write_gguf(hf, folder, tmp_path / "m.gguf", "F32", expert_types=types)
    ref = type(hf)(hf.config).eval()
    ref.load_state_dict(dequantised_state_dict(path, hf))
    prompt = PROMPTS[3]
    engine = build_engine(
        path, device="cpu", dtype="float32", moe_backend="offload", cache_size=9, max_prefill_tokens=6,
        prefill_stream="on", prefill_hit_d2d=hit_d2d,
    )  # fmt: skip
    try:
        assert engine.executor.bank.codecs(0) != engine.executor.bank.codecs(2)
        assert greedy(engine, [prompt], TOKENS) == [reference_greedy(ref, prompt, TOKENS)]
        totals = engine.moe_counters.totals()
        assert totals["streamed"] + totals["d2d"] > 0 and (totals["d2d"] > 0) == hit_d2d
        assert_residency_true(engine)
    finally:
        engine.close()


def test_run_json_reports_the_expert_pool(q8_file: tuple[Path, Any]) -> None:
    from typer.testing import CliRunner

    from freetoken.cli.app import app

    path, _ = q8_file
    args = ["run", str(path), "-p", "hi", "-n", "2", "--json", "--moe-backend", "cpu"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output.strip().splitlines()[-1])
    assert doc["expert_pool"]["dtypes"] == ["Q8_0"]
    assert doc["expert_pool"]["bytes"] <= 1.02 * expert_file_bytes(path)


@pytest.mark.parametrize("int8_act", [False, True], ids=["weight-only", "int8-activations"])
def test_the_native_decode_step_reads_the_blocks_as_the_python_step_does(
    q8_file: tuple[Path, Any], int8_act: bool
) -> None:
    """bf16 dense weights: the whole-step native decode takes Q8_0 banks and gives the Python step's
    greedy tokens (both compute the experts with the same kernel and activation mode)."""
    path, _ = q8_file
    native = build_engine(path, device="cpu", dtype="bfloat16", moe_backend="cpu", cpu_int8_act=int8_act)
    python = build_engine(path, device="cpu", dtype="bfloat16", moe_backend="cpu", cpu_int8_act=int8_act)
    assert native.pool.stored and native.decoder.native is not None
    python.decoder.native = None
    assert greedy(native, PROMPTS[:3], TOKENS) == greedy(python, PROMPTS[:3], TOKENS)


def test_widening_is_said_with_its_reason(
    make_model: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing widens silently: a layer of a type no codec reads (TQ2_0) is dequantised at load, and so, for
    slots, is every other layer; the log (`-v`) says which and why."""
    folder, hf = make_model(hidden_size=256, moe_intermediate_size=256, num_experts=4)
    types = [("Q4_K", "Q6_K"), ("Q4_K", "Q6_K"), ("Q4_K", "TQ2_0")]  # MoE layers 0 and 2
    path = write_gguf(hf, folder, tmp_path / "k.gguf", "F32", expert_types=types)
    with caplog.at_level("INFO", logger="freetoken.loading"):
        engine = build_engine(path, device="cpu", dtype="float32", moe_backend="offload", cache_size=3)
    engine.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "freetoken.loading"]
    assert "layer 2: experts (Q4_K/TQ2_0) widened at load: no codec reads TQ2_0" in lines[-1]
    assert lines[0].startswith("layer 0: experts (Q4_K/Q6_K) widened at load: slots hold one form")
    caplog.clear()
    with caplog.at_level("INFO", logger="freetoken.loading"):
        fused = build_engine(path, device="cpu", dtype="float32", moe_backend="fused")  # no slots
    assert list(fused.pool.stored) == [0]  # layer by layer
    assert [r.getMessage()[:8] for r in caplog.records if r.name == "freetoken.loading"] == ["layer 2:"]
    fused.close()
