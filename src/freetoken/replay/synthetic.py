"""Synthetic engines for measurements: random weights in memory, optionally uniform routing.

Used by `bench bw --validate` and the decode benchmarks; nothing here is on the serving path.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from freetoken.errors import FreeTokenError
from freetoken.replay.trace import RoutingTrace
from freetoken.runtime.config import EngineConfig, MoeConfig
from freetoken.runtime.devices import sync_device
from freetoken.runtime.engine import Engine
from freetoken.runtime.loading.demo import DEMO_SPEC, RandomModelSpec, random_weights, write_random_model


def synthetic_engine(spec: RandomModelSpec, device: str, moe: MoeConfig, dtype: str = "auto") -> Engine:
    """An engine over `spec` with random weights drawn in memory (only config and tokenizer touch disk)."""
    with tempfile.TemporaryDirectory(prefix="freetoken-synthetic-") as tmp:
        folder = write_random_model(Path(tmp) / "model", spec, with_weights=False)
        return Engine(EngineConfig(folder, device, dtype, moe), weights=random_weights())


def spec_for_experts(
    hidden: int, intermediate: int, top_k: int, num_experts: int, layers: int
) -> RandomModelSpec:
    """A small model whose experts have the given shape (attention sized to match the hidden size)."""
    heads = max(1, hidden // 128)
    return replace(
        DEMO_SPEC,
        num_layers=layers,
        hidden_size=hidden,
        intermediate_size=4 * intermediate,
        num_heads=heads,
        num_kv_heads=max(1, heads // 8),
        head_dim=128 if hidden >= 128 else hidden,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=intermediate,
    )


def uniform_routing(engine: Engine, seed: int = 0) -> None:
    """Replace every router with uniformly random top-k choices: no locality, an LRU's worst case.

    Random-weight models route very unevenly in deep layers (their hidden states align), which would
    flatter the cache; real locality is what routing traces measure. On CUDA the draws come from the
    default generator (seeded here), which CUDA graphs replay with fresh numbers each step.
    """
    gen = None
    if engine.device.type == "cuda":
        torch.cuda.manual_seed(seed)
    else:
        gen = torch.Generator(device=engine.device).manual_seed(seed)
    top_k = engine.config.num_experts_per_tok
    for block in engine.model.moe_blocks():

        def route(x: torch.Tensor, block=block) -> tuple[torch.Tensor, torch.Tensor]:
            scores = torch.rand(x.shape[0], block.gate.out_features, device=x.device, generator=gen)
            weights, ids = scores.topk(top_k, dim=-1)
            return ids, (weights / weights.sum(-1, keepdim=True)).to(x.dtype)

        block.route = route


def trace_routing(engine: Engine, trace: RoutingTrace) -> None:
    """Replace every router with a recorded trace's choices, row after row (cycling at the end), with
    equal weights: decode speed under real locality on a random-weight model of the same shape."""
    from freetoken.replay.trace import check_matches

    cfg = engine.config
    check_matches(trace, len(cfg.moe_layers), cfg.num_experts, "--routing-trace")
    if len(trace) == 0:
        raise FreeTokenError("--routing-trace: the trace has no rows")
    blocks = engine.model.moe_blocks()
    table = torch.from_numpy(trace.experts).to(engine.device)  # [N, L, K]
    k = trace.top_k
    cursor = torch.zeros(1, dtype=torch.int64, device=engine.device)  # on the device: graphs advance it

    for index, block in enumerate(blocks):

        def route(x: torch.Tensor, index: int = index) -> tuple[torch.Tensor, torch.Tensor]:
            rows = (cursor + torch.arange(x.shape[0], device=x.device)) % table.shape[0]
            if index == len(blocks) - 1:
                cursor.add_(x.shape[0])  # the pass is through its last MoE layer
            ids = table[rows, index]
            return ids, torch.full(ids.shape, 1.0 / k, dtype=x.dtype, device=x.device)

        block.route = route


def decode_steps(
    engine: Engine, warm: int, tokens: int, seed: int = 0, before_measure: Callable[[], object] | None = None
) -> float:
    """Seconds per decode step over a fixed pseudo-random token stream (the same for every backend):
    `warm` steps to settle the cache, then `tokens` measured. Expert counters cover the measured ones;
    `before_measure` is called between the two (to reset other counters)."""
    stream = torch.randint(
        0, engine.config.vocab_size, (warm + tokens,), generator=torch.Generator().manual_seed(seed)
    )
    seq = engine.new_sequence()
    engine.forward(seq, list(range(16)))
    for token in stream[:warm].tolist():  # as serving decodes: a graph replay where the step allows one
        engine.decode_batch([seq], [token])
    engine.moe_counters.reset()
    sync_device(engine.device)
    if before_measure is not None:
        before_measure()
    t0 = time.perf_counter()
    for token in stream[warm:].tolist():
        logits = engine.decode_batch([seq], [token])[-1]
        engine.decoder.wait()  # as the sampler waits: spins, or sleeps where CPU experts fill the cores
        int(logits.argmax())  # the sampler's read-back, as in decoding
    sync_device(engine.device)
    return (time.perf_counter() - t0) / tokens
