"""DeepSeek-V4 (`DeepseekV4ForCausalLM`): per layer one attention kind (`layer_types`: a sliding window
only, or with compressed entries of the past, heavily compressed or sparse through an indexer:
compressed_attention.py, compressed_kv.py), an MoE routed by score or by a token-id table (hash_moe.py),
and a residual of `hc_mult` streams mixed by hyper-connections (hyper_connections.py). Config parsing:
deepseek_v4_config.py.

A layer's cache is one row per position in the engine's KV pool (the key, the compressors' raw
projections, each closed window's entry in its last row), so prefixes and truncation work as for plain
K/V; a decode step runs over the static pool (compressed_decode.py). Multi-token-prediction layers after
the trunk are skipped.
"""

from __future__ import annotations

import torch
from torch import nn

from freetoken.runtime.kv.cache import KVCache
from freetoken.runtime.kv.slot_pool import KVSlotPool
from freetoken.runtime.models.base import Architecture
from freetoken.runtime.models.compressed_attention import CompressedAttention
from freetoken.runtime.models.compressed_kv import PairRope
from freetoken.runtime.models.deepseek_v4_config import SLIDING, DeepseekV4ModelConfig, parse_config
from freetoken.runtime.models.deepseek_v4_names import DEEPSEEK_V4_EXPERTS
from freetoken.runtime.models.hash_moe import HashMoeBlock
from freetoken.runtime.models.hyper_connections import HyperConnection, HyperHead, spread
from freetoken.runtime.models.kernels.cpu_linear import Linear
from freetoken.runtime.models.layers import Embedding, RMSNorm
from freetoken.runtime.models.slot_decode import DecodeOps, DecodeRows, DecodeStep
from freetoken.runtime.moe.executor import ExpertExecutor


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DeepseekV4ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = CompressedAttention(cfg, layer)
        self.mlp = HashMoeBlock(cfg, layer)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn_hc = HyperConnection(cfg)
        self.ffn_hc = HyperConnection(cfg)

    def _mlp(self, streams: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        post, comb, h = self.ffn_hc(streams)
        return spread(streams, self.mlp(self.post_attention_layernorm(h), token_ids), post, comb)

    def forward(
        self, streams: torch.Tensor, token_ids: torch.Tensor, rope: PairRope, kv: KVCache, start: int
    ) -> torch.Tensor:
        """streams [T, N, H] of tokens token_ids [T] continuing kv at `start` -> [T, N, H]."""
        post, comb, h = self.attn_hc(streams)
        streams = spread(streams, self.self_attn(self.input_layernorm(h), rope, kv, start), post, comb)
        return self._mlp(streams, token_ids)

    def decode(self, streams: torch.Tensor, step: DecodeStep, rope: PairRope) -> torch.Tensor:
        """streams [B, N, H]: one new token per row of the static pool -> [B, N, H]."""
        post, comb, h = self.attn_hc(streams)
        streams = spread(streams, self.self_attn.decode(self.input_layernorm(h), step, rope), post, comb)
        post, comb, h = self.ffn_hc(streams)
        return spread(streams, self.mlp.decode(self.post_attention_layernorm(h), step), post, comb)


class Backbone(nn.Module):
    def __init__(self, cfg: DeepseekV4ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_head = HyperHead(cfg)


class DeepseekV4ForCausalLM(nn.Module):
    cache_class: type[KVCache] = KVCache  # one row per position per layer (compressed_kv.py)

    def __init__(self, cfg: DeepseekV4ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.attention_layers = tuple(range(cfg.num_layers))
        self.model = Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # sliding layers rotate with the main rope, compressed ones (and their compressors) with theirs
        main, compress = (
            PairRope(cfg.rope, cfg.qk_rope_head_dim),
            PairRope(cfg.compress_rope, cfg.qk_rope_head_dim),
        )
        self.ropes = [main if kind == SLIDING else compress for kind in cfg.layer_kinds]

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def state_shapes(self, dtype: torch.dtype) -> dict[int, tuple[tuple[tuple[int, ...], torch.dtype], ...]]:
        """No recurrent state: the compressors' state is in the KV rows."""
        return {}

    def prepare_decode(self) -> None:
        """Nothing to fuse: the decode reads the checkpoint's projections."""

    def decode(self, rows: DecodeRows, pool: KVSlotPool, ops: DecodeOps) -> torch.Tensor:
        """One new token per row over the static KV pool -> logits [B, V]. The caller advances each
        sequence's length."""
        streams = self._streams(rows.tokens)  # [B, N, H]
        cos, sin = self.ropes[0](rows.positions, streams.dtype)
        step = DecodeStep(rows, pool, ops, cos, sin, real=rows.slots >= 0)
        for layer, rope in zip(self.model.layers, self.ropes, strict=True):
            streams = layer.decode(streams, step, rope)
        return self._logits(streams)

    def moe_blocks(self) -> list[HashMoeBlock]:
        return [layer.mlp for layer in self.model.layers]

    def attach_executor(self, executor: ExpertExecutor | None) -> None:
        for block in self.moe_blocks():
            block.executor = executor

    def _logits(self, streams: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(self.model.hc_head(streams)))

    def _streams(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> the embeddings copied into every stream [T, N, H]."""
        x = self.model.embed_tokens(input_ids)
        return x[:, None, :].expand(-1, self.config.hc_mult, -1).contiguous()

    def forward(self, input_ids: torch.Tensor, kv: KVCache, all_logits: bool = False) -> torch.Tensor:
        """input_ids [T] continue the sequence cached in kv -> logits [T, V] (all) or [1, V] (last).

        Writes positions [kv.length, kv.length + T) into the cache; the caller advances it."""
        start = kv.length
        kv.reserve(start + input_ids.shape[0])
        streams = self._streams(input_ids)
        for layer, rope in zip(self.model.layers, self.ropes, strict=True):
            streams = layer(streams, input_ids, rope, kv, start)
        return self._logits(streams if all_logits else streams[-1:])


ARCHITECTURE = Architecture(
    name="deepseek_v4",
    hf_classes=("DeepseekV4ForCausalLM",),
    parse_config=parse_config,
    build_model=DeepseekV4ForCausalLM,  # type: ignore[arg-type]
    expert_naming=DEEPSEEK_V4_EXPERTS,
)
