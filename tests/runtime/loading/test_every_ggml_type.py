"""Every GGML type of the codec registry in every family read from GGUF with its own experts (typed_gguf.py's
files, each type x each family), kept as stored under every backend: the engine's logits are
transformers' given the reference dequantisation of the same blocks (gguf's) within 1e-3, its greedy
tokens the same; the pool reports the file's expert types and holds no more than the file's expert bytes
(2%)."""

from __future__ import annotations

from typing import Any

import pytest

from freetoken.runtime.engine import build_engine
from freetoken.runtime.moe.kernels.cpu_experts import kernel_available
from freetoken.runtime.sampling import SamplingParams
from oracle import rel_err
from typed_gguf import FAMILIES, TYPES, expert_file_bytes, reference_run, typed_file

pytestmark = pytest.mark.skipif(not kernel_available(), reason="needs the compiled CPU kernel")

BACKENDS = [
    ("cpu", {}),
    ("fused", {}),
    ("offload", {"cache_size": 3}),
    ("hybrid", {"cache_size": 3, "pcie_gbps": 25.0, "host_gbps": 100.0}),
]
PROMPT = [5, 77, 301, 12, 9, 250, 33, 401]
TOKENS = 6


CASES = [(n, family) for n in range(len(TYPES)) for family in FAMILIES]


@pytest.fixture(scope="module", params=CASES, ids=[f"{TYPES[n]}-{family}" for n, family in CASES])
def typed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, ...]:
    """(GGUF path, its (gate/up, down) types, the reference's logits and greedy tokens)."""
    n, family = request.param
    path, pair, ref = typed_file(n, tmp_path_factory.mktemp(f"{TYPES[n]}-{family}"), family)
    return (path, pair, *reference_run(ref, PROMPT, TOKENS))


@pytest.mark.parametrize(("backend", "options"), BACKENDS, ids=[b for b, _ in BACKENDS])
def test_each_type_is_kept_and_gives_the_references_logits_and_tokens(
    typed: tuple[Any, ...], backend: str, options: dict[str, Any]
) -> None:
    path, pair, want_logits, want_tokens = typed
    engine = build_engine(path, device="cpu", dtype="float32", moe_backend=backend, **options)
    try:
        pool = engine.pool
        assert all(pool.codec_names(layer) == pair for layer in pool.layers), backend
        info = pool.describe()
        assert sorted(info["dtypes"]) == sorted(set(pair))
        assert expert_file_bytes(path) <= info["bytes"] <= 1.02 * expert_file_bytes(path)
        logits = engine.forward(engine.new_sequence(), PROMPT, all_logits=True)
        assert rel_err(logits, want_logits) < 1e-3
        engine.reset()
        params = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
        assert [e.token_id for e in engine.generate(PROMPT, params)] == want_tokens
    finally:
        engine.close()
