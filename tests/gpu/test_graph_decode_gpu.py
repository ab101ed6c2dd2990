"""Graph-replayed decode on CUDA: the same greedy tokens as eager and as the CPU fp32 reference, for
batches of 1, 3 and 8 sequences of different lengths; no host sync inside a step; fixed KV storage."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from freetoken.runtime.decode_graph import padded_size
from freetoken.runtime.engine import build_engine
from freetoken.runtime.kv.prefix_cache import PrefixCache
from freetoken.runtime.sampling import SamplingParams
from freetoken.runtime.scheduler import Scheduler
from oracle import rel_err
from scheduler_runs import PROMPTS, decode_steps_without_sync, greedy, running_requests

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_graph_replay_equals_eager_and_the_cpu_reference(tiny_model: tuple[Path, Any], batch: int) -> None:
    prompts = PROMPTS[:batch]
    reference = greedy(build_engine(tiny_model[0], device="cpu", dtype="float32"), prompts)
    fp32 = build_engine(tiny_model[0], device="cuda", dtype="float32", moe_backend="fused")
    assert greedy(fp32, prompts) == reference
    assert fp32.decoder is not None and fp32.decoder.replays > 0
    graphed = build_engine(tiny_model[0], device="cuda", dtype="bfloat16", moe_backend="fused")
    eager = build_engine(tiny_model[0], device="cuda", dtype="bfloat16", moe_backend="fused")
    assert eager.decoder is not None
    eager.decoder.disable_graphs("test: the eager side of the comparison")
    got = greedy(graphed, prompts)
    assert got == greedy(eager, prompts)
    assert graphed.decoder is not None and graphed.decoder.replays > 0 and eager.decoder.replays == 0
    # bf16 against the fp32 reference, within tolerance: one replayed step's logits
    cpu = build_engine(tiny_model[0], device="cpu", dtype="float32")
    logits = {}
    for name, engine in (("cpu", cpu), ("graph", graphed)):
        engine.reserve_slots(batch)
        seqs = [engine.new_sequence() for _ in prompts]
        for seq, prompt in zip(seqs, prompts, strict=True):
            engine.prefill(seq, prompt)
        logits[name] = engine.decode_batch(seqs, [40 + i for i in range(batch)]).float().cpu()
    assert rel_err(logits["graph"], logits["cpu"]) < 3e-2


def test_sampled_decode_replays_and_is_seeded(tiny_model: tuple[Path, Any]) -> None:
    engine = build_engine(tiny_model[0], device="cuda", dtype="bfloat16", moe_backend="fused")
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=10, ignore_eos=True)
    first = [e.token_id for e in engine.generate(PROMPTS[1], params)]
    engine.reset()
    assert [e.token_id for e in engine.generate(PROMPTS[1], params)] == first
    assert engine.decoder is not None and engine.decoder.replays > 0


@pytest.mark.parametrize("batch", [1, 3])
def test_temperature_only_sampling_replays_the_draw_graph_and_matches_the_cpu(
    tiny_model: tuple[Path, Any], batch: int
) -> None:
    """Temperature without top-k/top-p runs the sort-free 'draw' graph; seeded rows draw what the CPU
    fp32 engine draws from the same logits (the noise is a hash of seed, step and token id)."""
    params = SamplingParams(temperature=0.7, seed=99, max_tokens=8, ignore_eos=True)
    got = []
    for device, dtype in (("cuda", "float32"), ("cpu", "float32")):
        engine = build_engine(tiny_model[0], device=device, dtype=dtype, moe_backend="fused")
        engine.reserve_slots(batch)
        scheduler = Scheduler(engine, PrefixCache(0), max_running=batch)
        out: list[list[Any]] = [[] for _ in range(batch)]
        for i in range(batch):
            scheduler.add(PROMPTS[i], params, out[i].append)
        while scheduler.has_work():
            scheduler.step()
        got.append([[e.token_id for e in events] for events in out])
        if device == "cuda":
            assert engine.decoder is not None and (padded_size(batch), "draw") in engine.decoder.captured
    assert got[0] == got[1]


def test_a_step_issues_no_host_sync_but_the_read_back(tiny_model: tuple[Path, Any]) -> None:
    engine = build_engine(tiny_model[0], device="cuda", dtype="bfloat16", moe_backend="fused")
    decode_steps_without_sync(engine, running_requests(engine, PROMPTS[:3]), 5)


def test_kv_storage_stays_put_over_1000_steps(tiny_model: tuple[Path, Any]) -> None:
    engine = build_engine(tiny_model[0], device="cuda", dtype="bfloat16", moe_backend="fused")
    pointers = [t.data_ptr() for t in (*engine.kv_pool.k, *engine.kv_pool.v)]
    events = list(engine.generate(PROMPTS[0], SamplingParams(max_tokens=1000, ignore_eos=True)))
    assert len(events) == 1000
    assert [t.data_ptr() for t in (*engine.kv_pool.k, *engine.kv_pool.v)] == pointers
    assert engine.decoder is not None and engine.decoder.replays >= 999


def test_a_batch_above_the_largest_graph_runs_in_parts(tiny_model: tuple[Path, Any]) -> None:
    prompts = [[i + 1, 2 * i + 3] for i in range(20)]  # 20 rows: more than the largest captured size
    engine = build_engine(tiny_model[0], device="cuda", dtype="float32", moe_backend="fused")
    reference = build_engine(tiny_model[0], device="cpu", dtype="float32")
    assert greedy(engine, prompts, tokens=4) == greedy(reference, prompts, tokens=4)
