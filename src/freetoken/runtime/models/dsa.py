"""DeepSeek sparse attention (DeepSeek-V3.2, GLM-5): latent attention (mla.py) where each query attends
only to the `index_topk` cached positions a small indexer scores highest.

The indexer, per position: a key k = LayerNorm(W_k x) [D_i] with rope on its first d_rope dims (halves
rotated, not pairs), cached beside the latent (the KV pool's value slot: [1, S, D_i]); per query, heads
q_h = W_qb q_res (q_res: the attention's normed low-rank query) roped the same way, and weights
w = W_w x / √H_i. A key's score: Σ_h w_h · relu(q_h · k / √D_i); causally masked, the best `index_topk`
are kept (all of them while fewer are cached). Attention is then MLA's over those keys only.

GLM-5's variant: the indexer's rope on interleaved pairs, and layers that run no indexer of their own but
reuse the choice of the last layer before them that does (`indexer_shared_layers`; `link_shared_indexers`
wires each to it once the model is built: within a pass that layer has already chosen, row by row).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.runtime.config import ModelConfig
from freetoken.runtime.kv.cache import KVCache
from freetoken.runtime.models.kernels.cpu_linear import Linear
from freetoken.runtime.models.mla import LatentAttention, interleaved_rotary
from freetoken.runtime.models.rope import apply_rotary


class Indexer(nn.Module):
    """transformers' parameter names: wq_b, wk, k_norm (LayerNorm with bias), weights_proj."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.q_lora_rank, "the indexer reads the attention's low-rank query"
        self.heads, self.dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.interleaved = cfg.index_rope_interleave
        self.wq_b = Linear(cfg.q_lora_rank, self.heads * self.dim, bias=False)
        self.wk = Linear(cfg.hidden_size, self.dim, bias=False)
        self.k_norm = nn.LayerNorm(self.dim, eps=1e-6)
        self.weights_proj = Linear(cfg.hidden_size, self.heads, bias=False)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rope on the first d_rope dims of x [..., T, D_i] (pairs or halves), the rest as they are."""
        d = cos.shape[-1]
        rotate = interleaved_rotary if self.interleaved else apply_rotary
        return torch.cat((rotate(x[..., :d], cos, sin), x[..., d:]), dim=-1)

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> the index keys [1, T, D_i] (what the cache keeps)."""
        return self._rope(self.k_norm(self.wk(x))[None], cos, sin)

    def select(
        self, x: torch.Tensor, q_res: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor
    ) -> torch.Tensor:
        """The last T positions' queries against keys [1, S, D_i] -> kept [T, S] bool (causal, top-k)."""
        t, s = x.shape[0], keys.shape[1]
        q = self.wq_b(q_res).view(t, self.heads, self.dim).transpose(0, 1)  # [H_i, T, D_i]
        q = self._rope(q, cos, sin)
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
        self.shared, self.index_dim = layer in cfg.indexer_shared_layers, cfg.index_head_dim
        if not self.shared:
            self.indexer = Indexer(cfg)
        self.source: SparseLatentAttention | None = None  # a shared layer's: the layer that chooses for it
        self.chosen: list[torch.Tensor] = []  # this pass's choices [T, S], one per sequence, for sharers

    def _attend_rows(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVCache, start: int
    ) -> torch.Tensor:
        """x [T, H] continuing kv at `start` -> [T, NH · dv] (before o_proj)."""
        q_nope, q_pe, latent, q_res = self._project(x, cos, sin)
        assert q_res is not None
        if self.shared:
            assert self.source is not None, "link_shared_indexers wires shared layers to their source"
            no_keys = latent.new_zeros(*latent.shape[:2], self.index_dim)  # its value slot stays unused
            cache, _ = kv.write(self.layer, start, latent, no_keys)
            kept = self.source.chosen[len(self.chosen)]
        else:
            cache, keys = kv.write(self.layer, start, latent, self.indexer.keys(x, cos, sin))
            kept = self.indexer.select(x, q_res, cos, sin, keys)  # [T, S]
        self.chosen.append(kept)
        if x.shape[0] == 1:
            return self._absorbed(q_nope, q_pe, cache, kept)
        return self._expanded(q_nope, q_pe, cache, kept)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVCache, start: int
    ) -> torch.Tensor:
        self.chosen = []
        return self.o_proj(self._attend_rows(x, cos, sin, kv, start))

    def forward_batch(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kvs: list[KVCache], starts: list[int]
    ) -> torch.Tensor:
        self.chosen = []
        rows = [
            self._attend_rows(x[i : i + 1], cos[i : i + 1], sin[i : i + 1], kv, start)
            for i, (kv, start) in enumerate(zip(kvs, starts, strict=True))
        ]
        return self.o_proj(torch.cat(rows))


def link_shared_indexers(attentions: list[nn.Module]) -> None:
    """Point each shared sparse layer at the last layer before it that runs an indexer (layers in order)."""
    source = None
    for attn in attentions:
        if isinstance(attn, SparseLatentAttention):
            if attn.shared:
                if source is None:
                    raise ValueError(f"layer {attn.layer} reuses an indexer, but no layer before it has one")
                attn.source = source
            else:
                source = attn
