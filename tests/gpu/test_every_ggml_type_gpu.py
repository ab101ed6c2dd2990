"""Every GGML type of the codec registry in the device's slots (typed_gguf.py's files): the Triton kernels
read each type's blocks in place inside the captured decode step; fp32 activations give transformers'
logits over the reference dequantisation within 1e-3 and its greedy tokens, bf16 ones its logits within
what bf16 costs the whole model."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from freetoken.runtime.engine import build_engine
from freetoken.runtime.sampling import SamplingParams
from oracle import rel_err
from typed_gguf import TYPES, reference_run, typed_file

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
PROMPT = [5, 77, 301, 12, 9, 250, 33, 401]
TOKENS = 6


@pytest.fixture(scope="module", params=range(len(TYPES)), ids=TYPES)
def typed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, ...]:
    path, pair, ref = typed_file(request.param, tmp_path_factory.mktemp(TYPES[request.param]))
    return (path, pair, *reference_run(ref, PROMPT, TOKENS))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("backend", "options"), [("offload", {"cache_size": 3}), ("fused", {})])
def test_each_type_in_the_slots(typed: tuple[Any, ...], dtype: str, backend: str, options: dict) -> None:
    path, pair, want_logits, want_tokens = typed
    engine = build_engine(path, device="cuda", dtype=dtype, moe_backend=backend, **options)
    try:
        assert all(engine.pool.codec_names(layer) == pair for layer in engine.pool.layers)
        assert engine.executor.graph_blocker(1) is None
        logits = engine.forward(engine.new_sequence(), PROMPT, all_logits=True).float().cpu()
        # bf16 rounds every layer of the model, not only the experts: up to 5e-2 on these tiny random
        # families (H100); blocks read wrong give errors of order 1
        assert rel_err(logits, want_logits) < (1e-3 if dtype == "float32" else 1e-1)
        if dtype == "float32":
            engine.reset()
            params = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
            assert [e.token_id for e in engine.generate(PROMPT, params)] == want_tokens
    finally:
        engine.close()
