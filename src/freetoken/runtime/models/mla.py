"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): keys and values come from one compressed latent
per position, and the cache holds only that latent and the shared rope key.

Per position: c = RMSNorm(W_kva x)[:r] (the latent, r = kv_lora_rank) and k_pe = rope(W_kva x)[r:] (one
rope key shared by every head). Per head h: k = [W_UK_h c ; k_pe], v = W_UV_h c (W_UK, W_UV: the rows of
kv_b_proj), q = [q_nope ; rope(q_pe)]. The cache stores [c ; k_pe] per position ([1, S, r + d_rope]: no V),
instead of heads × (d_qk + d_v) numbers.

Prefill runs in the expanded form (the latent through kv_b_proj, then ordinary attention); decode in the
absorbed form: q_nope · W_UK_h c = (W_UK_hᵀ q_nope) · c, so the scores are taken against the latent
directly, and the output W_UV_h (Σ p c) comes after the weighted sum. The two agree (a test checks).

Rope on interleaved pairs (`rope_interleave`, DeepSeek's layout): pairs (x0, x1), (x2, x3), ... rotate
together; the rotated vector is laid out evens first, then odds (for q and k alike, so scores are those
of the pairs).
"""

from __future__ import annotations

import torch
from torch import nn

from freetoken.runtime.config import ModelConfig
from freetoken.runtime.kv.cache import KVCache
from freetoken.runtime.models.kernels.cpu_linear import Linear
from freetoken.runtime.models.latent_decode import latent_slot_attention
from freetoken.runtime.models.layers import RMSNorm, causal_attention
from freetoken.runtime.models.rope import apply_rotary
from freetoken.runtime.models.slot_decode import DecodeStep


def interleaved_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, D] with rope pairs (2j, 2j + 1), cos/sin [T, D] (each angle twice, halves) -> rotated,
    evens first then odds."""
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def yarn_mscale(scale: float, m: float) -> float:
    import math

    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


class LatentAttention(nn.Module):
    """MLA with transformers' parameter names (q_proj or q_a_proj/q_a_layernorm/q_b_proj,
    kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj)."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.heads, self.rank = cfg.num_heads, cfg.kv_lora_rank
        self.d_nope, self.d_rope, self.d_v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        d_qk = self.d_nope + self.d_rope
        if cfg.q_lora_rank:
            self.q_a_proj = Linear(h, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = Linear(cfg.q_lora_rank, self.heads * d_qk, bias=False)
        else:
            self.q_proj = Linear(h, self.heads * d_qk, bias=False)
        self.kv_a_proj_with_mqa = Linear(h, self.rank + self.d_rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, cfg.rms_norm_eps)
        self.kv_b_proj = Linear(self.rank, self.heads * (self.d_nope + self.d_v), bias=False)
        self.o_proj = Linear(self.heads * self.d_v, h, bias=bias)
        self.interleaved, self.roped = cfg.rope_interleave, cfg.mla_rope
        self.scale = d_qk**-0.5
        rope = cfg.rope
        if rope.type != "default" and rope.mscale_all_dim:
            self.scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if not self.roped:  # Kimi-Linear: positions come from its recurrent layers only
            return x
        return interleaved_rotary(x, cos, sin) if self.interleaved else apply_rotary(x, cos, sin)

    def _project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x [T, H] -> q_nope [NH, T, dn], q_pe [NH, T, dr] (roped), latent [1, T, r + dr] (c, roped k_pe),
        and the normed low-rank query [T, q_lora_rank] (None without one)."""
        t = x.shape[0]
        q_res = self.q_a_layernorm(self.q_a_proj(x)) if hasattr(self, "q_b_proj") else None
        q = self.q_b_proj(q_res) if q_res is not None else self.q_proj(x)
        q = q.view(t, self.heads, self.d_nope + self.d_rope).transpose(0, 1)  # [NH, T, d_qk]
        q_nope, q_pe = q.split((self.d_nope, self.d_rope), dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split((self.rank, self.d_rope), dim=-1)
        latent = torch.cat((self.kv_a_layernorm(c), self._rope(k_pe, cos, sin)), dim=-1)
        return q_nope, self._rope(q_pe, cos, sin), latent[None], q_res

    def _expanded(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, kept: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The queries (last T positions) against the cached latents [1, S, r + dr], keys and values
        expanded per head -> [T, NH * dv]; `kept` [T, S] bool: the keys each query may see (default: the
        causal ones)."""
        s = cache.shape[1]
        c, k_pe = cache[0].split((self.rank, self.d_rope), dim=-1)  # [S, r], [S, dr]
        kv = self.kv_b_proj(c).view(s, self.heads, self.d_nope + self.d_v).transpose(0, 1)  # [NH, S, dn + dv]
        k_nope, v = kv.split((self.d_nope, self.d_v), dim=-1)
        k = torch.cat((k_nope, k_pe[None].expand(self.heads, s, self.d_rope)), dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1)
        if kept is None:
            return causal_attention(q, k, v.contiguous(), self.scale)
        scores = torch.bmm(q, k.transpose(1, 2)).float() * self.scale  # [NH, T, S]
        probs = torch.softmax(scores.masked_fill(~kept, float("-inf")), dim=-1).to(v.dtype)
        return torch.bmm(probs, v).transpose(0, 1).reshape(q.shape[1], -1)

    def _absorbed(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, kept: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One query per head [NH, 1, *] against the cached latents, never expanded -> [1, NH * dv];
        `kept` [1, S] bool: the keys it may see (default: all)."""
        c, k_pe = cache[0].split((self.rank, self.d_rope), dim=-1)  # [S, r], [S, dr]
        w = self.kv_b_proj.weight.view(self.heads, self.d_nope + self.d_v, self.rank)
        w_uk, w_uv = w[:, : self.d_nope], w[:, self.d_nope :]  # [NH, dn, r], [NH, dv, r]
        q_latent = torch.bmm(q_nope, w_uk)  # [NH, 1, r]
        scores = (q_latent @ c.T + q_pe @ k_pe.T) * self.scale  # [NH, 1, S]
        if kept is not None:
            scores = scores.masked_fill(~kept, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(c.dtype)
        out = torch.bmm(probs @ c, w_uv.transpose(1, 2))  # [NH, 1, dv]
        return out.transpose(0, 1).reshape(1, self.heads * self.d_v)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVCache, start: int
    ) -> torch.Tensor:
        q_nope, q_pe, latent, _ = self._project(x, cos, sin)
        cache, _ = kv.write(self.layer, start, latent, latent[..., :0])  # [1, start + T, r + dr]
        if x.shape[0] == 1:
            return self.o_proj(self._absorbed(q_nope, q_pe, cache))
        return self.o_proj(self._expanded(q_nope, q_pe, cache))

    def prepare_decode(self) -> None:
        """Nothing to fuse: the decode reads the checkpoint's projections."""

    def decode(self, h: torch.Tensor, step: DecodeStep) -> torch.Tensor:
        """h [B, H] normed -> the block's output [B, H] (latent_decode.py: absorbed, over the slots)."""
        return latent_slot_attention(self, h, step)
