"""The frontier models' expert counts at full scale with a tiny hidden size.

DeepSeek-V3's routing as published (256 routed experts a layer in 8 groups of which the best 4 are kept,
8 chosen by sigmoid score plus a correction bias, weights times routed_scaling_factor, one shared expert,
the first 3 of 61 layers dense) and Kimi-K2's (384 experts in one group, the first of 61 layers dense),
built by transformers with hidden 32: every backend and cache size {top-k, 25%, 100% of the pool} gives
transformers' fp32 greedy tokens for one sequence and for three decoded together, and the slot count a
cache ratio or a VRAM budget gives is the one computed here from the routed experts' bytes. DeepSeek-V3
is saved as published (a tensor per expert: 44,544), Kimi-K2 as whole banks per layer.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from freetoken.runtime.config import MoeConfig
from freetoken.runtime.engine import Engine, build_engine
from freetoken.runtime.sampling import SamplingParams
from oracle import DEEPSEEK_TINY, build_family_model
from residency_checks import assert_residency_true
from scheduler_runs import PROMPTS, greedy

STEPS = 8  # decode steps per sequence
LAYERS, HIDDEN, MOE_INTERMEDIATE, DENSE_INTERMEDIATE, TOP_K = 61, 32, 16, 48, 8
SHAPE = dict(
    num_hidden_layers=LAYERS, hidden_size=HIDDEN, moe_intermediate_size=MOE_INTERMEDIATE,
    intermediate_size=DENSE_INTERMEDIATE, num_attention_heads=2, num_key_value_heads=2,
    num_experts_per_tok=TOP_K, n_shared_experts=1,
)  # fmt: skip


class Family(NamedTuple):
    routing: dict[str, Any]  # over the deepseek_v3 tiny config
    seed: int  # one whose greedy tokens vary (61 random layers often settle on one token)
    whole_banks: bool  # saved as one bank per layer rather than a tensor per expert


FAMILIES = {
    "deepseek_v3": Family(
        dict(n_routed_experts=256, n_group=8, topk_group=4, first_k_dense_replace=3,
             routed_scaling_factor=2.5),
        seed=0, whole_banks=False,
    ),
    "kimi_k2": Family(
        dict(n_routed_experts=384, n_group=1, topk_group=1, first_k_dense_replace=1,
             routed_scaling_factor=2.827),
        seed=2, whole_banks=True,
    ),
}  # fmt: skip
BANDWIDTHS = {"pcie_gbps": 25.0, "host_gbps": 100.0}  # hybrid's split without a bandwidth profile
# One routed expert's gate, up and down in fp32: what a slot holds. The dense MLP (48 wide) and the
# shared expert are never slots.
EXPERT_BYTES = 3 * HIDDEN * MOE_INTERMEDIATE * 4
# One position's latent attention cache over every layer: the latent and the rope key, fp32.
KV_TOKEN_BYTES = LAYERS * (DEEPSEEK_TINY["kv_lora_rank"] + DEEPSEEK_TINY["qk_rope_head_dim"]) * 4


@dataclass
class Scale:
    family: str
    model: Any = field(repr=False)  # transformers' model, fp32
    engine: Engine = field(repr=False)  # loaded once; each test configures its backend over the same pool
    experts: int  # routed experts per MoE layer
    dense: int  # leading dense layers
    three: list[list[int]] = field(repr=False)  # the reference's greedy tokens after each of PROMPTS[:3]

    @property
    def pool(self) -> int:
        """Routed experts over every MoE layer: what 100% of the slots hold."""
        return (LAYERS - self.dense) * self.experts


def reference(model: Any, prompt: list[int]) -> list[int]:
    """transformers' greedy tokens after `prompt`, decoding with its own cache."""
    from transformers import DynamicCache

    ids, cache, out = torch.tensor([prompt]), DynamicCache(config=model.config), []
    with torch.no_grad():
        for _ in range(STEPS):
            out.append(int(model(ids, cache=cache, use_cache=True).logits[0, -1].argmax()))
            ids = torch.tensor([[out[-1]]])
    return out


@pytest.fixture(scope="module", params=list(FAMILIES))
def scale(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scale]:
    routing, seed, whole_banks = FAMILIES[request.param]
    folder: Path = tmp_path_factory.mktemp(f"scale-{request.param}")
    model = build_family_model(folder, "deepseek_v3", seed, whole_banks, **SHAPE, **routing)
    threads = torch.get_num_threads()  # the engine's --moe-cpu-threads sets torch's: restored after
    engine = build_engine(folder, device="cpu", dtype="float32", moe_backend="fused")
    yield Scale(
        request.param, model, engine, routing["n_routed_experts"], routing["first_k_dense_replace"],
        [reference(model, p) for p in PROMPTS[:3]],
    )  # fmt: skip
    engine.close()
    torch.set_num_threads(threads)


def configure(scale: Scale, backend: str, **options: Any) -> Engine:
    """The engine over `backend`, with one CPU thread (--moe-cpu-threads, torch's too): on a 2-core runner
    small torch ops ran about ten times slower while a CPU branch of two threads was up beside torch's."""
    extra = dict(BANDWIDTHS) if backend == "hybrid" else {}
    scale.engine.configure_moe(MoeConfig(backend, cpu_threads=1, **extra, **options))
    scale.engine.reset()
    return scale.engine


def test_the_config_and_pool_hold_the_published_routing(scale: Scale) -> None:
    cfg, pool = scale.engine.config, scale.engine.pool
    routing = FAMILIES[scale.family].routing
    assert cfg.moe_layers == tuple(range(scale.dense, LAYERS)) and pool.layers == cfg.moe_layers
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.router_scoring) == (scale.experts, TOP_K, "sigmoid")
    assert (cfg.n_group, cfg.topk_group) == (routing["n_group"], routing["topk_group"])
    assert cfg.routed_scaling_factor == routing["routed_scaling_factor"] and cfg.n_shared_experts == 1
    # the pool holds the routed experts only: no shared expert, no dense layer
    assert pool.num_experts == scale.experts and pool.expert_nbytes == EXPERT_BYTES
    assert pool.nbytes == scale.pool * EXPERT_BYTES
    assert all(len(set(tokens)) > 2 for tokens in scale.three)  # tokens that tell routings apart


# (backend, cache size): top-k is exactly one layer's choice of slots, the rest shares of the pool
CASES = [("fused", None)] + [
    (backend, size) for backend in ("offload", "cpu", "hybrid") for size in ("top-k", 0.25, 1.0)
]


@pytest.mark.parametrize(("backend", "size"), CASES, ids=[f"{b}-{s}" for b, s in CASES])
def test_every_backend_and_cache_size_gives_the_reference_tokens(
    scale: Scale, backend: str, size: str | float | None
) -> None:
    if size is None:
        engine, want_slots = configure(scale, backend), 0
    elif size == "top-k":
        engine, want_slots = configure(scale, backend, cache_size=TOP_K), TOP_K
    else:
        engine, want_slots = configure(scale, backend, cache_ratio=size), round(size * scale.pool)
    assert engine.backend == backend and engine.num_slots == want_slots
    out = engine.generate(PROMPTS[1], SamplingParams(max_tokens=STEPS, ignore_eos=True))  # alone
    assert [e.token_id for e in out] == scale.three[1]
    assert greedy(engine, PROMPTS[:3], STEPS) == scale.three  # decoded together
    if backend == "fused":
        return
    assert_residency_true(engine)
    totals = engine.moe_counters.totals()
    assert totals["hits"] + totals["misses"] > 0 and totals["fills"] + totals["cpu"] == totals["misses"]
    if size == 1.0:  # the whole pool resident from the warm start: every lookup hits
        assert totals["misses"] == 0 and engine.executor.residency.resident_count() == scale.pool
        return
    assert totals["misses"] > 0
    assert (totals["fills"] > 0) == (backend != "cpu")  # the cpu backend keeps its warm set
    if backend == "offload" and size != "top-k":  # every miss fetched (with top-k slots, a prefill step's
        assert totals["cpu"] == 0  # experts beyond the slots go to the CPU)


def mib(n_bytes: int) -> str:
    return f"{n_bytes / 2**20!r}MiB"  # exact: a power-of-two division


@pytest.mark.parametrize("backend", ["offload", "hybrid"])
def test_slots_are_sized_from_the_routed_experts_bytes(scale: Scale, backend: str) -> None:
    """A cache ratio takes its share of the routed experts over the MoE layers; a VRAM budget leaves the
    slots what the dense weights (shared expert and dense layers included) and the KV pool leave, counted
    in whole routed experts; the slot bank, probe slot included, stays within the budget."""
    engine = configure(scale, backend, cache_ratio=0.37)
    assert engine.num_slots == round(0.37 * (LAYERS - scale.dense) * scale.experts)  # 5494 / 8525
    # what the engine holds besides the slots, by hand: every weight transformers has but the routed
    # experts (shared experts, dense MLPs, attention, router biases), and the KV pool's latent positions
    weights = sum(t.numel() for name, t in scale.model.state_dict().items() if ".mlp.experts." not in name)
    held = 4 * weights + engine.kv_pool.slots * engine.kv_pool.capacity * KV_TOKEN_BYTES
    for slots in (TOP_K, 1234, scale.pool):
        budget = held + (slots + 1) * EXPERT_BYTES + EXPERT_BYTES - 1  # one slot is the probes' own
        engine = configure(scale, backend, vram_budget=mib(budget))
        assert engine.num_slots == slots and engine.executor.residency.num_slots == slots
        bank = engine.executor.bank
        bank_bytes = sum(t.numel() * t.element_size() for t in (bank.gate_up, bank.down))
        assert held + bank_bytes <= budget < held + bank_bytes + EXPERT_BYTES
    # a budget beyond the whole pool: the ceiling is every routed expert, not one more
    engine = configure(scale, backend, vram_budget=mib(held + 2 * scale.pool * EXPERT_BYTES))
    assert engine.num_slots == scale.pool
