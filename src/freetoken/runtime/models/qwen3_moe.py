"""Qwen3-MoE (`Qwen3MoeForCausalLM`): its modules and its two loops — `forward` over one sequence's
tokens (prefill; hidden states [T, H]) and `decode` over one new token per row of the static KV pool
(models/slot_decode.py; hidden states [B, H]), each module's `decode` written once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.errors import FreeTokenError
from freetoken.formats.tensor_names import QWEN3_MOE_EXPERTS
from freetoken.runtime.config import ModelConfig, rope_from_hf
from freetoken.runtime.json_keys import (
    BOOL,
    COUNT,
    INDICES,
    POSITIVE,
    POSITIVE_INT,
    TEXT,
    TOKEN_IDS,
    JsonObject,
)
from freetoken.runtime.kv.cache import KVCache
from freetoken.runtime.kv.slot_pool import KVSlotPool
from freetoken.runtime.models.base import Architecture
from freetoken.runtime.models.dsa import SparseLatentAttention, link_shared_indexers
from freetoken.runtime.models.kernels.cpu_linear import Linear
from freetoken.runtime.models.layers import (
    Embedding,
    RMSNorm,
    SwiGLUMLP,
    causal_attention,
    fuse_linear_rows,
    sink_window_attention,
)
from freetoken.runtime.models.mla import LatentAttention
from freetoken.runtime.models.rope import RotaryEmbedding, partial_rotary
from freetoken.runtime.models.slot_decode import DecodeOps, DecodeRows, DecodeStep
from freetoken.runtime.moe.executor import ExpertExecutor
from freetoken.runtime.moe.kernels.router_topk import (
    RouterRule,
    choose_experts,
    choose_experts_reference,
    use_router_kernel,
)


class Attention(nn.Module):
    """Grouped-query attention with rope; q and k RMS-normed per head (Qwen3), over the whole projection
    (OLMoE) or not at all (Mixtral), as `cfg.qk_norm` says; projections optionally clamped (clip_qkv);
    with learned sink logits and, on the sliding layers, a window (gpt-oss) where the config says."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h, d, bias = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.q_proj = Linear(h, cfg.num_heads * d, bias=bias)
        self.k_proj = Linear(h, cfg.num_kv_heads * d, bias=bias)
        self.v_proj = Linear(h, cfg.num_kv_heads * d, bias=bias)
        self.o_proj = Linear(cfg.num_heads * d, h, bias=bias if cfg.o_proj_bias is None else cfg.o_proj_bias)
        self.qk_norm, self.clip = cfg.qk_norm, cfg.clip_qkv
        if cfg.qk_norm == "head":  # before rope
            self.q_norm, self.k_norm = RMSNorm(d, cfg.rms_norm_eps), RMSNorm(d, cfg.rms_norm_eps)
        elif cfg.qk_norm == "full":
            self.q_norm = RMSNorm(cfg.num_heads * d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.num_kv_heads * d, cfg.rms_norm_eps)
        self.sinks = (
            nn.Parameter(torch.zeros(cfg.num_heads), requires_grad=False) if cfg.attention_sinks else None
        )
        self.window = cfg.sliding_window if layer in cfg.sliding_layers else None
        self.plain = not cfg.attention_sinks and self.window is None
        self.qkv_weight: torch.Tensor | None = None  # prepare_decode: q_proj, k_proj, v_proj as one matrix
        self.qkv_bias: torch.Tensor | None = None

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [NH, T, D] at the last T positions of k, v [KVH, S, D] -> [T, NH * D]."""
        if self.plain:
            return causal_attention(q, k, v, self.head_dim**-0.5)
        return sink_window_attention(q, k, v, self.head_dim**-0.5, self.sinks, self.window)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> q [NH, T, D], k and v [KVH, T, D], before rope."""
        t = x.shape[0]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.clip is not None:
            q, k, v = (p.clamp(-self.clip, self.clip) for p in (q, k, v))
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.view(t, self.num_heads, self.head_dim), k.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        return (
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.view(t, self.num_kv_heads, self.head_dim).transpose(0, 1),
        )

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVCache, start: int
    ) -> torch.Tensor:
        q, k, v = self._qkv(x)
        q, k = partial_rotary(q, cos, sin), partial_rotary(k, cos, sin)  # on the rotary dims only
        k_all, v_all = kv.write(self.layer, start, k, v)  # [KVH, start + T, D]
        return self.o_proj(self._attend(q, k_all, v_all))

    def decode(self, h: torch.Tensor, step: DecodeStep) -> torch.Tensor:
        """h [B, H] normed -> the block's output [B, H]; each real row's K/V written at its position."""
        ops, rows = step.ops, step.rows
        k_cache, v_cache = step.kv(self.layer)  # [S, KVH, CAP, D]
        qkv = ops.linear(h, self.qkv_weight, self.qkv_bias)  # [B, (NH + 2 KVH) D]: one GEMV
        if self.clip is not None:
            qkv = qkv.clamp(-self.clip, self.clip)
        if ops.attention_block is not None:
            cos, sin = step.cos, step.sin
            out = ops.attention_block(qkv, self, cos, sin, k_cache, v_cache, rows.slots, rows.positions)
            if out is not None:
                return ops.linear(out, self.o_proj.weight, self.o_proj.bias)
        nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv[:, :nq], qkv[:, nq : nq + nkv], qkv[:, nq + nkv :]
        if self.qk_norm == "full":  # over the whole projection, before the heads are split
            q, k = step.norm(q, self.q_norm), step.norm(k, self.k_norm)
        head = self.qk_norm == "head"
        q = ops.qk_norm_rope_kv_write(
            q, k, v,
            self.q_norm.weight if head else None, self.k_norm.weight if head else None,
            self.q_norm.eps if head else 0.0,
            step.cos, step.sin, k_cache, v_cache, rows.slots, rows.positions,
        )  # fmt: skip  # [B, NH, D]
        scale = self.head_dim**-0.5
        out = ops.attention(q, k_cache, v_cache, rows.slots, rows.lengths, scale, self.sinks, self.window)
        return ops.linear(out, self.o_proj.weight, self.o_proj.bias)

    def prepare_decode(self) -> None:
        """q, k, v weights (and biases) as row blocks of one `qkv` matrix (once): the decode's one GEMV."""
        if self.qkv_weight is None:
            self.qkv_weight, self.qkv_bias = fuse_linear_rows((self.q_proj, self.k_proj, self.v_proj))


class SparseMoeBlock(nn.Module):
    """The router (softmax top-k, optionally renormalised; or sigmoid scores with a correction bias and
    group-limited choice), the routed experts in the executor, and the shared experts where there are."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=cfg.router_bias)
        sigmoid = cfg.router_scoring == "sigmoid"  # softmax routers are unscaled, as transformers' are
        renormalize = self.norm_topk_prob and cfg.router_scoring != "topk_softmax"  # gpt-oss: sums to 1
        self.rule = RouterRule(  # the one statement of this block's routing (the native CPU step reads it)
            self.top_k, cfg.router_scoring, renormalize, biased=sigmoid, n_group=cfg.n_group,
            topk_group=cfg.topk_group if cfg.n_group > 1 else 1,
            scaling=cfg.routed_scaling_factor if sigmoid else 1.0,
        )  # fmt: skip
        if cfg.router_scoring == "sigmoid":  # the choice's correction bias, a checkpoint tensor
            self.gate.e_score_correction_bias = nn.Parameter(
                torch.zeros(cfg.num_experts), requires_grad=False
            )
        self.shared_experts = (
            SwiGLUMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
            if cfg.n_shared_experts
            else None
        )
        self.executor: ExpertExecutor | None = None
        self.recorder: Any = None  # a RoutingRecorder while --record-routing is on

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> topk_ids [T, K] int64, topk_weights [T, K] in x's dtype, by `rule`: one launch after
        the gate on a decode step on CUDA (choose_experts), the same rule in torch elsewhere."""
        if self.rule.scoring == "sigmoid":  # scored in fp32 from the gate's fp32 product
            logits = F.linear(x.float(), self.gate.weight.float())
            bias = self.gate.e_score_correction_bias
        else:
            logits, bias = self.gate(x), None
        choose = choose_experts if use_router_kernel(x) else choose_experts_reference
        return choose(logits, self.rule, bias, x.dtype)

    def forward(self, x: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]. `rows` [T] bool: the rows that are real (a padded decode step's padding
        rows demand no expert, so they cost no fill)."""
        assert self.executor is not None, "attach an expert executor before the forward pass"
        ids, weights = self.route(x)
        if rows is not None:
            ids = torch.where(rows[:, None], ids, -1)  # one kernel: the scalar needs no tensor of its own
        if self.recorder is not None:
            self.recorder.add(self.layer, ids)
        out = self.executor.forward(self.layer, x, ids, weights)
        return out if self.shared_experts is None else out + self.shared_experts(x)

    def decode(self, x: torch.Tensor, step: DecodeStep) -> torch.Tensor:
        return self(x, step.real)


def attention_module(cfg: ModelConfig, layer: int) -> nn.Module:
    """Grouped-query attention, latent attention (MLA), or MLA with DeepSeek's sparse indexer."""
    if cfg.index_topk:
        return SparseLatentAttention(cfg, layer)
    return LatentAttention(cfg, layer) if cfg.kv_lora_rank else Attention(cfg, layer)


def mlp_module(cfg: ModelConfig, layer: int) -> nn.Module:
    """The routed experts (with any shared ones), or a dense SwiGLU on the layers the config keeps dense."""
    if cfg.is_moe_layer(layer):
        return SparseMoeBlock(cfg, layer)
    return SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn: nn.Module = attention_module(cfg, layer)
        self.mlp = mlp_module(cfg, layer)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def mixer(self) -> nn.Module:
        """The module that mixes positions (here attention); its decode reads the pool."""
        return self.self_attn

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVCache, start: int
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, start)
        return x + self.mlp(self.post_attention_layernorm(x))

    def decode(
        self, x: torch.Tensor, residual: torch.Tensor | None, step: DecodeStep
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is carried beside the branch outputs: each norm adds the branch output to
        it first (x + attn, then + mlp), exactly the sums `forward` computes. -> (mlp out, residual)."""
        h, residual = step.add_norm(x, residual, self.input_layernorm)
        h, residual = step.add_norm(self.mixer.decode(h, step), residual, self.post_attention_layernorm)
        return self.mlp.decode(h, step), residual


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3MoeForCausalLM(nn.Module):
    """Also Mixtral's and OLMoE's model: their layers differ only in the attention's q/k norms (cfg).

    What the engine asks of a model, declared here for every family: `cache_class` (a sequence's cache),
    `attention_layers` (the layers whose K/V the pool keeps), `state_shapes` (recurrent states the pool
    keeps per slot), `prepare_decode` and `decode` (the static step)."""

    cache_class: type[KVCache] = KVCache  # a hybrid model's adds its recurrent states

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.attention_layers = tuple(range(cfg.num_layers))
        self.model = Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.rotary_dim)
        if cfg.indexer_shared_layers:
            link_shared_indexers([layer.self_attn for layer in self.model.layers])

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def state_shapes(self, dtype: torch.dtype) -> dict[int, tuple[tuple[tuple[int, ...], torch.dtype], ...]]:
        """Per recurrent layer, its state tensors' (shape, dtype): none here."""
        return {}

    def prepare_decode(self) -> None:
        """Once, after the weights are loaded: each mixer fuses what its decode reads as one GEMV."""
        for layer in self.model.layers:
            layer.mixer.prepare_decode()

    def decode(self, rows: DecodeRows, pool: KVSlotPool, ops: DecodeOps) -> torch.Tensor:
        """One new token per row over the static KV pool -> logits [B, V]. The caller advances each
        sequence's length."""
        x = self.model.embed_tokens(rows.tokens)  # [B, H]
        cos, sin = self.rotary(rows.positions, x.dtype)  # [B, R]
        step = DecodeStep(rows, pool, ops, cos, sin, real=rows.slots >= 0)
        residual: torch.Tensor | None = None
        for layer in self.model.layers:
            x, residual = layer.decode(x, residual, step)
        h, _ = step.add_norm(x, residual, self.model.norm)
        return ops.linear(h, self.lm_head.weight)

    def moe_blocks(self) -> list[SparseMoeBlock]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoeBlock)]

    def attach_executor(self, executor: ExpertExecutor | None) -> None:
        for block in self.moe_blocks():
            block.executor = executor

    def forward(self, input_ids: torch.Tensor, kv: KVCache, all_logits: bool = False) -> torch.Tensor:
        """input_ids [T] continue the sequence cached in kv -> logits [T, V] (all) or [1, V] (last).

        Writes positions [kv.length, kv.length + T) into the cache; the caller advances it.
        """
        start, t = kv.length, input_ids.shape[0]
        kv.reserve(start + t)
        x = self.model.embed_tokens(input_ids)  # [T, H]
        positions = torch.arange(start, start + t, device=input_ids.device)
        cos, sin = self.rotary(positions, x.dtype)  # [T, D]
        for layer in self.model.layers:
            x = layer(x, cos, sin, kv, start)
        if not all_logits:
            x = x[-1:]
        return self.lm_head(self.model.norm(x))


def decoder_fields(
    raw: dict[str, Any], source: str, expert_size: str = "moe_intermediate_size"
) -> dict[str, Any]:
    """The ModelConfig fields every MoE decoder here reads the same way (attention, rope, experts);
    `expert_size`: the key of an expert's intermediate size (Mixtral and OLMoE call it intermediate_size)."""
    cfg = JsonObject(raw, source)
    hidden = cfg.get("hidden_size", POSITIVE_INT)
    heads = cfg.get("num_attention_heads", POSITIVE_INT)
    cfg.choice("hidden_act", ("silu", "swish"), "silu")
    kv_heads = cfg.get("num_key_value_heads", POSITIVE_INT, heads)
    if heads % kv_heads:
        raise cfg.error("num_key_value_heads", f"num_attention_heads {heads} is not a multiple of {kv_heads}")
    head_dim = cfg.get("head_dim", POSITIVE_INT, hidden // heads)
    if head_dim < 1:
        raise cfg.error("head_dim", f"missing, and hidden_size {hidden} < num_attention_heads {heads}")
    fields = dict(
        vocab_size=cfg.get("vocab_size", POSITIVE_INT),
        hidden_size=hidden,
        num_layers=cfg.get("num_hidden_layers", POSITIVE_INT),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.get("rms_norm_eps", POSITIVE, 1e-6),
        rope=rope_from_hf(raw, source),
        max_position_embeddings=cfg.get("max_position_embeddings", POSITIVE_INT, 32768),
        num_experts=cfg.first(("num_experts", "num_local_experts", "n_routed_experts"), POSITIVE_INT),
        num_experts_per_tok=cfg.get("num_experts_per_tok", POSITIVE_INT),
        moe_intermediate_size=cfg.get(expert_size, POSITIVE_INT),
        tie_word_embeddings=cfg.get("tie_word_embeddings", BOOL, False),
        attention_bias=cfg.get("attention_bias", BOOL, False),
        hidden_act="silu",
        eos_token_ids=cfg.get("eos_token_id", TOKEN_IDS, ()),
        torch_dtype=cfg.first(("dtype", "torch_dtype"), TEXT, "float32"),
    )
    if fields["num_experts_per_tok"] > fields["num_experts"]:
        raise cfg.error(
            "num_experts_per_tok",
            f"expected at most num_experts={fields['num_experts']}, got {fields['num_experts_per_tok']}",
        )
    return fields


def layout_fields(raw: dict[str, Any], source: str, norm_topk_prob: bool) -> dict[str, Any]:
    """Which layers are dense, and how top-k weights are normalised (Qwen3-MoE and Qwen3-Next)."""
    cfg = JsonObject(raw, source)
    return dict(
        intermediate_size=cfg.get("intermediate_size", COUNT, 0),
        norm_topk_prob=cfg.get("norm_topk_prob", BOOL, norm_topk_prob),
        decoder_sparse_step=cfg.get("decoder_sparse_step", POSITIVE_INT, 1),
        mlp_only_layers=cfg.get("mlp_only_layers", INDICES, ()),
    )


def parse_config(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    cfg = ModelConfig(
        architecture="qwen3_moe",
        raw=raw,
        **layout_fields(raw, source, norm_topk_prob=False),
        **decoder_fields(raw, source),
    )
    return check_dense_layers(cfg, source)


def check_dense_layers(cfg: ModelConfig, source: str) -> ModelConfig:
    """Dense (non-MoE) layers need `intermediate_size`."""
    dense_layers = [i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)]
    if dense_layers and cfg.intermediate_size <= 0:
        raise FreeTokenError(f"{source}: layers {dense_layers} are dense but 'intermediate_size' is missing")
    return cfg


ARCHITECTURE = Architecture(
    name="qwen3_moe",
    hf_classes=("Qwen3MoeForCausalLM",),
    parse_config=parse_config,
    build_model=Qwen3MoeForCausalLM,
    expert_naming=QWEN3_MOE_EXPERTS,
)
