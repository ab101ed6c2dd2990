"""DeepSeek sparse attention (DeepSeek-V3.2, GLM-5): latent attention (mla.py) where each query attends
only to the `index_topk` cached positions a small indexer scores highest.

The indexer, per position: a key k = LayerNorm(W_k x) [D_i] with rope on its first d_rope dims (halves
rotated, not pairs), cached beside the latent (the KV pool's value slot: [1, S, D_i]); per query, heads
q_h = W_qb q_res (q_res: the attention's normed low-rank query) roped the same way, and weights
w = W_w x / √H_i. A key's score: Σ_h w_h · relu(q_h · k / √D_i); causally masked, the best `index_topk`
are kept (all of them while fewer are cached). Attention is then MLA's over those keys only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.runtime.config import ModelConfig
from freetoken.runtime.kv.cache import KVCache
from freetoken.runtime.models.kernels.cpu_linear import Linear
from freetoken.runtime.models.mla import LatentAttention
from freetoken.runtime.models.rope import partial_rotary


class Indexer(nn.Module):
    """transformers' parameter names: wq_b, wk, k_norm (LayerNorm with bias), weights_proj."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.q_lora_rank, "the indexer reads the attention's low-rank query"
        self.heads, self.dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = Linear(cfg.q_lora_rank, self.heads * self.dim, bias=False)
        self.wk = Linear(cfg.hidden_size, self.dim, bias=False)
        self.k_norm = nn.LayerNorm(self.dim, eps=1e-6)
        self.weights_proj = Linear(cfg.hidden_size, self.heads, bias=False)

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> the index keys [1, T, D_i] (what the cache keeps)."""
        return partial_rotary(self.k_norm(self.wk(x))[None], cos, sin)

    def select(
        self, x: torch.Tensor, q_res: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor
    ) -> torch.Tensor:
        """The last T positions' queries against keys [1, S, D_i] -> kept [T, S] bool (causal, top-k)."""
        t, s = x.shape[0], keys.shape[1]
        q = self.wq_b(q_res).view(t, self.heads, self.dim).transpose(0, 1)  # [H_i, T, D_i]
        q = partial_rotary(q, cos, sin)
        scores = F.relu(torch.matmul(q.float(), keys[0].T.float()) * self.dim**-0.5)  # [H_i, T, S]
        weights = self.weights_proj(x).float() * self.heads**-0.5  # [T, H_i]
        index = torch.einsum("th,hts->ts", weights, scores)
        causal = torch.arange(s, device=x.device)[None, :] <= torch.arange(s - t, s, device=x.device)[:, None]
        index = index.masked_fill(~causal, float("-inf"))
        top = index.topk(min(self.topk, s), dim=-1).indices  # [T, k]
        kept = torch.zeros(t, s, dtype=torch.bool, device=x.device).scatter_(1, top, True)
        return kept & causal


class SparseLatentAttention(LatentAttention):
    """MLA whose queries see only the positions the indexer keeps."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        self.indexer = Indexer(cfg)

    def _attend_rows(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVCache, start: int
    ) -> torch.Tensor:
        """x [T, H] continuing kv at `start` -> [T, NH · dv] (before o_proj)."""
        q_nope, q_pe, latent, q_res = self._project(x, cos, sin)
        assert q_res is not None
        cache, keys = kv.write(self.layer, start, latent, self.indexer.keys(x, cos, sin))
        kept = self.indexer.select(x, q_res, cos, sin, keys)  # [T, S]
        if x.shape[0] == 1:
            return self._absorbed(q_nope, q_pe, cache, kept)
        return self._expanded(q_nope, q_pe, cache, kept)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVCache, start: int
    ) -> torch.Tensor:
        return self.o_proj(self._attend_rows(x, cos, sin, kv, start))

    def forward_batch(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kvs: list[KVCache], starts: list[int]
    ) -> torch.Tensor:
        rows = [
            self._attend_rows(x[i : i + 1], cos[i : i + 1], sin[i : i + 1], kv, start)
            for i, (kv, start) in enumerate(zip(kvs, starts, strict=True))
        ]
        return self.o_proj(torch.cat(rows))
