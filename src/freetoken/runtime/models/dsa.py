"""DeepSeek sparse attention (DeepSeek-V3.2, GLM-5): latent attention (mla.py) where each query attends
only to the `index_topk` cached positions a small indexer scores highest.

The indexer, per position: a key k = LayerNorm(W_k x) [D_i] with rope on its first d_rope dims (halves
rotated, not pairs), cached beside the latent (the KV pool's value slot: [1, S, D_i]); per query, heads
q_h = W_qb q_res (q_res: the attention's normed low-rank query) roped the same way, and weights
w = W_w x / √H_i. A key's score: Σ_h w_h · relu(q_h · k / √D_i); causally masked, the best `index_topk`
are kept (all of them while fewer are cached). Attention is then MLA's over those keys only.

Decode (`SparseLatentAttention.decode`, graph-capturable): each row's indexer scores every position of its
slot (those past its length masked), and attention reads the latents of the kept positions only.

GLM-5's variant: the indexer's rope on interleaved pairs, and layers that run no indexer of their own but
reuse the choice of the last layer before them that does (`indexer_shared_layers`; `link_shared_indexers`
wires each to it once the model is built: within a pass that layer has already chosen).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.runtime.config import ModelConfig
from freetoken.runtime.kv.cache import KVCache
from freetoken.runtime.models.kernels.cpu_linear import Linear
from freetoken.runtime.models.layers import top_positions
from freetoken.runtime.models.mla import LatentAttention, interleaved_rotary
from freetoken.runtime.models.rope import apply_rotary
from freetoken.runtime.models.slot_decode import DecodeRows, DecodeStep, slot_rows


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
        top = top_positions(index.masked_fill(~causal, float("-inf")), min(self.topk, s))  # [T, k]
        kept = torch.zeros(t, s, dtype=torch.bool, device=x.device).scatter_(1, top, True)
        return kept & causal

    def decode_select(
        self,
        x: torch.Tensor,
        q_res: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        keys: torch.Tensor,
        rows: DecodeRows,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`select` for one new query per row against its slot of the cached index keys [S, 1, CAP, D_i]
        (the row's own key written) -> (top [B, k] positions, valid [B, k]: those below the row's length),
        k = min(index_topk, CAP). Every slot position is scored; those at or past the length are masked."""
        b, cap = x.shape[0], keys.shape[2]
        q = self._rope(
            self.wq_b(q_res).view(b, self.heads, self.dim).transpose(0, 1), cos, sin
        )  # [H_i, B, D_i]
        mine = keys[rows.slots.clamp(min=0).long(), 0]  # [B, CAP, D_i]
        scores = F.relu(
            torch.einsum("hbd,bsd->hbs", q.float(), mine.float()) * self.dim**-0.5
        )  # [H_i, B, CAP]
        weights = self.weights_proj(x).float() * self.heads**-0.5  # [B, H_i]
        index = torch.einsum("bh,hbs->bs", weights, scores)  # [B, CAP]
        causal = torch.arange(cap, device=x.device)[None, :] < rows.lengths[:, None]
        top = top_positions(index.masked_fill(~causal, float("-inf")), min(self.topk, cap))  # [B, k]
        return top, causal.gather(1, top)


class SparseLatentAttention(LatentAttention):
    """MLA whose queries see only the positions the indexer keeps."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        self.shared, self.index_dim = layer in cfg.indexer_shared_layers, cfg.index_head_dim
        if not self.shared:
            self.indexer = Indexer(cfg)
        self.source: SparseLatentAttention | None = None  # a shared layer's: the layer that chooses for it
        self.chosen: torch.Tensor | None = None  # this pass's choice [T, S], for the layers sharing it

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVCache, start: int
    ) -> torch.Tensor:
        """x [T, H] continuing kv at `start` -> [T, H]."""
        q_nope, q_pe, latent, q_res = self._project(x, cos, sin)
        assert q_res is not None
        if self.shared:
            assert self.source is not None, "link_shared_indexers wires shared layers to their source"
            assert self.source.chosen is not None, "the source layer chooses first in a pass"
            no_keys = latent.new_zeros(*latent.shape[:2], self.index_dim)  # its value slot stays unused
            cache, _ = kv.write(self.layer, start, latent, no_keys)
            kept = self.source.chosen
        else:
            cache, keys = kv.write(self.layer, start, latent, self.indexer.keys(x, cos, sin))
            kept = self.chosen = self.indexer.select(x, q_res, cos, sin, keys)  # [T, S]
        if x.shape[0] == 1:
            return self.o_proj(self._absorbed(q_nope, q_pe, cache, kept))
        return self.o_proj(self._expanded(q_nope, q_pe, cache, kept))

    def decode(self, h: torch.Tensor, step: DecodeStep) -> torch.Tensor:
        """h [B, H] normed -> the block's output [B, H]: the rows' latents (and, with an indexer of its own,
        index keys) written at their positions, each query attending to the positions its indexer keeps
        (a shared layer: those its source layer chose in this step)."""
        rows, ops = step.rows, step.ops
        cache, keys = step.kv(self.layer)  # [S, 1, CAP, r + dr], [S, 1, CAP, D_i]
        q_nope, q_pe, latent, q_res = self._project(h, step.cos, step.sin)
        assert q_res is not None
        ops.slot_write(latent[0].contiguous(), cache, rows.slots, rows.positions)
        if self.shared:
            assert self.source is not None, "link_shared_indexers wires shared layers to their source"
            top, valid = step.choices[self.source.layer]
        else:
            index_keys = self.indexer.keys(h, step.cos, step.sin)[0].contiguous()  # [B, D_i]
            ops.slot_write(index_keys, keys, rows.slots, rows.positions)
            top, valid = self.indexer.decode_select(h, q_res, step.cos, step.sin, keys, rows)
            step.choices[self.layer] = (top, valid)
        return self.o_proj(self._absorbed_kept(q_nope, q_pe, cache, rows.slots, top, valid))

    def _absorbed_kept(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        cache: torch.Tensor,
        slots: torch.Tensor,
        top: torch.Tensor,
        valid: torch.Tensor,
    ) -> torch.Tensor:
        """`_absorbed` for B rows (q_nope [NH, B, dn], q_pe [NH, B, dr]), each over the latents of its kept
        positions top [B, k] (valid [B, k]) of its slot -> [B, NH * dv]."""
        kept = slot_rows(cache, slots, top)  # [B, k, r + dr]: only what is read
        c, k_pe = kept.split((self.rank, self.d_rope), dim=-1)
        w = self.kv_b_proj.weight.view(self.heads, self.d_nope + self.d_v, self.rank)
        w_uk, w_uv = w[:, : self.d_nope], w[:, self.d_nope :]  # [NH, dn, r], [NH, dv, r]
        q_latent = torch.bmm(q_nope, w_uk)  # [NH, B, r]
        scores = torch.einsum("nbr,bkr->nbk", q_latent, c) + torch.einsum("nbd,bkd->nbk", q_pe, k_pe)
        scores = (scores * self.scale).masked_fill(~valid[None], float("-inf"))  # [NH, B, k]
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(c.dtype)
        out = torch.bmm(torch.einsum("nbk,bkr->nbr", probs, c), w_uv.transpose(1, 2))  # [NH, B, dv]
        return out.transpose(0, 1).reshape(q_nope.shape[1], self.heads * self.d_v)


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
