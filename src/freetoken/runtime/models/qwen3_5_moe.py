"""Qwen3.5/3.6 MoE text model (`Qwen3_5MoeForCausalLM`, model_type `qwen3_5_moe_text`).

Layers alternate gated DeltaNet linear attention (`linear_attention`, state in delta_net.py) with gated
full attention (`full_attention`: the query projection also yields a per-head sigmoid gate on the output;
rope on the first `partial_rotary_factor` of each head). Every layer's MLP is a routed MoE (softmax top-k,
renormalised) plus a shared expert scaled by sigmoid(shared_expert_gate(x)). Norms are zero-centred:
x̂·(1 + w). Text positions are the same on the three mrope axes, so mrope reduces to plain rope here.

A sequence's cache is a HybridCache: K/V for the full-attention layers (the KVCache layout) plus one
LinearState per DeltaNet layer. A recurrent state cannot be rewound, so the cache only truncates to its
own length or to zero; resuming from an earlier point needs a saved state (anchor checkpoints).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from freetoken.formats.tensor_names import QWEN3_MOE_EXPERTS
from freetoken.runtime.config import ModelConfig
from freetoken.runtime.json_keys import POSITIVE_INT, TEXTS, JsonObject
from freetoken.runtime.kv.cache import KVCache
from freetoken.runtime.models.base import Architecture
from freetoken.runtime.models.delta_net import GatedDeltaNet, LinearState
from freetoken.runtime.models.kernels.cpu_linear import Linear
from freetoken.runtime.models.layers import (
    Embedding,
    SwiGLUMLP,
    causal_attention,
    fuse_linear_rows,
)
from freetoken.runtime.models.qwen3_moe import (
    DecoderLayer,
    Qwen3MoeForCausalLM,
    SparseMoeBlock,
    decoder_fields,
)
from freetoken.runtime.models.rope import RotaryEmbedding, partial_rotary
from freetoken.runtime.models.slot_decode import DecodeStep

# architectures whose checkpoints fuse the DeltaNet input projections (in_proj_qkvz, in_proj_ba)
FUSED_PROJECTION_ARCHITECTURES = ("qwen3_next",)


class HybridCache(KVCache):
    """KV of the full-attention layers plus the DeltaNet layers' states (made on first use)."""

    recurrent = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.linear: dict[int, LinearState] = {}  # fixed views of the pool's state slots (bind), if any
        super().__init__(*args, **kwargs)
        self._zero_states()  # a reused slot holds its last sequence's states
        # Positions inside the next forward pass whose states to keep (set by the caller); each DeltaNet
        # layer puts its state after position p into captured[p][layer].
        self.capture_at: tuple[int, ...] = ()
        self.captured: dict[int, dict[int, LinearState]] = {}

    def can_truncate(self, length: int) -> bool:
        return length in (0, self.length)

    def bind(self) -> None:
        """K/V views, and each recurrent layer's state as views of this slot of the pool's state blocks."""
        super().bind()
        for layer, (conv, recurrent) in self.pool.states.items():
            self.linear[layer] = LinearState(conv[self.slot], recurrent[self.slot])

    def _zero_states(self) -> None:
        for state in self.linear.values():
            state.conv.zero_()
            state.recurrent.zero_()

    def restore(self, position: int, states: dict[int, LinearState]) -> None:
        """Go back to a checkpoint: the K/V prefix up to `position` and the saved states, copied in place."""
        KVCache.truncate(self, position)
        self._zero_states()
        for layer, state in states.items():
            mine = self.linear.get(layer)
            if mine is None:  # a cache without state slots (made outside an engine)
                self.linear[layer] = state.clone()
            else:
                mine.conv.copy_(state.conv)
                mine.recurrent.copy_(state.recurrent)

    def truncate(self, length: int) -> None:
        if not self.can_truncate(length):
            raise ValueError(f"a recurrent state cannot go back to position {length} of {self.length}")
        if length == 0:
            self._zero_states()  # a zero state is a fresh one
        super().truncate(length)


class ZeroCenteredRMSNorm(nn.Module):
    zero_centred = True  # the weight scales by 1 + w

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.nh, self.kvh, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = Linear(h, self.nh * self.d * 2, bias=bias)  # per head: query, then gate
        self.k_proj = Linear(h, self.kvh * self.d, bias=bias)
        self.v_proj = Linear(h, self.kvh * self.d, bias=bias)
        self.o_proj = Linear(self.nh * self.d, h, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(self.d, cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.d, cfg.rms_norm_eps)
        self.qkv_weight: torch.Tensor | None = None  # prepare_decode: q_proj, k_proj, v_proj as one matrix
        self.qkv_bias: torch.Tensor | None = None

    def _project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        t = x.shape[0]
        q, gate = self.q_proj(x).view(t, self.nh, 2 * self.d).chunk(2, dim=-1)  # [T, NH, D] each
        q = partial_rotary(self.q_norm(q).transpose(0, 1), cos, sin)  # [NH, T, D]
        k = partial_rotary(self.k_norm(self.k_proj(x).view(t, self.kvh, self.d)).transpose(0, 1), cos, sin)
        v = self.v_proj(x).view(t, self.kvh, self.d).transpose(0, 1)  # [KVH, T, D]
        return q, k, v, gate.reshape(t, self.nh * self.d)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVCache, start: int
    ) -> torch.Tensor:
        q, k, v, gate = self._project(x, cos, sin)
        k_all, v_all = kv.write(self.layer, start, k, v)
        return self.o_proj(causal_attention(q, k_all, v_all, self.d**-0.5) * torch.sigmoid(gate))

    def prepare_decode(self) -> None:
        """q (with its gate), k, v as one matrix (once): the decode's one GEMV."""
        if self.qkv_weight is None:
            self.qkv_weight, self.qkv_bias = fuse_linear_rows((self.q_proj, self.k_proj, self.v_proj))

    def decode(self, h: torch.Tensor, step: DecodeStep) -> torch.Tensor:
        """h [B, H] normed -> the block's output [B, H]; each real row's K/V written at its position."""
        ops, rows = step.ops, step.rows
        b, nq, d = h.shape[0], 2 * self.nh * self.d, self.d
        k_cache, v_cache = step.kv(self.layer)
        qkv = ops.linear(h, self.qkv_weight, self.qkv_bias)  # [B, 2 NH D + 2 KVH D]: one GEMV
        heads = qkv[:, :nq].view(b, self.nh, 2 * d)  # per head: query, then gate
        k, v = qkv[:, nq : nq + self.kvh * d], qkv[:, nq + self.kvh * d :]
        q = ops.qk_norm_rope_kv_write(
            heads[..., :d], k, v, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
            step.cos, step.sin, k_cache, v_cache, rows.slots, rows.positions, zero_centred=True,
        )  # fmt: skip  # [B, NH, D]
        out = ops.attention(q, k_cache, v_cache, rows.slots, rows.lengths, d**-0.5, None, None)
        return self.o_proj(out * torch.sigmoid(heads[..., d:]).reshape(b, self.nh * d))


class SharedExpertMoeBlock(SparseMoeBlock):
    """Routed experts (through the executor) plus a dense shared expert with a sigmoid gate."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        self.shared_expert = SwiGLUMLP(cfg.hidden_size, int(cfg.raw["shared_expert_intermediate_size"]))
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        routed = super().forward(x, rows)
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class HybridDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, kind: str) -> None:
        super().__init__()
        self.layer, self.kind = layer, kind
        raw = cfg.raw
        if kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(
                cfg.hidden_size,
                int(raw["linear_num_key_heads"]),
                int(raw["linear_num_value_heads"]),
                int(raw["linear_key_head_dim"]),
                int(raw["linear_value_head_dim"]),
                int(raw["linear_conv_kernel_dim"]),
                cfg.rms_norm_eps,
                fused_projections=cfg.architecture in FUSED_PROJECTION_ARCHITECTURES,
            )
            self.linear_attn.layer = layer  # its state's key in the pool
        else:
            self.self_attn = GatedAttention(cfg, layer)
        self.mlp: nn.Module = (
            SharedExpertMoeBlock(cfg, layer)
            if cfg.is_moe_layer(layer)
            else SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size)
        )
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def recurrent(self) -> nn.Module:
        """The layer's recurrent attention (its state in the cache's `linear`)."""
        return self.linear_attn

    @property
    def mixer(self) -> nn.Module:
        """The module that mixes positions: the recurrent attention or the full one."""
        return self.recurrent if self.kind == "linear_attention" else self.self_attn

    decode = DecoderLayer.decode  # the same pre-norm block over whichever mixer the layer has

    def _state(self, kv: HybridCache, x: torch.Tensor) -> LinearState:
        state = kv.linear.get(self.layer)
        if state is None:
            state = kv.linear[self.layer] = self.recurrent.new_state(x.device, x.dtype)
        return state

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: HybridCache, start: int
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.kind == "linear_attention":
            inside = tuple(p for p in kv.capture_at if start < p < start + x.shape[0])
            h, states = self.recurrent(h, self._state(kv, h), tuple(p - start for p in inside))
            for p, state in zip(inside, states, strict=True):
                kv.captured.setdefault(p, {})[self.layer] = state
        else:
            h = self.self_attn(h, cos, sin, kv, start)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_class: type[nn.Module], norm_class: type[nn.Module]) -> None:
        super().__init__()
        kinds = cfg.raw["layer_types"]
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer_class(cfg, i, kinds[i]) for i in range(cfg.num_layers))
        self.norm = norm_class(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3_5MoeForCausalLM(Qwen3MoeForCausalLM):
    """The Qwen3-MoE loops (forward, decode) and executor wiring over hybrid layers and caches."""

    cache_class = HybridCache
    layer_class: type[nn.Module] = HybridDecoderLayer
    norm_class: type[nn.Module] = ZeroCenteredRMSNorm

    def __init__(self, cfg: ModelConfig) -> None:
        nn.Module.__init__(self)
        self.config = cfg
        self.model = Backbone(cfg, self.layer_class, self.norm_class)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.rotary_dim)  # MLA without rope (Kimi): angles unused
        # the layers whose K/V the cache keeps (the DeltaNet layers keep a recurrent state instead)
        self.attention_layers = tuple(
            i for i, kind in enumerate(cfg.raw["layer_types"][: cfg.num_layers]) if kind == "full_attention"
        )

    def state_shapes(self, dtype: torch.dtype) -> dict[int, tuple[tuple[tuple[int, ...], torch.dtype], ...]]:
        """Per DeltaNet layer, its state tensors' (shape, dtype): the engine keeps them in fixed slots."""
        return {
            i: layer.recurrent.state_shapes(dtype)
            for i, layer in enumerate(self.model.layers)
            if layer.kind == "linear_attention"
        }


LAYER_KINDS = ("linear_attention", "full_attention")
LINEAR_KEYS = (
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "shared_expert_intermediate_size",
)


def parse_config(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    cfg = JsonObject(raw, source)
    layers = cfg.get("num_hidden_layers", POSITIVE_INT)
    kinds = cfg.get("layer_types", TEXTS, None)
    if kinds is None:
        interval = cfg.get("full_attention_interval", POSITIVE_INT, 4)
        kinds = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    if len(kinds) != layers or set(kinds) - set(LAYER_KINDS):
        raise cfg.error("layer_types", f"expected {layers} of linear_attention / full_attention")
    for key in LINEAR_KEYS:
        cfg.get(key, POSITIVE_INT)
    if cfg.raw["linear_num_value_heads"] % cfg.raw["linear_num_key_heads"]:
        raise cfg.error("linear_num_value_heads", "expected a multiple of linear_num_key_heads")
    return ModelConfig(
        architecture="qwen3_5_moe_text",
        intermediate_size=0,
        norm_topk_prob=True,
        raw={**raw, "layer_types": list(kinds)},
        **decoder_fields(raw, source),
    )


ARCHITECTURE = Architecture(
    name="qwen3_5_moe_text",
    hf_classes=("Qwen3_5MoeForCausalLM",),
    parse_config=parse_config,
    build_model=Qwen3_5MoeForCausalLM,
    expert_naming=QWEN3_MOE_EXPERTS,
)
