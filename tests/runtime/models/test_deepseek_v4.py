"""DeepSeek-V4's own pieces against plain references: hyper-connection mixing (Sinkhorn), window pooling of
the compressed keys, hash routing; the indexer's sparse choice, chunked prefill, prefix reuse and the
routed experts' clamp against transformers; both config spellings; and a missing field's error. (Every
backend against transformers: test_families_oracle.py.)"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from deepseek_v4_published import older_spelling
from freetoken.errors import FreeTokenError
from freetoken.runtime.engine import build_engine
from freetoken.runtime.models import load_model_config
from freetoken.runtime.models.compressed_kv import Compressor, CompressorColumns, PairRope
from freetoken.runtime.models.deepseek_v4_config import DeepseekV4ModelConfig, parse_config
from freetoken.runtime.models.hash_moe import Router
from freetoken.runtime.models.hyper_connections import HyperConnection
from freetoken.runtime.sampling import SamplingParams
from oracle import assert_follows_cached_decode, build_family_model, rel_err

PROMPT = [5, 77, 301, 12, 9, 250, 33, 401, 18, 2, 64, 111]


def tiny_config(**overrides: Any) -> DeepseekV4ModelConfig:
    raw = dict(
        model_type="deepseek_v4", vocab_size=64, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
        head_dim=8, q_lora_rank=6, n_routed_experts=5, num_experts_per_tok=2, moe_intermediate_size=4,
        partial_rotary_factor=0.5, sliding_window=4, hc_mult=3, hc_sinkhorn_iters=7, o_groups=1,
        o_lora_rank=4, layer_types=["sliding_attention", "heavily_compressed_attention"],
    )  # fmt: skip
    return parse_config({**raw, **overrides})


def reference(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def greedy_reference(model: Any, ids: list[int], steps: int) -> list[int]:
    ids = list(ids)
    for _ in range(steps):
        ids.append(int(reference(model, ids)[-1].argmax()))
    return ids


def test_hyper_connection_matches_a_token_by_token_reference() -> None:
    """pre = σ(s₀·w_pre·s̄ + b) + ε, post = 2σ(s₁·w_post·s̄ + b), comb = softmax rows (+ ε) then Sinkhorn
    (columns, then rows and columns iters − 1 times), written with sums over explicit indices."""
    cfg = tiny_config()
    hc = HyperConnection(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in (hc.fn, hc.base, hc.scale):
            p.copy_(torch.randn(p.shape, generator=g))
    streams = torch.randn(5, 3, 8, generator=g)
    post, comb, collapsed = hc(streams)
    n, eps = 3, cfg.hc_eps
    for t in range(5):
        flat = streams[t].reshape(-1).double()
        flat = flat / math.sqrt(float((flat**2).mean()) + cfg.rms_norm_eps)
        mix = hc.fn.double() @ flat
        s, b = hc.scale.double(), hc.base.double()
        pre = [1 / (1 + math.exp(-(s[0] * mix[i] + b[i]))) + eps for i in range(n)]
        want_post = [2 / (1 + math.exp(-(s[1] * mix[n + i] + b[n + i]))) for i in range(n)]
        logits = [[s[2] * mix[2 * n + i * n + j] + b[2 * n + i * n + j] for j in range(n)] for i in range(n)]
        m = [[math.exp(v) / sum(math.exp(u) for u in row) + eps for v in row] for row in logits]
        for it in range(cfg.hc_sinkhorn_iters):
            if it:
                m = [[v / (sum(row) + eps) for v in row] for row in m]
            cols = [sum(m[i][j] for i in range(n)) + eps for j in range(n)]
            m = [[m[i][j] / cols[j] for j in range(n)] for i in range(n)]
        close = dict(rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(post[t].double(), torch.tensor(want_post, dtype=torch.float64), **close)
        torch.testing.assert_close(comb[t].double(), torch.tensor(m, dtype=torch.float64), **close)
        want = sum(pre[i] * streams[t, i].double() for i in range(n))
        torch.testing.assert_close(collapsed[t].double(), want, **close)
    assert torch.allclose(comb.sum(dim=-2), torch.ones(5, 3), atol=1e-4)  # columns: normalised last
    assert torch.allclose(comb.sum(dim=-1), torch.ones(5, 3), atol=0.05)  # rows: after 7 iterations


@pytest.mark.parametrize("series", [1, 2])
def test_window_pooling_matches_the_formula_in_any_chunks(series: int) -> None:
    """Entry w: per channel, softmax over its slots of gate + position bias, the slots' keys weighted and
    summed, RMS-normed, rope'd at w·m; with two series the slots are window w − 1's first series then
    window w's second (window 0: its own only). Written into row (w + 1)·m − 1, whether the positions
    arrive at once or a few at a time."""
    m, d, positions = 3, 4, 14
    comp = Compressor(hidden=8, dim=d, rate=m, series=series, eps=1e-6)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        comp.position_bias.copy_(torch.randn(comp.position_bias.shape, generator=g))
        comp.kv_norm.weight.copy_(1 + 0.1 * torch.randn(d, generator=g))
    cols = CompressorColumns(start=2, dim=d, series=series)
    raw = torch.randn(positions, cols.end, generator=g)
    rope = PairRope(tiny_config().compress_rope, 2)
    rotary = [rope(torch.tensor([w * m]), torch.float32) for w in range(positions // m)]
    want = []
    for w in range(positions // m):
        keys = raw[w * m : (w + 1) * m, cols.keys]
        gates = raw[w * m : (w + 1) * m, cols.gates] + comp.position_bias
        if series == 2:
            slots_k, slots_g = [keys[:, d:]], [gates[:, d:]]
            if w:
                prev = slice((w - 1) * m, w * m)
                slots_k.insert(0, raw[prev, cols.keys][:, :d])
                slots_g.insert(0, raw[prev, cols.gates][:, :d] + comp.position_bias[:, :d])
            keys, gates = torch.cat(slots_k), torch.cat(slots_g)
        pooled = (keys * torch.softmax(gates, dim=0)).sum(dim=0)
        normed = comp.kv_norm(pooled[None])
        cos, sin = rotary[w]
        x0, x1 = normed[0, -2], normed[0, -1]  # the one rope pair: the trailing two dims
        want.append(
            torch.cat(
                (
                    normed[0, :-2],
                    torch.stack((x0 * cos[0, 0] - x1 * sin[0, 0], x1 * cos[0, 0] + x0 * sin[0, 0])),
                )
            )
        )
    for chunk in (positions, 1, 4):
        rows = raw.clone()
        rows[:, cols.entry] = 0
        with torch.no_grad():
            for start in range(0, positions, chunk):
                comp.emit(
                    rows[: min(start + chunk, positions)], cols, start, min(start + chunk, positions), rope
                )
        torch.testing.assert_close(comp.entries(rows, cols), torch.stack(want), rtol=1e-5, atol=1e-6)


def test_hash_routing_takes_the_token_table() -> None:
    """A hash-routed layer's experts are tid2eid[token]; their weights the renormalised scores (times the
    scaling), whatever the scores' ranking."""
    cfg = tiny_config(scoring_func="sqrtsoftplus", routed_scaling_factor=1.5)
    router = Router(cfg, hashed=True)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        router.tid2eid.copy_(torch.stack([torch.randperm(5, generator=g)[:2] for _ in range(64)]))
    x, tokens = torch.randn(6, 8, generator=g), torch.tensor([3, 3, 17, 60, 0, 9])
    ids, weights = router(x, tokens)
    assert torch.equal(ids, router.tid2eid[tokens])
    scores = torch.nn.functional.softplus(x @ router.weight.T).sqrt().gather(1, ids)
    torch.testing.assert_close(weights, 1.5 * scores / scores.sum(dim=-1, keepdim=True))


def test_the_indexers_sparse_choice_decodes_as_transformers(tmp_path: Path) -> None:
    """Each query of the compressed-sparse layer keeps 2 of its entries: the prompt's logits are
    transformers' (one pass), and 20 decode steps those of transformers decoding with its cache."""
    model = build_family_model(tmp_path, "deepseek_v4", index_topk=2, index_n_heads=8)
    engine = build_engine(tmp_path, device="cpu", dtype="float32", moe_backend="offload", cache_size=3)
    assert engine.config.index_topk == 2
    assert_follows_cached_decode(engine, model, PROMPT, 20, "cache")
    engine.close()


def test_chunked_prefill_and_a_reused_prefix_give_the_reference(tmp_path: Path) -> None:
    """Prompts prefilled 4 tokens a pass (windows closing across passes), and a second turn that extends
    the first one's conversation (its rows, entries included, from the prefix cache), give transformers'
    greedy tokens."""
    model = build_family_model(tmp_path, "deepseek_v4")
    engine = build_engine(tmp_path, device="cpu", dtype="float32", moe_backend="fused", max_prefill_tokens=4)
    try:
        params = SamplingParams(max_tokens=10, ignore_eos=True)
        first = [e.token_id for e in engine.generate(PROMPT, params)]
        assert first == greedy_reference(model, PROMPT, 10)[len(PROMPT) :]
        second_prompt = PROMPT + first + [42, 7, 300]
        second = [e.token_id for e in engine.generate(second_prompt, params)]
        assert engine.scheduler.prefix.stats.hit_tokens >= len(PROMPT)
        assert second == greedy_reference(model, second_prompt, 10)[len(second_prompt) :]
    finally:
        engine.close()


@pytest.mark.parametrize("backend", ["fused", "cpu"])
def test_routed_experts_clamp_at_swiglu_limit_as_transformers(tmp_path: Path, backend: str) -> None:
    """swiglu_limit 0.1 (the tiny model's gate and up values spread about 0.06; some 15% of the gates and
    30% of the ups pass it): the routed experts compute silu(min(g, L)) · clamp(u, −L, L) in the executor
    (the cpu backend in the C kernel) and give transformers' fp32 logits and greedy tokens; without the
    routed experts' clamp transformers' own logits move by about 3% and its greedy choice changes."""
    model = build_family_model(tmp_path, "deepseek_v4", swiglu_limit=0.1)
    want = reference(model, PROMPT)
    engine = build_engine(tmp_path, device="cpu", dtype="float32", moe_backend=backend)
    try:
        assert (engine.config.expert_act, engine.config.swiglu_limit) == ("clamped_silu", 0.1)
        assert engine.pool.fn.kind == "clamped_silu" and engine.pool.fn.limit == 0.1
        got = engine.forward(engine.new_sequence(), PROMPT, all_logits=True)
        assert rel_err(got, want) < 1e-4
        out = engine.generate(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))
        assert [e.token_id for e in out] == greedy_reference(model, PROMPT, 12)[len(PROMPT) :]
    finally:
        engine.close()
    for layer in model.model.layers:  # the routed experts unclamped, the shared one still clamped
        layer.mlp.experts.limit = float("inf")
    unclamped = reference(model, PROMPT)
    assert rel_err(unclamped, want) > 1e-2 and not torch.equal(unclamped.argmax(-1), want.argmax(-1))


def test_both_config_spellings_read_the_same(tmp_path: Path) -> None:
    """transformers 5's nested `rope_parameters` and the older spelling give one config and, from the same
    weights, transformers' logits."""
    model = build_family_model(tmp_path, "deepseek_v4")
    raw = json.loads((tmp_path / "config.json").read_text())
    assert set(raw["rope_parameters"]) == {"main", "compress"}
    new = load_model_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(older_spelling(raw)))
    old = load_model_config(tmp_path)
    assert old == new and old.compress_rope.type == "yarn" and old.compress_rope.factor == 4.0
    engine = build_engine(tmp_path, device="cpu", dtype="float32", moe_backend="fused")
    try:
        got = engine.forward(engine.new_sequence(), PROMPT, all_logits=True)
        assert rel_err(got, reference(model, PROMPT)) < 1e-4
    finally:
        engine.close()


@pytest.mark.parametrize(
    "field", ["hc_mult", "o_groups", "o_lora_rank", "head_dim", "index_topk", "sliding_window"]
)
def test_a_missing_field_names_the_field_and_the_file(tmp_path: Path, field: str) -> None:
    build_family_model(tmp_path / "m", "deepseek_v4")
    raw = json.loads((tmp_path / "m" / "config.json").read_text())
    raw.pop(field)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(FreeTokenError, match=rf"config\.json: {field}: missing"):
        load_model_config(tmp_path)


def test_a_row_holds_every_layer_kinds_state() -> None:
    """The cache row: key D; heavily compressed: raw keys and gates D each and an entry D; compressed
    sparse: two series (2D each) and an entry, and the indexer's (2·Di each, an entry Di)."""
    hca = tiny_config()
    assert hca.kv_dims == (1, 8 + 3 * 8, 0)
    csa = tiny_config(
        layer_types=["sliding_attention", "compressed_sparse_attention"], index_n_heads=2, index_head_dim=6,
        index_topk=3,
    )  # fmt: skip
    assert csa.kv_dims == (1, 8 + 5 * 8 + 5 * 6, 0)
